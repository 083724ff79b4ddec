// The Features panel's chips: a prompt's tokens side by side, each with its most active SAE
// features under it as chips shaded by activation (envoykit.explorer.feature_html.chips_data).
//
// A click on a chip sets the `selected` traitlet to its feature id; every chip of that
// feature is then marked, and the kernel answers with what it shows of the feature. Tokens
// are arbitrary text: they reach the page only through textContent and title, never as HTML;
// the kernel sends each one's label too, whitespace and control characters made visible.
// `element` and `show` come from dom.js, which the kernel puts in front of this source.

/**
 * The `data` traitlet.
 * @typedef {object} ChipsData
 * @property {string[]} tokens          [T] the prompt's tokens
 * @property {string[]} labels          [T] the same, as the page writes them
 * @property {number[][][]} chips       [T][n][2] [feature, activation], largest first
 * @property {number[]} l0              [T] features on at each token
 * @property {number} top               the largest activation of all
 */

// An activation's chip is the accent colour at an opacity up to DEEPEST, which reads on the
// light and the dark theme alike; past STRONG its text turns white.
const DEEPEST = 0.85;
const STRONG = 0.55;

/** One token's column: its label, its chips, its L0. */
function column(model, d, p) {
  const col = element("div", "ek-feat-col");
  col.dataset.position = String(p);
  const head = element("div", "ek-feat-token", d.labels[p]);
  head.title = `position ${p}: ${show(d.tokens[p])}, ${d.l0[p]} features on`;
  col.append(head);
  const top = Math.max(1e-12, d.top);
  for (const [feature, act] of d.chips[p]) {
    const share = Math.max(0, Math.min(1, act / top));
    const chip = element("button", share > STRONG ? "ek-chip ek-chip-strong" : "ek-chip");
    chip.textContent = String(feature);
    chip.dataset.feature = String(feature);
    chip.dataset.position = String(p);
    chip.dataset.act = String(act);
    chip.style.background = `rgba(25, 118, 210, ${(share * DEEPEST).toFixed(3)})`;
    chip.title = `feature ${feature}: ${act.toPrecision(4)} at ${show(d.tokens[p])}`;
    chip.addEventListener("click", () => {
      model.set("selected", feature);
      model.save_changes();
    });
    col.append(chip);
  }
  col.append(element("div", "ek-feat-l0", `L0 ${d.l0[p]}`));
  return col;
}

/** Mark every chip of the selected feature. */
function mark(model, root) {
  const selected = model.get("selected");
  for (const chip of root.querySelectorAll(".ek-chip")) {
    chip.classList.toggle("ek-chip-on", Number(chip.dataset.feature) === selected);
  }
}

function render({ model, el }) {
  const root = element("div", "ek-features");
  el.append(root);
  const draw = () => {
    const d = model.get("data") || {};
    if (!d.tokens || !d.tokens.length) {
      root.replaceChildren(element("div", "ek-feat-empty", "no features read yet"));
      delete root.dataset.drawn;
      return;
    }
    root.replaceChildren(...d.tokens.map((_, p) => column(model, d, p)));
    mark(model, root);
    root.dataset.drawn = String(d.chips.reduce((n, chips) => n + chips.length, 0));
  };
  const marked = () => mark(model, root);
  model.on("change:data", draw);
  model.on("change:selected", marked);
  draw();
  return () => {
    model.off("change:data", draw);
    model.off("change:selected", marked);
  };
}

export default { render };
