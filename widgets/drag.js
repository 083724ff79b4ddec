// Drag-to-patch: a heatmap's cell dragged onto another heatmap. A part of heatmap.js, kept
// apart because it is the one way two heatmaps talk to each other (envoykit.explorer.assets
// joins it in after tooltip.js, whose tooltip a drag closes).
//
// Pointer events, not HTML5 drag and drop: a canvas is no drag source. The heatmap whose
// `drag_role` is "source" follows the pointer from pointerdown on, with the pointer captured;
// it tells the heatmap under the pointer, if that one's role is "target" and its `drag_group`
// the same, through DOM events on its root: "ek-dragover" (it outlines where the cell would
// land and names it in the event's detail), "ek-dragleave" and "ek-drop", on which the target
// sets its `drop` traitlet. Neither knows the other's model. While a cell is dragged every
// heatmap that takes it is outlined (class ek-drop-ready), and a drop anywhere else leaves
// the ghost a moment saying where to drop.

/**
 * What a dragged cell carries in the detail of the "ek-dragover" and "ek-drop" events.
 * @typedef {object} Dragged
 * @property {number[]} cell     [layer, position] in the source heatmap
 * @property {string} label      the source row's label: the target outlines the same row
 * @property {number} clientX
 * @property {number} clientY
 * @property {string} [landing]  set by the target on "ek-dragover": where the cell would land
 */

const DRAG_START = 5; // pixels the pointer moves, button down, before a press becomes a drag

// -- dragging a cell out (drag_role "source") -----------------------------------------------

/** The root of the heatmap under the pointer that takes this heatmap's drops, or null. */
function dropTargetAt(view, x, y) {
  const hit = document.elementFromPoint(x, y);
  const target = hit && hit.closest(".ek-heatmap[data-drag-role='target']");
  const group = view.model.get("drag_group");
  return target && target !== view.root && group && target.dataset.dragGroup === group
    ? target
    : null;
}

/** The roots of every heatmap that takes this heatmap's drops: outlined while dragging. */
function dropTargets(view) {
  const group = view.model.get("drag_group");
  if (!group) return [];
  return [...document.querySelectorAll(".ek-heatmap[data-drag-role='target']")].filter(
    (root) => root !== view.root && root.dataset.dragGroup === group,
  );
}

const MISSED = "drop it on the outlined heatmap to patch it in";
const MISSED_MS = 2500; // how long a missed drop's hint stays by the pointer

/** @returns {Dragged} */
function dragDetail(view, event) {
  const cell = view.drag.cell;
  const label = data(view).layer_labels[cell[0]];
  return { cell, label, clientX: event.clientX, clientY: event.clientY };
}

function endDrag(view) {
  const drag = view.drag;
  if (!drag) return;
  if (drag.over) drag.over.dispatchEvent(new CustomEvent("ek-dragleave"));
  if (drag.ghost) drag.ghost.remove();
  for (const root of drag.outlined || []) root.classList.remove("ek-drop-ready");
  if (view.canvas.hasPointerCapture(drag.id)) view.canvas.releasePointerCapture(drag.id);
  view.drag = null;
}

/** The ghost follows the pointer and names where the cell would land. */
function moveDrag(view, event) {
  const drag = view.drag;
  if (!drag.ghost) {
    if (Math.hypot(event.clientX - drag.x, event.clientY - drag.y) < DRAG_START) return;
    hideTip(view);
    // On the page's body, not in the widget: JupyterLab's output areas clip what they hold.
    drag.ghost = element("div", "ek-ghost");
    document.body.append(drag.ghost);
    drag.outlined = dropTargets(view);
    for (const root of drag.outlined) root.classList.add("ek-drop-ready");
  }
  const over = dropTargetAt(view, event.clientX, event.clientY);
  if (drag.over && drag.over !== over) drag.over.dispatchEvent(new CustomEvent("ek-dragleave"));
  drag.over = over;
  const detail = dragDetail(view, event);
  if (over) over.dispatchEvent(new CustomEvent("ek-dragover", { detail }));
  const what = `row ${detail.label} at ${show(data(view).tokens[drag.cell[1]])}`;
  drag.ghost.textContent = detail.landing ? `${what} → ${detail.landing}` : `${what}: ${MISSED}`;
  drag.ghost.classList.toggle("ek-ghost-over", Boolean(detail.landing));
  drag.ghost.style.left = `${event.clientX + 14}px`;
  drag.ghost.style.top = `${event.clientY + 10}px`;
}

function listenDragSource(view) {
  const { canvas, model } = view;
  canvas.addEventListener("pointerdown", (event) => {
    view.dragged = false;
    if (model.get("drag_role") !== "source" || event.button !== 0) return;
    const cell = cellAt(view, ...spacerPoint(view, event));
    if (!cell) return;
    event.preventDefault(); // no text selection while dragging
    const { clientX: x, clientY: y, pointerId: id } = event;
    view.drag = { cell, x, y, id, ghost: null, over: null };
    canvas.setPointerCapture(id);
  });
  canvas.addEventListener("pointermove", (event) => {
    if (view.drag && event.pointerId === view.drag.id) moveDrag(view, event);
  });
  canvas.addEventListener("pointerup", (event) => {
    const drag = view.drag;
    if (!drag || event.pointerId !== drag.id) return;
    if (drag.ghost) {
      view.dragged = true;
      const over = dropTargetAt(view, event.clientX, event.clientY);
      if (over) over.dispatchEvent(new CustomEvent("ek-drop", { detail: dragDetail(view, event) }));
      else {
        missed(drag.ghost); // it stays a moment, saying where to drop
        drag.ghost = null;
      }
    }
    endDrag(view);
  });
  canvas.addEventListener("pointercancel", () => endDrag(view));
}

/** A drop that landed on no heatmap that takes it: its ghost says where to drop, then goes. */
function missed(ghost) {
  ghost.textContent = MISSED;
  ghost.classList.add("ek-ghost-missed");
  setTimeout(() => ghost.remove(), MISSED_MS);
}

// -- taking a dropped cell (drag_role "target") ---------------------------------------------

/** Where the dragged cell would land under the pointer: its own row, the column hovered. */
function landingAt(view, detail) {
  const cell = cellAt(view, ...spacerPoint(view, detail));
  if (!cell) return null;
  return { l: data(view).layer_labels.indexOf(detail.label), p: cell[1] };
}

function listenDropTarget(view) {
  const { root, model } = view;
  const repaint = () => requestAnimationFrame(() => draw(view));
  root.addEventListener("ek-dragover", (event) => {
    if (!view.tip.hidden) hideTip(view); // it would hide where the cell lands
    const landing = landingAt(view, event.detail);
    view.landing = landing;
    if (landing) {
      const row = landing.l >= 0 ? `, row ${event.detail.label}` : "";
      event.detail.landing = `position ${landing.p} ${show(data(view).tokens[landing.p])}${row}`;
    }
    repaint();
  });
  root.addEventListener("ek-dragleave", () => {
    view.landing = null;
    repaint();
  });
  root.addEventListener("ek-drop", (event) => {
    view.landing = null;
    const cell = cellAt(view, ...spacerPoint(view, event.detail));
    if (cell) {
      model.set("drop", { source: event.detail.cell, target: cell });
      model.save_changes();
    }
    repaint();
  });
  const roles = () => {
    root.dataset.dragRole = model.get("drag_role") || "";
    root.dataset.dragGroup = model.get("drag_group") || "";
  };
  roles();
  model.on("change:drag_role", roles);
  model.on("change:drag_group", roles);
}
