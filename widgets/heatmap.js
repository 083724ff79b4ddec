// The logit-lens heatmap: layers x positions on one <canvas>, last layer on top.
//
// State crosses to Python only through the traitlets `data`, `metric`, `selected`, `pinned`,
// and `drop`. The same view draws the diff of two runs (envoykit.explorer.payload.compare_data):
// its payload names the tooltip's rows and writes each cell's text itself. Tokens are
// arbitrary text: they reach the page only through textContent, dataset and the canvas, never
// as HTML.
//
// This file holds what is left once the heatmap's jobs are parted out: the payload's shape,
// the `View` state object and `render`, which builds one and wires the events. The kernel
// puts the parts in front of this source, in this order (envoykit.explorer.assets.PARTS):
// dom.js (`element`, `show`), colour.js (scales, stops, text colour, the legend), canvas.js
// (where cells are, drawing them), tooltip.js and drag.js (drag-to-patch). Each part's
// functions take the `View`; none keeps state of its own.

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
 * @property {(event: MouseEvent) => void} onOutside  a press outside the heatmap closes it
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
  // The canvas cannot take focus, so Escape, and a press outside the heatmap, are heard on
  // the document, only while a tooltip is open.
  view.onKey = (event) => {
    if (event.key === "Escape") hideTip(view);
  };
  view.onOutside = (event) => {
    if (!root.contains(event.target)) hideTip(view);
  };
  return view;
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
