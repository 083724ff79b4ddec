// The heatmap's tooltip: a cell's top-k tokens under the pointer, kept open on the selected
// cell so a token can be pinned as a target. A part of heatmap.js, kept apart because it is
// the heatmap's only HTML beyond the legend (envoykit.explorer.assets joins it in after
// canvas.js, which says which cell is under the pointer). Tokens reach it only through
// textContent and dataset, never as HTML.

/**
 * The tooltip of cell (l, p): a head line, one row per top-k token (a button that pins it),
 * a hint.
 * @param {Payload} d
 * @param {Grid | undefined} g
 */
function tooltipNodes(d, g, l, p, sticky, pinned) {
  const v = g ? g.values[l][p] : null;
  let head = `layer ${d.layer_labels[l]} · ${show(d.tokens[p])}`;
  if (g && v !== null) head += ` · ${title(g)} ${Number(v).toPrecision(3)}`;
  const table = element("table");
  d.top_ids[l][p].forEach((id, i) => {
    const prob = d.top_probs[l][p][i];
    const button = element("button", "ek-token", show(d.vocab[id]));
    button.dataset.id = String(id);
    button.dataset.token = d.vocab[id];
    button.dataset.prob = String(prob);
    button.title = "pin as target";
    button.classList.toggle("ek-pinned", pinned.includes(id));
    const row = table.insertRow();
    row.insertCell().textContent = d.top_labels ? d.top_labels[i] : String(i + 1);
    row.insertCell().append(button);
    row.insertCell().textContent = Number(prob).toFixed(4);
  });
  const hint = sticky ? "click a token to pin it · Esc closes" : "click the cell to select";
  return [element("div", "ek-tip-head", head), table, element("div", "ek-tip-foot", hint)];
}

function hideTip(view) {
  view.sticky = false;
  view.tip.hidden = true;
  document.removeEventListener("keydown", view.onKey);
  document.removeEventListener("mousedown", view.onOutside);
}

function fillTip(view, l, p) {
  const pinned = view.model.get("pinned") || [];
  view.tip.replaceChildren(...tooltipNodes(data(view), grid(view), l, p, view.sticky, pinned));
  view.tip.dataset.layer = String(l);
  view.tip.dataset.position = String(p);
}

function showTip(view, cell, clientX, clientY) {
  const { tip, root } = view;
  fillTip(view, ...cell);
  tip.hidden = false;
  document.addEventListener("keydown", view.onKey);
  document.addEventListener("mousedown", view.onOutside);
  const box = root.getBoundingClientRect();
  let left = clientX - box.left + 14;
  if (left + tip.offsetWidth > box.width) left = Math.max(0, clientX - box.left - tip.offsetWidth - 14);
  tip.style.left = `${left}px`;
  tip.style.top = `${clientY - box.top + 10}px`;
}

/** Hovering shows a cell's tooltip, a click selects the cell and keeps its tooltip open. */
function listenCells(view) {
  const { canvas, tip, model } = view;
  canvas.addEventListener("mousemove", (event) => {
    if (view.sticky || (view.drag && view.drag.ghost)) return;
    const cell = cellAt(view, ...spacerPoint(view, event));
    if (cell) showTip(view, cell, event.clientX, event.clientY);
    else hideTip(view);
  });
  canvas.addEventListener("mouseleave", (event) => {
    if (!view.sticky && !tip.contains(event.relatedTarget)) hideTip(view);
  });
  canvas.addEventListener("click", (event) => {
    if (view.dragged) {
      view.dragged = false;
      return;
    }
    const cell = cellAt(view, ...spacerPoint(view, event));
    if (!cell) {
      hideTip(view);
      return;
    }
    view.sticky = true;
    model.set("selected", cell);
    model.save_changes();
    showTip(view, cell, event.clientX, event.clientY);
  });
  tip.addEventListener("click", (event) => {
    const button = event.target.closest(".ek-token");
    if (!button) return;
    const id = Number(button.dataset.id);
    const pinned = model.get("pinned") || [];
    if (!pinned.includes(id)) {
      model.set("pinned", [...pinned, id]);
      model.save_changes();
    }
    button.classList.add("ek-pinned");
  });
}
