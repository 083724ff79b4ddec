// What every browser module of envoykit builds its elements with. The Python side
// (envoykit.explorer.assets.module) puts this file in front of each module's source, so a
// module calls `element` and `show` without importing them: anywidget's modules and the
// standalone page load one source text each.

/** A new element with a class and, optionally, its text (as text, never as HTML). */
function element(tag, className = "", text = null) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== null) node.textContent = text;
  return node;
}

/** Whitespace matters in tokens: show them quoted and escaped, the way Python's repr would. */
function show(token) {
  return JSON.stringify(String(token));
}
