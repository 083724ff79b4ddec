// The logit-lens heatmap: layers x positions on one <canvas>, last layer on top.
//
// Only the cells in view are drawn (the canvas is the size of the scroll viewport, the scroll
// area is a sized spacer), so 80 layers x 512 positions scrolls as smoothly as 3 x 2.
// State crosses to Python only through the traitlets `data`, `metric`, `selected`, `pinned`.
//
// Colours come from two places only: each metric's colour stops in the payload (sampled in
// envoykit/metrics.py from matplotlib's maps, so the static figure and this view agree) and
// the page's theme (JupyterLab's --jp-* variables through explorer.css's --ek-* ones, with
// fallbacks for the standalone page). Tokens are arbitrary text: they reach the page only
// through textContent, dataset and the canvas, never as HTML.

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
 */

/**
 * The page's colours as the canvas needs them (CSS strings).
 * @typedef {{bg: string, fg: string, nan: string, select: string}} Theme
 */

const CELL_W = 52;
const CELL_H = 20;
const LEFT = 52; // room for the layer labels
const BOTTOM = 56; // room for the token labels
const MAX_HEIGHT = 520;
const EVEN_CONTRAST = 0.179; // luminance where black and white text contrast equally

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

/** A new element with a class and, optionally, its text (as text, never as HTML). */
function element(tag, className = "", text = null) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== null) node.textContent = text;
  return node;
}

/** @param {Grid} g */
function title(g) {
  return g.units ? `${g.label} (${g.units})` : g.label;
}

/** The legend of a grid: its title, the low value, a colour bar of its stops, the high value. */
function legendNodes(g) {
  const bar = element("span", "ek-bar");
  bar.style.background = `linear-gradient(90deg, ${g.stops.join(", ")})`;
  return [
    element("span", "ek-legend-label", title(g)),
    element("span", "", Number(g.vmin).toPrecision(3)),
    bar,
    element("span", "", Number(g.vmax).toPrecision(3)),
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
    row.insertCell().textContent = String(i + 1);
    row.insertCell().append(button);
    row.insertCell().textContent = Number(prob).toFixed(4);
  });
  const hint = sticky ? "click a token to pin it · Esc closes" : "click the cell to select";
  return [element("div", "ek-tip-head", head), table, element("div", "ek-tip-foot", hint)];
}

function render({ model, el }) {
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

  let sticky = false; // the tooltip stays on the selected cell so its tokens can be clicked

  /** @returns {Payload} */
  const data = () => model.get("data") || {};
  const dims = () => {
    const d = data();
    return [(d.layer_labels || []).length, (d.tokens || []).length];
  };
  /** @returns {Grid | undefined} */
  const grid = () => {
    const d = data();
    return (d.grids || {})[model.get("metric")] || (d.grids || {}).prob;
  };

  function layout() {
    const [nL, nP] = dims();
    const width = LEFT + nP * CELL_W;
    const height = nL * CELL_H + BOTTOM;
    spacer.style.width = `${width}px`;
    spacer.style.height = `${height}px`;
    scroller.style.height = `${Math.min(height, MAX_HEIGHT) + 16}px`;
    redraw();
  }

  // The legend and the canvas, after the data or the metric changed (a scroll or a theme
  // switch repaints the canvas alone).
  function redraw() {
    const g = grid();
    legend.replaceChildren(...(g ? legendNodes(g) : []));
    draw();
  }

  // Cell (layer index, position index) -> its top-left corner in spacer coordinates.
  const cellX = (p) => LEFT + p * CELL_W;
  const cellY = (l) => (dims()[0] - 1 - l) * CELL_H;

  function cellAt(x, y) {
    const [nL, nP] = dims();
    const p = Math.floor((x - LEFT) / CELL_W);
    const l = nL - 1 - Math.floor(y / CELL_H);
    if (x < LEFT || p < 0 || p >= nP || l < 0 || l >= nL || y >= nL * CELL_H) return null;
    return [l, p];
  }

  function draw() {
    const [nL, nP] = dims();
    const g = grid();
    const colours = theme(root);
    const viewW = Math.max(1, Math.min(scroller.clientWidth || 600, LEFT + nP * CELL_W));
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

    const d = data();
    const stops = g.stops.map(hexToRgb);
    const span = g.vmax - g.vmin || 1;
    const p0 = Math.max(0, Math.floor((sx - LEFT) / CELL_W));
    const p1 = Math.min(nP - 1, Math.floor((sx + viewW) / CELL_W));
    const r0 = Math.max(0, Math.floor(sy / CELL_H));
    const r1 = Math.min(nL - 1, Math.floor((sy + viewH) / CELL_H));
    ctx.font = "10px sans-serif";
    ctx.textAlign = "center";
    ctx.textBaseline = "middle";
    let drawn = 0;
    for (let r = r0; r <= r1; r++) {
      const l = nL - 1 - r;
      for (let p = p0; p <= p1; p++) {
        const v = g.values[l][p];
        const rgb = v === null ? null : colourAt(stops, (v - g.vmin) / span);
        const x = cellX(p) - sx;
        const y = cellY(l) - sy;
        ctx.fillStyle = rgb ? `rgb(${rgb.join(",")})` : colours.nan;
        ctx.fillRect(x, y, CELL_W - 1, CELL_H - 1);
        ctx.fillStyle = rgb ? textColour(rgb) : colours.fg;
        ctx.fillText(fit(ctx, d.vocab[d.top_ids[l][p][0]], CELL_W - 4), x + CELL_W / 2, y + CELL_H / 2);
        drawn++;
      }
    }
    const sel = model.get("selected");
    if (sel) {
      ctx.strokeStyle = colours.select;
      ctx.lineWidth = 2;
      ctx.strokeRect(cellX(sel[1]) - sx + 1, cellY(sel[0]) - sy + 1, CELL_W - 3, CELL_H - 3);
    }
    // Frozen axes: layer labels on the left, token labels below, over the scrolled cells.
    ctx.fillStyle = colours.bg;
    ctx.fillRect(0, 0, LEFT, viewH);
    ctx.fillRect(0, nL * CELL_H - sy, viewW, viewH);
    ctx.fillStyle = colours.fg;
    ctx.textAlign = "right";
    for (let r = r0; r <= r1; r++) {
      const l = nL - 1 - r;
      ctx.fillText(d.layer_labels[l], LEFT - 6, cellY(l) - sy + CELL_H / 2);
    }
    const axisY = Math.min(nL * CELL_H - sy, viewH - BOTTOM);
    ctx.fillStyle = colours.bg;
    ctx.fillRect(0, axisY, viewW, viewH - axisY);
    ctx.fillStyle = colours.fg;
    for (let p = p0; p <= p1; p++) {
      ctx.save();
      ctx.translate(cellX(p) - sx + CELL_W / 2, axisY + 6);
      ctx.rotate(-Math.PI / 4);
      ctx.fillText(fit(ctx, show(d.tokens[p]), BOTTOM + 20), 0, 0);
      ctx.restore();
    }
    ctx.textAlign = "left";
    ctx.fillText("layer", 4, 8);
    root.dataset.drawn = String(drawn);
  }

  // The canvas cannot take focus, so Escape is heard on the document, only while a tooltip
  // is open.
  const onKey = (event) => {
    if (event.key === "Escape") hideTip();
  };

  function hideTip() {
    sticky = false;
    tip.hidden = true;
    document.removeEventListener("keydown", onKey);
  }

  function fillTip(l, p) {
    tip.replaceChildren(...tooltipNodes(data(), grid(), l, p, sticky, model.get("pinned") || []));
    tip.dataset.layer = String(l);
    tip.dataset.position = String(p);
  }

  function showTip(cell, clientX, clientY) {
    fillTip(...cell);
    tip.hidden = false;
    document.addEventListener("keydown", onKey);
    const box = root.getBoundingClientRect();
    let left = clientX - box.left + 14;
    if (left + tip.offsetWidth > box.width) left = Math.max(0, clientX - box.left - tip.offsetWidth - 14);
    tip.style.left = `${left}px`;
    tip.style.top = `${clientY - box.top + 10}px`;
  }

  function spacerPoint(event) {
    const rect = canvas.getBoundingClientRect();
    return [event.clientX - rect.left + scroller.scrollLeft, event.clientY - rect.top + scroller.scrollTop];
  }

  canvas.addEventListener("mousemove", (event) => {
    if (sticky) return;
    const cell = cellAt(...spacerPoint(event));
    if (cell) showTip(cell, event.clientX, event.clientY);
    else hideTip();
  });
  canvas.addEventListener("mouseleave", (event) => {
    if (!sticky && !tip.contains(event.relatedTarget)) hideTip();
  });
  canvas.addEventListener("click", (event) => {
    const cell = cellAt(...spacerPoint(event));
    if (!cell) {
      hideTip();
      return;
    }
    sticky = true;
    model.set("selected", cell);
    model.save_changes();
    showTip(cell, event.clientX, event.clientY);
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
  scroller.addEventListener("scroll", () => requestAnimationFrame(draw));
  const resize = new ResizeObserver(() => draw());
  resize.observe(scroller);
  // A theme switch (JupyterLab's menu, or the reader's colour scheme on the standalone page)
  // changes the --jp-* variables under the canvas, which has to be painted again.
  const themeChange = () => requestAnimationFrame(draw);
  const themes = new MutationObserver(themeChange);
  themes.observe(document.body, { attributes: true, attributeFilter: ["data-jp-theme-name"] });
  const scheme = window.matchMedia("(prefers-color-scheme: dark)");
  scheme.addEventListener("change", themeChange);

  // A hook for tests and scripts: where on screen cell (l, p) is, scrolled into view.
  root.ekCellCenter = (l, p) => {
    scroller.scrollLeft = Math.max(0, cellX(p) - scroller.clientWidth / 2);
    scroller.scrollTop = Math.max(0, cellY(l) - scroller.clientHeight / 2);
    draw();
    const rect = canvas.getBoundingClientRect();
    return {
      x: rect.left + cellX(p) - scroller.scrollLeft + CELL_W / 2,
      y: rect.top + cellY(l) - scroller.scrollTop + CELL_H / 2,
    };
  };

  model.on("change:data", () => {
    hideTip();
    layout();
  });
  model.on("change:metric", () => {
    redraw();
    if (!tip.hidden) fillTip(Number(tip.dataset.layer), Number(tip.dataset.position));
  });
  model.on("change:selected", draw);
  layout();
  requestAnimationFrame(draw);
  return () => {
    hideTip();
    resize.disconnect();
    themes.disconnect();
    scheme.removeEventListener("change", themeChange);
  };
}

export default { render };
