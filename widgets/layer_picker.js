// A strip of the model's layers: click toggles one, drag selects (or clears) a run of them.
//
// `layers` lists each lens layer (0 = embedding, i = after decoder layer i) with the
// whole-valued locations inside it (attention and MLP outputs), named by path on hover; only
// whole-valued locations are ever offered, since a shard-valued one has no lens to show.
// `selected` holds the picked layer numbers, sorted.

function render({ model, el }) {
  const root = document.createElement("div");
  root.className = "ek-picker";
  el.append(root);
  let drag = null; // {from, adding}: where the drag began and whether it selects or clears

  function build() {
    root.textContent = "";
    const picked = new Set(model.get("selected"));
    const head = document.createElement("div");
    head.className = "ek-picker-head";
    head.textContent = `layers (${picked.size} of ${model.get("layers").length} picked) `;
    for (const [name, pick] of [
      ["all", () => model.get("layers").map((item) => item.layer)],
      ["none", () => []],
    ]) {
      const button = document.createElement("button");
      button.textContent = name;
      button.className = "ek-picker-button";
      button.addEventListener("click", () => commit(pick()));
      head.append(button);
    }
    const strip = document.createElement("div");
    strip.className = "ek-strip";
    for (const item of model.get("layers")) {
      const column = document.createElement("div");
      column.className = "ek-layer" + (picked.has(item.layer) ? " ek-on" : "");
      column.dataset.layer = String(item.layer);
      column.title = item.path;
      const label = document.createElement("div");
      label.className = "ek-layer-label";
      label.textContent = item.label;
      column.append(label);
      for (const sub of item.subs) {
        const cell = document.createElement("div");
        cell.className = `ek-sub ek-${sub.kind}`;
        cell.textContent = sub.kind;
        cell.title = sub.path;
        column.append(cell);
      }
      strip.append(column);
    }
    root.append(head, strip);
  }

  function commit(layers) {
    model.set("selected", [...new Set(layers)].sort((a, b) => a - b));
    model.save_changes();
  }

  function layerOf(event) {
    const column = event.target.closest(".ek-layer");
    return column ? Number(column.dataset.layer) : null;
  }

  function span(from, to) {
    const lo = Math.min(from, to);
    const hi = Math.max(from, to);
    return model.get("layers").map((item) => item.layer).filter((l) => l >= lo && l <= hi);
  }

  function preview(to) {
    const run = new Set(span(drag.from, to));
    const picked = new Set(model.get("selected"));
    for (const column of root.querySelectorAll(".ek-layer")) {
      const layer = Number(column.dataset.layer);
      const on = run.has(layer) ? drag.adding : picked.has(layer);
      column.classList.toggle("ek-on", on);
    }
  }

  root.addEventListener("pointerdown", (event) => {
    const layer = layerOf(event);
    if (layer === null) return;
    event.preventDefault();
    drag = { from: layer, to: layer, adding: !model.get("selected").includes(layer) };
    preview(layer);
  });
  root.addEventListener("pointerover", (event) => {
    const layer = layerOf(event);
    if (drag && layer !== null) {
      drag.to = layer;
      preview(layer);
    }
  });
  const finish = () => {
    if (!drag) return;
    const run = span(drag.from, drag.to);
    const picked = model.get("selected");
    commit(drag.adding ? [...picked, ...run] : picked.filter((l) => !run.includes(l)));
    drag = null;
  };
  window.addEventListener("pointerup", finish);

  model.on("change:layers", build);
  model.on("change:selected", build);
  build();
  return () => window.removeEventListener("pointerup", finish);
}

export default { render };
