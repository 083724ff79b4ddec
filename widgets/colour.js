// The heatmap's colours: a metric's colour stops and scale, the text colour on a cell, the
// page's theme, and the legend that shows the scale. A part of heatmap.js, kept apart because
// it is the one place that turns values into colours (envoykit.explorer.assets joins it in).
//
// Colours come from two places only: each metric's colour stops in the payload (sampled in
// envoykit/metrics.py from matplotlib's maps, so the static figure and this view agree) and
// the page's theme (JupyterLab's --jp-* variables through explorer.css's --ek-* ones, with
// fallbacks for the standalone page).

/**
 * The page's colours as the canvas needs them (CSS strings).
 * @typedef {{bg: string, fg: string, nan: string, select: string, accent: string}} Theme
 */

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
    accent: get("--ek-accent", "#1976d2"),
  };
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
