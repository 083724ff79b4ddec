// The logit-lens heatmap: layers x positions on one <canvas>, last layer on top.
//
// Only the cells in view are drawn (the canvas is the size of the scroll viewport, the scroll
// area is a sized spacer), so 80 layers x 512 positions scrolls as smoothly as 3 x 2.
// State crosses to Python only through the traitlets `data`, `metric`, `selected`, `pinned`,
// and `drop`. The same view draws the diff of two runs (envoykit.explorer.payload.compare_data):
// its payload names the tooltip's rows and writes each cell's text itself.
//
// A cell can be dragged from one heatmap onto another (pointer events: a canvas is no HTML5
// drag source). The heatmap whose `drag_role` is "source" follows the pointer from pointerdown
// on, with the pointer captured; it tells the heatmap under the pointer, if that one's role is
// "target" and its `drag_group` the same, through DOM events on its root: "ek-dragover" (it
// outlines where the cell would land and names it in the event's detail), "ek-dragleave" and
// "ek-drop", on which the target sets its `drop` traitlet. Neither knows the other's model.
//
// Colours come from two places only: each metric's colour stops in the payload (sampled in
// envoykit/metrics.py from matplotlib's maps, so the static figure and this view agree) and
// the page's theme (JupyterLab's --jp-* variables through explorer.css's --ek-* ones, with
// fallbacks for the standalone page). Tokens are arbitrary text: they reach the page only
// through textContent, dataset and the canvas, never as HTML.
//
// One `View` object holds a heatmap's elements and what the pointer is doing; every function
// below takes it, and `render` only builds one and wires the events to those functions.
// `element` comes from dom.js, which the kernel puts in front of this source.

/**
 * One metric over layers x positions and how to colour it (envoykit.metrics.Metric.scale).
 * @typedef {object} Grid
 * @property {string} key      "prob", "entropy", "kl" or a target's label
 * @property {string} label    e.g. "entropy"
 * @property {string} units    e.g. "nats"; "" for a probability
 * @property {string} cmap     matplotlib's name of the colour map
 * @property {string[]} stops  that colour map sampled evenly, "#rrggbb", low values first
 * @property {number} vmin     the value drawn in the first stop's colour
 * @property {number} vmax     the value drawn in the last stop's colour
 * @property {(number|null)[][]} values  [layer][position]; null where undefined (NaN)
 */

/**
 * The `data` traitlet (envoykit.explorer.payload.heatmap_data).
 * @typedef {object} Payload
 * @property {string} prompt
 * @property {string[]} layer_labels         [rows], bottom first: "embed", "12", "12.attn", "12.mid"
 * @property {string[]} tokens               [positions]
 * @property {number[][][]} top_ids          [layer][position][k], most likely first
 * @property {Object<string, string>} vocab  token text by id, each id once
 * @property {(number|null)[][][]} top_probs [layer][position][k]
 * @property {Object<string, Grid>} grids    one per metric, by key
 * @property {number[][]} [marks]            [layer, position] cells outlined (a patched cell)
 * @property {string[]} [top_labels]         [k] names of the tooltip's rows; default 1..k
 * @property {string[][]} [cell_text]        [layer][position] text of each cell; default top-1
 */

/**
 * What a dragged cell carries in the detail of the "ek-dragover" and "ek-drop" events.
 * @typedef {object} Dragged
 * @property {number[]} cell     [layer, position] in the source heatmap
 * @property {string} label      the source row's label: the target outlines the same row
 * @property {number} clientX
 * @property {number} clientY
 * @property {string} [landing]  set by the target on "ek-dragover": where the cell would land
 */

/**
 * The page's colours as the canvas needs them (CSS strings).
 * @typedef {{bg: string, fg: string, nan: string, select: string, accent: string}} Theme
 */

const CELL_W = 52; // a cell's width unless its payload names one (cell_width)
const CELL_H = 20;
const LEFT = 52; // room for the layer labels
const BOTTOM = 56; // room for the token labels
const MAX_HEIGHT = 520;
const EVEN_CONTRAST = 0.179; // luminance where black and white text contrast equally
const DRAG_START = 5; // pixels the pointer moves, button down, before a press becomes a drag

/** "#rrggbb" -> [r, g, b], each 0..255. */
function hexToRgb(hex) {
  const n = parseInt(hex.slice(1), 16);
  return [(n >> 16) & 255, (n >> 8) & 255, n & 255];
}

/** The colour at t (0..1) along the stops, linear between neighbours. */
function colourAt(stops, t) {
  const x = Math.min(1, Math.max(0, t)) * (stops.length - 1);
  const i = Math.min(stops.length - 2, Math.floor(x));
  const f = x - i;
  return stops[i].map((c, j) => Math.round(c + f * (stops[i + 1][j] - c)));
}

/** Near-black or white, whichever reads better on rgb: the rule of metrics.text_colour. */
function textColour(rgb) {
  const linear = rgb.map((c) => {
    const s = c / 255;
    return s <= 0.04045 ? s / 12.92 : ((s + 0.055) / 1.055) ** 2.4;
  });
  const luminance = 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2];
  return luminance > EVEN_CONTRAST ? "#111111" : "#ffffff";
}

/** @returns {Theme} read from the --ek-* variables explorer.css sets on the heatmap. */
function theme(root) {
  const style = getComputedStyle(root);
  const get = (name, fallback) => style.getPropertyValue(name).trim() || fallback;
  return {
    bg: get("--ek-bg", "#fff"),
    fg: get("--ek-fg", "#222"),
    nan: get("--ek-nan", "#ddd"),
    select: get("--ek-select", "#e8590c"),
    accent: get("--ek-accent", "#1976d2"),
  };
}

/** Whitespace matters in tokens: show them quoted and escaped, the way Python's repr would. */
function show(token) {
  return JSON.stringify(String(token));
}

/** `text` cut with an ellipsis to fit `width` pixels in the canvas's current font. */
function fit(ctx, text, width) {
  if (ctx.measureText(text).width <= width) return text;
  let cut = text;
  while (cut.length > 1 && ctx.measureText(cut + "…").width > width) cut = cut.slice(0, -1);
  return cut + "…";
}

/** @param {Grid} g */
function title(g) {
  return g.units ? `${g.label} (${g.units})` : g.label;
}

/**
 * A legend number for people: 0 for what is zero at the scale's resolution (an entropy's
 * 4.8e-22 on a scale of 5 nats; no span: never), else three significant digits without
 * trailing zeros.
 */
function human(value, span) {
  const v = Number(value);
  if (span && Math.abs(v) < 1e-3 * Math.abs(span)) return "0";
  return String(Number(v.toPrecision(3)));
}

/**
 * The legend of a grid: what was run and its title, the low value, a colour bar of its
 * stops, the high value.
 */
function legendNodes(g, run, scale) {
  const bar = element("span", "ek-bar");
  bar.style.background = `linear-gradient(90deg, ${g.stops.join(", ")})`;
  const set = scale.vmin !== g.vmin || scale.vmax !== g.vmax;
  const how = set ? " · limits set" : g.robust ? " · 1st–99th percentile" : "";
  const span = scale.log ? scale.vmax : scale.vmax - scale.vmin;
  return [
    element(
      "span",
      "ek-legend-label",
      (run ? `${run} · ` : "") + title(g) + how + (scale.log ? " · log scale" : ""),
    ),
    element("span", "ek-legend-min", human(scale.vmin, scale.log ? 0 : span)),
    bar,
    element("span", "ek-legend-max", human(scale.vmax, span)),
  ];
}

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

/**
 * One heatmap's elements and pointer state.
 * @typedef {object} View
 * @property {object} model            the anywidget model (or the standalone page's stand-in)
 * @property {HTMLElement} root
 * @property {HTMLElement} legend
 * @property {HTMLElement} scroller
 * @property {HTMLElement} spacer
 * @property {HTMLCanvasElement} canvas
 * @property {HTMLElement} tip
 * @property {boolean} sticky   the tooltip stays on the selected cell so its tokens can be clicked
 * @property {object|null} drag a press on this heatmap's cell: {cell, x, y, id, ghost, over}
 * @property {boolean} dragged  a drag just ended here: the click that follows selects nothing
 * @property {{l: number, p: number}|null} landing  where a cell dragged over this heatmap
 *                              would land (l -1: its row is not shown here)
 * @property {(event: KeyboardEvent) => void} onKey  Escape closes the tooltip
 */

/** @returns {View} the elements of one heatmap, appended to `el`. */
function createView(model, el) {
  const root = element("div", "ek-heatmap");
  const legend = element("div", "ek-legend");
  const scroller = element("div", "ek-scroller");
  const spacer = element("div", "ek-spacer");
  const canvas = element("canvas", "ek-canvas");
  const tip = element("div", "ek-tooltip");
  tip.hidden = true;
  spacer.append(canvas);
  scroller.append(spacer);
  root.append(legend, scroller, tip);
  el.append(root);
  const view = { model, root, legend, scroller, spacer, canvas, tip };
  Object.assign(view, { sticky: false, drag: null, dragged: false, landing: null });
  // The canvas cannot take focus, so Escape is heard on the document, only while a tooltip
  // is open.
  view.onKey = (event) => {
    if (event.key === "Escape") hideTip(view);
  };
  return view;
}

/** @returns {Payload} */
function data(view) {
  return view.model.get("data") || {};
}

/** [number of rows, number of positions] */
function dims(view) {
  const d = data(view);
  return [(d.layer_labels || []).length, (d.tokens || []).length];
}

/** @returns {Grid | undefined} the grid of the metric shown (probability when unknown) */
function grid(view) {
  const grids = data(view).grids || {};
  return grids[view.model.get("metric")] || grids.prob;
}

// Cell (layer index, position index) -> its top-left corner in spacer coordinates.
// A diff's cells are as wide as their longest text (`cell_width`), a lens's CELL_W.
const cellW = (view) => data(view).cell_width || CELL_W;
const cellX = (view, p) => LEFT + p * cellW(view);
const cellY = (view, l) => (dims(view)[0] - 1 - l) * CELL_H;

/** The cell [layer, position] at spacer point (x, y), or null. */
function cellAt(view, x, y) {
  const [nL, nP] = dims(view);
  const p = Math.floor((x - LEFT) / cellW(view));
  const l = nL - 1 - Math.floor(y / CELL_H);
  if (x < LEFT || p < 0 || p >= nP || l < 0 || l >= nL || y >= nL * CELL_H) return null;
  return [l, p];
}

/** A pointer event's (or a Dragged detail's) client point in spacer coordinates. */
function spacerPoint(view, event) {
  const rect = view.canvas.getBoundingClientRect();
  return [
    event.clientX - rect.left + view.scroller.scrollLeft,
    event.clientY - rect.top + view.scroller.scrollTop,
  ];
}

/** The scroll area sized to the data, then everything drawn. */
function layout(view) {
  const [nL, nP] = dims(view);
  const height = nL * CELL_H + BOTTOM;
  view.spacer.style.width = `${LEFT + nP * cellW(view)}px`;
  view.spacer.style.height = `${height}px`;
  view.scroller.style.height = `${Math.min(height, MAX_HEIGHT) + 16}px`;
  redraw(view);
}

// The legend and the canvas, after the data or the metric changed (a scroll or a theme
// switch repaints the canvas alone).
function redraw(view) {
  const g = grid(view);
  view.legend.replaceChildren(
    ...(g ? legendNodes(g, data(view).run, colourScale(view, g)) : []),
  );
  draw(view);
}

/** The canvas: the cells in view, the marks, the selection, a landing, the frozen axes. */
function draw(view) {
  const { canvas, scroller } = view;
  const [nL, nP] = dims(view);
  const g = grid(view);
  const colours = theme(view.root);
  const viewW = Math.max(1, Math.min(scroller.clientWidth || 600, LEFT + nP * cellW(view)));
  const viewH = Math.max(1, Math.min(scroller.clientHeight || 300, nL * CELL_H + BOTTOM));
  const ratio = window.devicePixelRatio || 1;
  const sx = scroller.scrollLeft;
  const sy = scroller.scrollTop;
  canvas.width = Math.round(viewW * ratio);
  canvas.height = Math.round(viewH * ratio);
  canvas.style.width = `${viewW}px`;
  canvas.style.height = `${viewH}px`;
  canvas.style.left = `${sx}px`;
  canvas.style.top = `${sy}px`;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.fillStyle = colours.bg;
  ctx.fillRect(0, 0, viewW, viewH);
  if (!g || !nL || !nP) return;
  const range = {
    p0: Math.max(0, Math.floor((sx - LEFT) / cellW(view))),
    p1: Math.min(nP - 1, Math.floor((sx + viewW) / cellW(view))),
    r0: Math.max(0, Math.floor(sy / CELL_H)),
    r1: Math.min(nL - 1, Math.floor((sy + viewH) / CELL_H)),
  };
  ctx.font = "10px sans-serif";
  ctx.textAlign = "center";
  ctx.textBaseline = "middle";
  view.root.dataset.drawn = String(drawCells(view, ctx, g, colours, range));
  drawOutlines(view, ctx, colours);
  drawAxes(view, ctx, colours, range, viewW, viewH);
}

/**
 * The colour scale the cells are drawn with: the grid's limits, or those set in the model's
 * `limits` ({vmin, vmax, log}: the explorer's colour controls); on a log scale a low limit
 * at or below zero becomes a millionth of the high one. Returns the limits and a function
 * from a value to its place on the colour map (0..1, clamped by colourAt).
 */
function colourScale(view, g) {
  const limits = view.model.get("limits") || {};
  const vmax = limits.vmax ?? g.vmax;
  let vmin = limits.vmin ?? g.vmin;
  if (limits.log) {
    if (!(vmin > 0)) vmin = vmax > 0 ? vmax * 1e-6 : 1e-6;
    const low = Math.log(vmin);
    const span = Math.log(Math.max(vmax, vmin * 10)) - low;
    return { vmin, vmax, log: true, at: (v) => (v > 0 ? (Math.log(v) - low) / span : 0) };
  }
  const span = vmax - vmin || 1;
  return { vmin, vmax, log: false, at: (v) => (v - vmin) / span };
}

/** The cells of `range` in their colours and texts; returns how many were drawn. */
function drawCells(view, ctx, g, colours, { p0, p1, r0, r1 }) {
  const d = data(view);
  const nL = dims(view)[0];
  const stops = g.stops.map(hexToRgb);
  const scale = colourScale(view, g);
  const { scrollLeft: sx, scrollTop: sy } = view.scroller;
  let drawn = 0;
  for (let r = r0; r <= r1; r++) {
    const l = nL - 1 - r;
    for (let p = p0; p <= p1; p++) {
      const v = g.values[l][p];
      const rgb = v === null ? null : colourAt(stops, scale.at(v));
      const x = cellX(view, p) - sx;
      const y = cellY(view, l) - sy;
      ctx.fillStyle = rgb ? `rgb(${rgb.join(",")})` : colours.nan;
      ctx.fillRect(x, y, cellW(view) - 1, CELL_H - 1);
      ctx.fillStyle = rgb ? textColour(rgb) : colours.fg;
      const text = d.cell_text ? d.cell_text[l][p] : d.vocab[d.top_ids[l][p][0]];
      ctx.fillText(fit(ctx, text, cellW(view) - 4), x + cellW(view) / 2, y + CELL_H / 2);
      drawn++;
    }
  }
  return drawn;
}

/** The marked cells (dashed), the selected cell, and where a dragged cell would land. */
function drawOutlines(view, ctx, colours) {
  const { scrollLeft: sx, scrollTop: sy } = view.scroller;
  const outline = (l, p, colour, dash) => {
    ctx.strokeStyle = colour;
    ctx.lineWidth = 2;
    ctx.setLineDash(dash);
    ctx.strokeRect(cellX(view, p) - sx + 1, cellY(view, l) - sy + 1, cellW(view) - 3, CELL_H - 3);
    ctx.setLineDash([]);
  };
  for (const [l, p] of data(view).marks || []) outline(l, p, colours.accent, [4, 2]);
  const sel = view.model.get("selected");
  if (sel) outline(sel[0], sel[1], colours.select, []);
  const landing = view.landing;
  if (landing) {
    // The column the pointer is over, and the cell of the dragged row in it.
    ctx.strokeStyle = colours.select;
    ctx.lineWidth = 1;
    ctx.setLineDash([2, 2]);
    const height = dims(view)[0] * CELL_H - 2;
    ctx.strokeRect(cellX(view, landing.p) - sx + 0.5, -sy + 0.5, cellW(view) - 2, height);
    ctx.setLineDash([]);
    if (landing.l >= 0) outline(landing.l, landing.p, colours.select, [5, 3]);
  }
}

/** Frozen axes: layer labels on the left, token labels below, over the scrolled cells. */
function drawAxes(view, ctx, colours, { p0, p1, r0, r1 }, viewW, viewH) {
  const d = data(view);
  const nL = dims(view)[0];
  const { scrollLeft: sx, scrollTop: sy } = view.scroller;
  ctx.fillStyle = colours.bg;
  ctx.fillRect(0, 0, LEFT, viewH);
  ctx.fillRect(0, nL * CELL_H - sy, viewW, viewH);
  ctx.fillStyle = colours.fg;
  ctx.textAlign = "right";
  for (let r = r0; r <= r1; r++) {
    const l = nL - 1 - r;
    ctx.fillText(d.layer_labels[l], LEFT - 6, cellY(view, l) - sy + CELL_H / 2);
  }
  const axisY = Math.min(nL * CELL_H - sy, viewH - BOTTOM);
  ctx.fillStyle = colours.bg;
  ctx.fillRect(0, axisY, viewW, viewH - axisY);
  ctx.fillStyle = colours.fg;
  for (let p = p0; p <= p1; p++) {
    ctx.save();
    ctx.translate(cellX(view, p) - sx + cellW(view) / 2, axisY + 6);
    ctx.rotate(-Math.PI / 4);
    ctx.fillText(fit(ctx, show(d.tokens[p]), BOTTOM + 20), 0, 0);
    ctx.restore();
  }
  ctx.textAlign = "left";
  ctx.fillText("layer", 4, 8);
}

// -- the tooltip ----------------------------------------------------------------------------

function hideTip(view) {
  view.sticky = false;
  view.tip.hidden = true;
  document.removeEventListener("keydown", view.onKey);
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

// -- dragging a cell out (drag_role "source") -----------------------------------------------

/** The root of the heatmap under the pointer that takes this heatmap's drops, or null. */
function dropTargetAt(view, x, y) {
  const hit = document.elementFromPoint(x, y);
  const target = hit && hit.closest(".ek-heatmap[data-drag-role='target']");
  const group = view.model.get("drag_group");
  return target && target !== view.root && group && target.dataset.dragGroup === group
    ? target
    : null;
}

/** @returns {Dragged} */
function dragDetail(view, event) {
  const cell = view.drag.cell;
  const label = data(view).layer_labels[cell[0]];
  return { cell, label, clientX: event.clientX, clientY: event.clientY };
}

function endDrag(view) {
  const drag = view.drag;
  if (!drag) return;
  if (drag.over) drag.over.dispatchEvent(new CustomEvent("ek-dragleave"));
  if (drag.ghost) drag.ghost.remove();
  if (view.canvas.hasPointerCapture(drag.id)) view.canvas.releasePointerCapture(drag.id);
  view.drag = null;
}

/** The ghost follows the pointer and names where the cell would land. */
function moveDrag(view, event) {
  const drag = view.drag;
  if (!drag.ghost) {
    if (Math.hypot(event.clientX - drag.x, event.clientY - drag.y) < DRAG_START) return;
    hideTip(view);
    // On the page's body, not in the widget: JupyterLab's output areas clip what they hold.
    drag.ghost = element("div", "ek-ghost");
    document.body.append(drag.ghost);
  }
  const over = dropTargetAt(view, event.clientX, event.clientY);
  if (drag.over && drag.over !== over) drag.over.dispatchEvent(new CustomEvent("ek-dragleave"));
  drag.over = over;
  const detail = dragDetail(view, event);
  if (over) over.dispatchEvent(new CustomEvent("ek-dragover", { detail }));
  const what = `row ${detail.label} at ${show(data(view).tokens[drag.cell[1]])}`;
  drag.ghost.textContent = detail.landing ? `${what} → ${detail.landing}` : what;
  drag.ghost.classList.toggle("ek-ghost-over", Boolean(detail.landing));
  drag.ghost.style.left = `${event.clientX + 14}px`;
  drag.ghost.style.top = `${event.clientY + 10}px`;
}

function listenDragSource(view) {
  const { canvas, model } = view;
  canvas.addEventListener("pointerdown", (event) => {
    view.dragged = false;
    if (model.get("drag_role") !== "source" || event.button !== 0) return;
    const cell = cellAt(view, ...spacerPoint(view, event));
    if (!cell) return;
    event.preventDefault(); // no text selection while dragging
    const { clientX: x, clientY: y, pointerId: id } = event;
    view.drag = { cell, x, y, id, ghost: null, over: null };
    canvas.setPointerCapture(id);
  });
  canvas.addEventListener("pointermove", (event) => {
    if (view.drag && event.pointerId === view.drag.id) moveDrag(view, event);
  });
  canvas.addEventListener("pointerup", (event) => {
    const drag = view.drag;
    if (!drag || event.pointerId !== drag.id) return;
    if (drag.ghost) {
      view.dragged = true;
      const over = dropTargetAt(view, event.clientX, event.clientY);
      if (over) over.dispatchEvent(new CustomEvent("ek-drop", { detail: dragDetail(view, event) }));
    }
    endDrag(view);
  });
  canvas.addEventListener("pointercancel", () => endDrag(view));
}

// -- taking a dropped cell (drag_role "target") ---------------------------------------------

/** Where the dragged cell would land under the pointer: its own row, the column hovered. */
function landingAt(view, detail) {
  const cell = cellAt(view, ...spacerPoint(view, detail));
  if (!cell) return null;
  return { l: data(view).layer_labels.indexOf(detail.label), p: cell[1] };
}

function listenDropTarget(view) {
  const { root, model } = view;
  const repaint = () => requestAnimationFrame(() => draw(view));
  root.addEventListener("ek-dragover", (event) => {
    if (!view.tip.hidden) hideTip(view); // it would hide where the cell lands
    const landing = landingAt(view, event.detail);
    view.landing = landing;
    if (landing) {
      const row = landing.l >= 0 ? `, row ${event.detail.label}` : "";
      event.detail.landing = `position ${landing.p} ${show(data(view).tokens[landing.p])}${row}`;
    }
    repaint();
  });
  root.addEventListener("ek-dragleave", () => {
    view.landing = null;
    repaint();
  });
  root.addEventListener("ek-drop", (event) => {
    view.landing = null;
    const cell = cellAt(view, ...spacerPoint(view, event.detail));
    if (cell) {
      model.set("drop", { source: event.detail.cell, target: cell });
      model.save_changes();
    }
    repaint();
  });
  const roles = () => {
    root.dataset.dragRole = model.get("drag_role") || "";
    root.dataset.dragGroup = model.get("drag_group") || "";
  };
  roles();
  model.on("change:drag_role", roles);
  model.on("change:drag_group", roles);
}

/** Repaints on scroll, resize and theme switch; returns what stops listening. */
function listenPage(view) {
  const repaint = () => requestAnimationFrame(() => draw(view));
  view.scroller.addEventListener("scroll", repaint);
  const resize = new ResizeObserver(() => draw(view));
  resize.observe(view.scroller);
  // A theme switch (JupyterLab's menu, or the reader's colour scheme on the standalone page)
  // changes the --jp-* variables under the canvas, which has to be painted again.
  const themes = new MutationObserver(repaint);
  themes.observe(document.body, { attributes: true, attributeFilter: ["data-jp-theme-name"] });
  const scheme = window.matchMedia("(prefers-color-scheme: dark)");
  scheme.addEventListener("change", repaint);
  return () => {
    resize.disconnect();
    themes.disconnect();
    scheme.removeEventListener("change", repaint);
  };
}

/** A hook for tests and scripts: where on screen cell (l, p) is, scrolled into view. */
function cellCenter(view, l, p) {
  const { scroller, canvas } = view;
  scroller.scrollLeft = Math.max(0, cellX(view, p) - scroller.clientWidth / 2);
  scroller.scrollTop = Math.max(0, cellY(view, l) - scroller.clientHeight / 2);
  draw(view);
  const rect = canvas.getBoundingClientRect();
  return {
    x: rect.left + cellX(view, p) - scroller.scrollLeft + cellW(view) / 2,
    y: rect.top + cellY(view, l) - scroller.scrollTop + CELL_H / 2,
  };
}

function render({ model, el }) {
  const view = createView(model, el);
  listenCells(view);
  listenDragSource(view);
  listenDropTarget(view);
  const stopPage = listenPage(view);
  view.root.ekCellCenter = (l, p) => cellCenter(view, l, p);
  model.on("change:data", () => {
    hideTip(view);
    layout(view);
  });
  model.on("change:metric", () => {
    redraw(view);
    const tip = view.tip;
    if (!tip.hidden) fillTip(view, Number(tip.dataset.layer), Number(tip.dataset.position));
  });
  model.on("change:selected", () => draw(view));
  model.on("change:limits", () => redraw(view));
  // A refused run leaves the last heatmap dimmed (`stale`), set by the kernel.
  const mark = () => el.classList.toggle("ek-stale", Boolean(model.get("stale")));
  model.on("change:stale", mark);
  mark();
  layout(view);
  requestAnimationFrame(() => draw(view));
  return () => {
    hideTip(view);
    endDrag(view);
    stopPage();
  };
}

export default { render };
