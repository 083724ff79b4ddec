// The heatmap's canvas: where each cell is, and drawing the cells in view, their outlines and
// the frozen axes. A part of heatmap.js, kept apart because every other part asks it where a
// cell is (envoykit.explorer.assets joins it in after colour.js, whose colours it draws).
//
// Only the cells in view are drawn (the canvas is the size of the scroll viewport, the scroll
// area is a sized spacer), so 80 layers x 512 positions scrolls as smoothly as 3 x 2.
// Tokens reach the canvas as text (fillText), never as HTML.

const CELL_W = 52; // a cell's narrowest width unless its payload names one (cell_width)
const CELL_MAX_W = 96; // the widest a cell grows to fill the room the heatmap is given
// The share of the explorer's row the main heatmap's cells fill; the open panel beside it
// has the rest, less its margin (a narrower panel scrolls its own diff).
const HEATMAP_SHARE = 0.5;
const PANEL_MARGIN = 12;
// What the scroll area adds around its cells: its borders, and a vertical scroll bar.
const SCROLLER_EXTRA = 20;
const CELL_H = 20;
const LEFT = 52; // room for the layer labels
const BOTTOM = 56; // room for the token labels
const MAX_HEIGHT = 520;

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

/**
 * The box whose width the explorer's main heatmap fits (`room`): its row. A panel's
 * heatmaps keep their widths (a diff's cells are sized to its labels, which a narrower
 * panel would cut), as does a standalone page's.
 */
const ground = (view) =>
  view.root.closest(".ek-panels") ? null : view.root.closest(".ek-beside");

/**
 * The width the main heatmap may fill: its share of its row, the open panel having the
 * rest (0 elsewhere: the narrowest cells). The row's width does not depend on the heatmap
 * (its own box does), so cells fitted to it cannot push the panel under the heatmap, nor
 * grow with their own box.
 */
function room(view) {
  const box = ground(view);
  return box ? box.clientWidth * HEATMAP_SHARE - PANEL_MARGIN : 0;
}

/**
 * The cells' width: at least a lens's CELL_W or a diff's longest text (`cell_width`), and
 * wider, up to CELL_MAX_W, where `room` holds every position, so tokens are cut less.
 */
function fittedCellW(view) {
  const least = data(view).cell_width || CELL_W;
  const nP = dims(view)[1];
  if (!nP) return least;
  const filling = Math.floor((room(view) - LEFT - SCROLLER_EXTRA) / nP);
  return Math.max(least, Math.min(Math.max(CELL_MAX_W, least), filling));
}

// Cell (layer index, position index) -> its top-left corner in spacer coordinates.
// The width is the one `layout` fitted (`fittedCellW`).
const cellW = (view) => view.cellW || data(view).cell_width || CELL_W;
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

/** `text` cut with an ellipsis to fit `width` pixels in the canvas's current font. */
function fit(ctx, text, width) {
  if (ctx.measureText(text).width <= width) return text;
  let cut = text;
  while (cut.length > 1 && ctx.measureText(cut + "…").width > width) cut = cut.slice(0, -1);
  return cut + "…";
}

/** The scroll area sized to the data, then everything drawn. */
function layout(view) {
  const [nL, nP] = dims(view);
  const height = nL * CELL_H + BOTTOM;
  view.cellW = fittedCellW(view);
  view.root.dataset.cellWidth = String(view.cellW);
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
      const shown = fit(ctx, visibleToken(text), cellW(view) - 4);
      ctx.fillText(shown, x + cellW(view) / 2, y + CELL_H / 2);
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
    ctx.fillText(fit(ctx, visibleToken(d.tokens[p]), BOTTOM + 20), 0, 0);
    ctx.restore();
  }
  ctx.textAlign = "left";
  ctx.fillText("layer", 4, 8);
}

/** Repaints on scroll, resize and theme switch; returns what stops listening. */
function listenPage(view) {
  const repaint = () => requestAnimationFrame(() => draw(view));
  view.scroller.addEventListener("scroll", repaint);
  const resize = new ResizeObserver(() => draw(view));
  resize.observe(view.scroller);
  // The room changed (the notebook resized, the file browser closed): the cells refit.
  // The heatmap is placed in the page after `render`: its own box is watched until then.
  let watched = null;
  const refit = new ResizeObserver(() => {
    const box = ground(view);
    if (box && box !== watched) refit.observe((watched = box));
    if (fittedCellW(view) !== view.cellW) layout(view);
  });
  refit.observe(view.root);
  // A theme switch (JupyterLab's menu, or the reader's colour scheme on the standalone page)
  // changes the --jp-* variables under the canvas, which has to be painted again.
  const themes = new MutationObserver(repaint);
  themes.observe(document.body, { attributes: true, attributeFilter: ["data-jp-theme-name"] });
  const scheme = window.matchMedia("(prefers-color-scheme: dark)");
  scheme.addEventListener("change", repaint);
  return () => {
    resize.disconnect();
    refit.disconnect();
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
