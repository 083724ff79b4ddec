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

const TOKEN_MARKS = { " ": "\u2423", "\n": "\u21b5", "\t": "\u21e5" };

/**
 * A token as cells and axes write it: a space as ␣, a newline as ↵, a tab as ⇥ and any
 * other control or blank character as an escape (envoykit.plot.text.token_text, the same
 * rule).
 */
function visibleToken(token) {
  return Array.from(String(token), (char) => {
    if (char in TOKEN_MARKS) return TOKEN_MARKS[char];
    const code = char.codePointAt(0);
    const control = code < 0x20 || (code >= 0x7f && code < 0xa0);
    if (!control && !/\s/u.test(char)) return char;
    return code < 0x100 ? `\\x${code.toString(16).padStart(2, "0")}` : `\\u${code.toString(16).padStart(4, "0")}`;
  }).join("");
}
