// The lens rows to pick: a column per layer, a line per site. A click toggles one row, a
// drag along a line picks (or drops) a run of layers at that site, a line's name toggles the
// whole line.
//
// The top line is each layer's label: the residual stream after it (site "resid"). Below
// come the sub-layer sites the kernel offers: "attn" and "mlp" (what that block writes) and
// "mid" (the stream between them, site "resid_mid"). State crosses to Python only through
// `selected` (layer numbers whose "resid" row is picked) and `selected_sites` (the other
// picked rows, [layer, site] pairs); the kernel keeps both in the model's order. Labels and
// titles are set as text.

/**
 * A sub-layer row a column offers (envoykit.explorer.payload.picker_layers).
 * @typedef {object} Site
 * @property {string} site   "attn", "resid_mid" or "mlp"
 * @property {string} label  "attn", "mid" or "mlp": the suffix of its heatmap row ("12.mid")
 * @property {string} title  what it reads, and the module where there is one
 */

/**
 * One column of the `layers` traitlet.
 * @typedef {object} Item
 * @property {number} layer   0 = embedding, i = after decoder layer i
 * @property {string} label   "embed", "1", ...
 * @property {string} title   what its stream row reads, and the module
 * @property {boolean} resid  whether its stream row can be picked (a stored result may lack it)
 * @property {Site[]} subs
 */

const RESID = "resid";

function render({ model, el }) {
  const root = element("div", "ek-picker");
  el.append(root);
  let drag = null; // {site, from, to, adding}: where it began, where it is, select or clear

  /** @returns {Item[]} */
  const items = () => model.get("layers") || [];
  const key = (layer, site) => `${layer}:${site}`;
  /** The picked rows, as [layer, site] pairs. */
  const rows = () => [
    ...model.get("selected").map((layer) => [layer, RESID]),
    ...(model.get("selected_sites") || []),
  ];
  /** The sub-layer lines, in the order the columns list them (the model's). */
  function lines() {
    const found = new Map();
    for (const item of items()) {
      for (const sub of item.subs) if (!found.has(sub.site)) found.set(sub.site, sub.label);
    }
    return found;
  }
  /** Layer numbers of the columns that offer `site`. */
  const offering = (site) =>
    items()
      .filter((item) => (site === RESID ? item.resid : item.subs.some((sub) => sub.site === site)))
      .map((item) => item.layer);

  function button(text, onClick) {
    const node = element("button", "ek-picker-button", text);
    node.addEventListener("click", onClick);
    return node;
  }

  function build() {
    root.textContent = "";
    const on = new Set(rows().map(([layer, site]) => key(layer, site)));
    const layers = model.get("selected").length;
    const sites = (model.get("selected_sites") || []).length;
    let text = `layers (${layers} of ${offering(RESID).length} picked)`;
    if (lines().size) text += `, ${sites} sub-layer rows`;
    const head = element("div", "ek-picker-head", text);
    head.append(
      button("all layers", () => commit([...rows(), ...offering(RESID).map((l) => [l, RESID])])),
      button("none", () => commit([])),
    );
    const strip = element("div", "ek-strip");
    // The lines' names, in a column that stays put while the strip scrolls.
    const names = element("div", "ek-layer ek-names");
    names.append(element("div", "ek-layer-label ek-line", "layer"));
    names.lastChild.dataset.line = RESID;
    names.lastChild.title = "the residual stream after each layer: click to pick or drop them all";
    for (const [site, label] of lines()) {
      const name = element("div", "ek-sub ek-line", label);
      name.dataset.line = site;
      name.title = `${label} of every layer: click to pick or drop them all`;
      names.append(name);
    }
    strip.append(names);
    for (const item of items()) {
      const column = element("div", "ek-layer");
      column.dataset.layer = String(item.layer);
      const label = element("div", "ek-layer-label", item.label);
      label.title = item.title;
      if (item.resid) mark(label, item.layer, RESID, on);
      else label.classList.add("ek-absent");
      column.append(label);
      for (const site of lines().keys()) {
        const sub = item.subs.find((s) => s.site === site);
        const cell = element("div", "ek-sub", sub ? sub.label : "");
        if (sub) {
          cell.title = sub.title;
          mark(cell, item.layer, site, on);
        } else cell.classList.add("ek-absent");
        column.append(cell);
      }
      strip.append(column);
    }
    root.append(head, strip);
  }

  /** Make `cell` the pickable row (layer, site). */
  function mark(cell, layer, site, on) {
    cell.classList.add("ek-cell");
    cell.classList.toggle("ek-on", on.has(key(layer, site)));
    cell.dataset.layer = String(layer);
    cell.dataset.site = site;
  }

  /** Send the picked rows ([layer, site] pairs) to the kernel. */
  function commit(picked) {
    const order = [RESID, ...lines().keys()];
    const seen = new Map(picked.map(([layer, site]) => [key(layer, site), [layer, site]]));
    const all = [...seen.values()].sort((a, b) => a[0] - b[0] || order.indexOf(a[1]) - order.indexOf(b[1]));
    model.set("selected", all.filter(([, site]) => site === RESID).map(([layer]) => layer));
    model.set("selected_sites", all.filter(([, site]) => site !== RESID));
    model.save_changes();
  }

  /** The rows of `site` from layer `from` to layer `to`, both included. */
  function span(site, from, to) {
    const lo = Math.min(from, to);
    const hi = Math.max(from, to);
    return offering(site).filter((l) => l >= lo && l <= hi).map((l) => [l, site]);
  }

  function preview() {
    const run = new Set(span(drag.site, drag.from, drag.to).map(([l, s]) => key(l, s)));
    const on = new Set(rows().map(([layer, site]) => key(layer, site)));
    for (const cell of root.querySelectorAll(".ek-cell")) {
      const k = key(cell.dataset.layer, cell.dataset.site);
      cell.classList.toggle("ek-on", run.has(k) ? drag.adding : on.has(k));
    }
  }

  root.addEventListener("pointerdown", (event) => {
    const cell = event.target.closest(".ek-cell");
    if (!cell) return;
    event.preventDefault();
    const layer = Number(cell.dataset.layer);
    const on = rows().some(([l, s]) => l === layer && s === cell.dataset.site);
    drag = { site: cell.dataset.site, from: layer, to: layer, adding: !on };
    preview();
  });
  root.addEventListener("pointerover", (event) => {
    const column = event.target.closest(".ek-layer[data-layer]");
    if (drag && column) {
      drag.to = Number(column.dataset.layer);
      preview();
    }
  });
  root.addEventListener("click", (event) => {
    const name = event.target.closest(".ek-line");
    if (!name) return;
    const site = name.dataset.line;
    const whole = offering(site).map((l) => [l, site]);
    const on = new Set(rows().map(([layer, s]) => key(layer, s)));
    const all = whole.every(([l]) => on.has(key(l, site)));
    commit(all ? rows().filter(([, s]) => s !== site) : [...rows(), ...whole]);
  });
  const finish = () => {
    if (!drag) return;
    const run = span(drag.site, drag.from, drag.to);
    const dropped = new Set(run.map(([l, s]) => key(l, s)));
    commit(drag.adding ? [...rows(), ...run] : rows().filter(([l, s]) => !dropped.has(key(l, s))));
    drag = null;
  };
  window.addEventListener("pointerup", finish);

  model.on("change:layers", build);
  model.on("change:selected", build);
  model.on("change:selected_sites", build);
  build();
  return () => window.removeEventListener("pointerup", finish);
}

export default { render };
