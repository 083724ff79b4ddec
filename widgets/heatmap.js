// The logit-lens heatmap: layers x positions on one <canvas>, last layer on top.
//
// Only the cells in view are drawn (the canvas is the size of the scroll viewport, the scroll
// area is a sized spacer), so 80 layers x 512 positions scrolls as smoothly as 3 x 2.
// State crosses to Python only through the traitlets `data`, `metric`, `selected`, `pinned`.

const CELL_W = 52;
const CELL_H = 20;
const LEFT = 52; // room for the layer labels
const BOTTOM = 56; // room for the token labels
const MAX_HEIGHT = 520;

// A few stops of the matplotlib colour maps the static heatmap uses.
const CMAPS = {
  Blues: ["#f7fbff", "#deebf7", "#c6dbef", "#9ecae1", "#6baed6", "#4292c6", "#2171b5", "#084594"],
  Greens: ["#f7fcf5", "#e5f5e0", "#c7e9c0", "#a1d99b", "#74c476", "#41ab5d", "#238b45", "#005a32"],
  magma_r: ["#fcfdbf", "#feb078", "#f1605d", "#b73779", "#721f81", "#2c115f", "#000004"],
  viridis_r: ["#fde725", "#7ad151", "#22a884", "#2a788e", "#414487", "#440154"],
};

function hexToRgb(hex) {
  const n = parseInt(hex.slice(1), 16);
  return [(n >> 16) & 255, (n >> 8) & 255, n & 255];
}

function colour(cmap, t) {
  const stops = (CMAPS[cmap] || CMAPS.Blues).map(hexToRgb);
  const x = Math.min(1, Math.max(0, t)) * (stops.length - 1);
  const i = Math.min(stops.length - 2, Math.floor(x));
  const f = x - i;
  const rgb = stops[i].map((c, j) => Math.round(c + f * (stops[i + 1][j] - c)));
  const light = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] > 140;
  return { fill: `rgb(${rgb.join(",")})`, text: light ? "#111" : "#fff" };
}

function show(token) {
  // Whitespace matters in tokens: show it the way Python's repr would.
  return JSON.stringify(String(token));
}

function fit(ctx, text, width) {
  if (ctx.measureText(text).width <= width) return text;
  let cut = text;
  while (cut.length > 1 && ctx.measureText(cut + "…").width > width) cut = cut.slice(0, -1);
  return cut + "…";
}

function element(tag, className) {
  const node = document.createElement(tag);
  node.className = className;
  return node;
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

  const data = () => model.get("data") || {};
  const dims = () => {
    const d = data();
    return [(d.layer_labels || []).length, (d.tokens || []).length];
  };
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
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, viewW, viewH);
    legend.textContent = "";
    if (!g || !nL || !nP) return;

    const d = data();
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
        const c = v === null ? { fill: "#ddd", text: "#111" } : colour(g.cmap, (v - g.vmin) / span);
        const x = cellX(p) - sx;
        const y = cellY(l) - sy;
        ctx.fillStyle = c.fill;
        ctx.fillRect(x, y, CELL_W - 1, CELL_H - 1);
        ctx.fillStyle = c.text;
        ctx.fillText(fit(ctx, d.vocab[d.top_ids[l][p][0]], CELL_W - 4), x + CELL_W / 2, y + CELL_H / 2);
        drawn++;
      }
    }
    const sel = model.get("selected");
    if (sel) {
      ctx.strokeStyle = "#e8590c";
      ctx.lineWidth = 2;
      ctx.strokeRect(cellX(sel[1]) - sx + 1, cellY(sel[0]) - sy + 1, CELL_W - 3, CELL_H - 3);
    }
    // Frozen axes: layer labels on the left, token labels below, over the scrolled cells.
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, 0, LEFT, viewH);
    ctx.fillRect(0, nL * CELL_H - sy, viewW, viewH);
    ctx.fillStyle = "#333";
    ctx.textAlign = "right";
    for (let r = r0; r <= r1; r++) {
      const l = nL - 1 - r;
      ctx.fillText(d.layer_labels[l], LEFT - 6, cellY(l) - sy + CELL_H / 2);
    }
    const axisY = Math.min(nL * CELL_H - sy, viewH - BOTTOM);
    ctx.fillStyle = "#fff";
    ctx.fillRect(0, axisY, viewW, viewH - axisY);
    ctx.fillStyle = "#333";
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
    const lo = colour(g.cmap, 0).fill;
    const hi = colour(g.cmap, 1).fill;
    legend.innerHTML =
      `<span>${g.label}</span> <span>${Number(g.vmin).toPrecision(3)}</span>` +
      `<span class="ek-bar" style="background:linear-gradient(90deg,${lo},${hi})"></span>` +
      `<span>${Number(g.vmax).toPrecision(3)}</span>`;
  }

  function showTip(cell, clientX, clientY) {
    const d = data();
    const [l, p] = cell;
    const g = grid();
    const v = g ? g.values[l][p] : null;
    const rows = d.top_ids[l][p]
      .map(
        (id, i) =>
          `<tr><td>${i + 1}</td><td><button class="ek-token" data-id="${id}" ` +
          `data-token="${encodeURIComponent(d.vocab[id])}" data-prob="${d.top_probs[l][p][i]}" ` +
          `title="pin as target">${escapeHtml(show(d.vocab[id]))}</button></td>` +
          `<td>${Number(d.top_probs[l][p][i]).toFixed(4)}</td></tr>`,
      )
      .join("");
    tip.innerHTML =
      `<div class="ek-tip-head">layer ${escapeHtml(d.layer_labels[l])} · ` +
      `${escapeHtml(show(d.tokens[p]))}` +
      (g && v !== null ? ` · ${escapeHtml(g.label)} ${Number(v).toPrecision(3)}` : "") +
      `</div><table>${rows}</table>` +
      `<div class="ek-tip-foot">${sticky ? "click a token to pin it" : "click the cell to select"}</div>`;
    tip.dataset.layer = String(l);
    tip.dataset.position = String(p);
    tip.hidden = false;
    const box = root.getBoundingClientRect();
    let left = clientX - box.left + 14;
    if (left + tip.offsetWidth > box.width) left = Math.max(0, clientX - box.left - tip.offsetWidth - 14);
    tip.style.left = `${left}px`;
    tip.style.top = `${clientY - box.top + 10}px`;
  }

  function escapeHtml(text) {
    const span = document.createElement("span");
    span.textContent = String(text);
    return span.innerHTML;
  }

  function spacerPoint(event) {
    const rect = canvas.getBoundingClientRect();
    return [event.clientX - rect.left + scroller.scrollLeft, event.clientY - rect.top + scroller.scrollTop];
  }

  canvas.addEventListener("mousemove", (event) => {
    if (sticky) return;
    const cell = cellAt(...spacerPoint(event));
    if (cell) showTip(cell, event.clientX, event.clientY);
    else tip.hidden = true;
  });
  canvas.addEventListener("mouseleave", (event) => {
    if (!sticky && !tip.contains(event.relatedTarget)) tip.hidden = true;
  });
  canvas.addEventListener("click", (event) => {
    const cell = cellAt(...spacerPoint(event));
    if (!cell) {
      sticky = false;
      tip.hidden = true;
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
  root.addEventListener("keydown", (event) => {
    if (event.key === "Escape") {
      sticky = false;
      tip.hidden = true;
    }
  });
  scroller.addEventListener("scroll", () => requestAnimationFrame(draw));
  const resize = new ResizeObserver(() => draw());
  resize.observe(scroller);

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
    sticky = false;
    tip.hidden = true;
    layout();
  });
  model.on("change:metric", () => draw());
  model.on("change:selected", () => draw());
  layout();
  requestAnimationFrame(draw);
  return () => resize.disconnect();
}

export default { render };
