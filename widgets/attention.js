// The attention view: a layers x heads grid of what one query attends to, one head's
// token-by-token pattern, and each head's share of a target's logit.
//
// The grid's cell (layer, head) is a strip over the key positions, shaded by the weight the
// focus query puts on each (envoykit.explorer.payload.attention_data). A click on a cell sets
// the `selected` traitlet to [layer, head]; the kernel answers with that head's whole pattern
// in `data.pattern`, drawn as a table with the tokens on both axes. Hovering a token lights up
// its row (what it attends to) and its column (what attends to it). `data.heads` holds the
// selected layer's per-head contributions to a target's logit, drawn as bars. Tokens are
// arbitrary text: they reach the page only through textContent and title, never as HTML.
// `element` and `show` come from dom.js, which the kernel puts in front of this source.

/**
 * The `data` traitlet.
 * @typedef {object} AttentionData
 * @property {string[]} tokens       [T] the prompt's tokens
 * @property {number[]} layers       [L] decoder layers (1-based)
 * @property {number[]} heads        [H] head numbers
 * @property {number} query          the focus query's position
 * @property {number[][][]} strips   [L][H][T] the focus query's weights
 * @property {{layer: number, head: number, queries: number[], weights: number[][]}|null} pattern
 * @property {{layer: number, target: string, values: number[]}|null} contributions
 */

const STRIP_W = 96;
const STRIP_H = 14;

/** "rgba(...)" of the accent colour at opacity w (0..1): reads on light and dark themes. */
function shade(w) {
  return `rgba(25, 118, 210, ${Math.max(0, Math.min(1, w)).toFixed(3)})`;
}

/** One strip: the weights over the keys, left to right, on a small canvas. */
function stripCanvas(weights, selected) {
  const canvas = element("canvas", selected ? "ek-att-strip ek-att-on" : "ek-att-strip");
  const ratio = window.devicePixelRatio || 1;
  canvas.width = Math.round(STRIP_W * ratio);
  canvas.height = Math.round(STRIP_H * ratio);
  canvas.style.width = `${STRIP_W}px`;
  canvas.style.height = `${STRIP_H}px`;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  const width = STRIP_W / Math.max(1, weights.length);
  weights.forEach((w, k) => {
    ctx.fillStyle = shade(w);
    ctx.fillRect(k * width, 0, Math.max(1, width - 0.5), STRIP_H);
  });
  return canvas;
}

/** The layers x heads grid of strips; a click selects a (layer, head). */
function gridNode(model, d) {
  const grid = element("div", "ek-att-grid");
  grid.style.gridTemplateColumns = `auto repeat(${d.heads.length}, ${STRIP_W + 4}px)`;
  grid.append(element("div", "ek-att-corner", "layer \\ head"));
  for (const head of d.heads) grid.append(element("div", "ek-att-col", String(head)));
  const selected = model.get("selected") || [];
  d.layers.forEach((layer, li) => {
    grid.append(element("div", "ek-att-row", String(layer)));
    d.heads.forEach((head, hi) => {
      const on = selected[0] === layer && selected[1] === head;
      const cell = element("div", "ek-att-cell");
      cell.dataset.layer = String(layer);
      cell.dataset.head = String(head);
      cell.title = `layer ${layer}, head ${head}: click for its whole pattern`;
      cell.append(stripCanvas(d.strips[li][hi], on));
      cell.addEventListener("click", () => {
        model.set("selected", [layer, head]);
        model.save_changes();
      });
      grid.append(cell);
    });
  });
  return grid;
}

/** One head's pattern as a table: queries down, keys across, tokens on both axes. */
function patternNode(d) {
  const p = d.pattern;
  const box = element("div", "ek-att-pattern");
  box.append(element("div", "ek-att-title", `layer ${p.layer}, head ${p.head}`));
  const table = element("table");
  const head = table.createTHead().insertRow();
  head.append(element("th", "ek-att-axis", "query \\ key"));
  d.tokens.forEach((token, k) => {
    const th = element("th", "ek-att-key", visibleToken(token));
    th.dataset.key = String(k);
    th.title = `key ${k}: ${show(token)}`;
    head.append(th);
  });
  const body = table.createTBody();
  p.queries.forEach((q, row) => {
    const tr = body.insertRow();
    const th = element("th", "ek-att-query", visibleToken(d.tokens[q]));
    th.dataset.query = String(q);
    th.title = `query ${q}: ${show(d.tokens[q])}`;
    tr.append(th);
    p.weights[row].forEach((w, k) => {
      const td = tr.insertCell();
      td.className = "ek-att-w";
      td.dataset.query = String(q);
      td.dataset.key = String(k);
      td.style.background = shade(w);
      td.title = `${show(d.tokens[q])} → ${show(d.tokens[k])}: ${w.toFixed(4)}`;
    });
  });
  // Hovering a token lights up what it attends to (its row) and what attends to it (its
  // column), wherever the token is hovered: as a query, as a key, or a cell's either end.
  const light = (position) => {
    for (const node of table.querySelectorAll(".ek-att-lit")) node.classList.remove("ek-att-lit");
    if (position === null) return;
    const p = String(position);
    for (const node of table.querySelectorAll(`[data-query="${p}"], [data-key="${p}"]`)) {
      node.classList.add("ek-att-lit");
    }
  };
  table.addEventListener("mouseover", (event) => {
    const target = event.target.closest("[data-query], [data-key]");
    if (!target) return;
    light(target.dataset.query ?? target.dataset.key);
  });
  table.addEventListener("mouseleave", () => light(null));
  box.append(table);
  return box;
}

/** Each head's contribution to the target's logit, as bars around zero. */
function contributionNode(d) {
  const c = d.contributions;
  const box = element("div", "ek-att-bars");
  box.append(
    element("div", "ek-att-title", `layer ${c.layer}: each head's contribution to logit(${show(c.target)})`),
  );
  const largest = Math.max(1e-12, ...c.values.map(Math.abs));
  c.values.forEach((value, i) => {
    const row = element("div", "ek-att-bar-row");
    row.dataset.head = String(d.heads[i]);
    row.append(element("span", "ek-att-bar-label", `head ${d.heads[i]}`));
    const track = element("span", "ek-att-track");
    const bar = element("span", value >= 0 ? "ek-att-bar ek-att-pos" : "ek-att-bar ek-att-neg");
    bar.style.width = `${(50 * Math.abs(value)) / largest}%`;
    track.append(bar);
    row.append(track, element("span", "ek-att-bar-value", value.toFixed(3)));
    box.append(row);
  });
  return box;
}

function render({ model, el }) {
  const root = element("div", "ek-attention");
  el.append(root);
  const draw = () => {
    const d = model.get("data") || {};
    if (!d.layers || !d.layers.length) {
      root.replaceChildren(element("div", "ek-att-empty", "no attention to show yet"));
      return;
    }
    const title = `what ${show(d.tokens[d.query])} (position ${d.query}) attends to, per layer and head`;
    const parts = [element("div", "ek-att-title", title), gridNode(model, d)];
    if (d.pattern) parts.push(patternNode(d));
    if (d.contributions) parts.push(contributionNode(d));
    root.replaceChildren(...parts);
    root.dataset.drawn = String(d.layers.length * d.heads.length);
  };
  model.on("change:data", draw);
  model.on("change:selected", draw);
  draw();
  return () => {
    model.off("change:data", draw);
    model.off("change:selected", draw);
  };
}

export default { render };
