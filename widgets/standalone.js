// The standalone page (envoykit/explorer/export.py): heatmap.js with no kernel behind it.
//
// The page carries its state and heatmap.js's source as JSON blocks. This module stands in
// for the anywidget model (get/set/on/off, the state kept in the page), renders the heatmap
// into #ek-root and fills the metric menu from the payload's grids, as text.
// `window.ekModel` is the model, for scripts and tests.

const read = (id) => JSON.parse(document.getElementById(id).textContent);

const state = read("ek-state");
const listeners = {};
const model = {
  get: (key) => state[key],
  set: (key, value) => {
    state[key] = value;
    for (const f of listeners[`change:${key}`] || []) f();
  },
  save_changes: () => {},
  on: (event, f) => {
    (listeners[event] ||= []).push(f);
  },
  off: (event, f) => {
    listeners[event] = (listeners[event] || []).filter((g) => g !== f);
  },
};

const menu = document.getElementById("ek-metric");
for (const [key, grid] of Object.entries(state.data.grids)) {
  const option = document.createElement("option");
  option.value = key;
  option.textContent = grid.units ? `${grid.label} (${grid.units})` : grid.label;
  option.selected = key === state.metric;
  menu.append(option);
}
menu.addEventListener("change", () => model.set("metric", menu.value));

const source = read("ek-heatmap-js");
const url = `data:text/javascript;charset=utf-8,${encodeURIComponent(source)}`;
const { default: heatmap } = await import(url);
heatmap.render({ model, el: document.getElementById("ek-root") });
window.ekModel = model;
