"""Execute the example notebooks and store them as a reader sees them finished.

    python notebooks/resave.py [NOTEBOOK ...]      # default: every notebook here

The notebooks that use ``demo`` run against one ``envoykit serve --model demo --tp 3``
started here (as under ``make test``), so no engine start is stored in them. A progress bar
that remains (an engine a notebook starts itself, a sweep, a training run) is a widget whose
plain-text form is the bar as it was first drawn, at 0%: a reader without the widget state
(a terminal, a diff, a code host) would see that frozen bar beside the finished result. Each
such form is replaced with the bar's last state, read from the widget state stored with the
notebook.
"""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def finished_bars(notebook: dict) -> int:
    """Replace the plain text of every stored progress bar with its last state; how many."""
    state = notebook.get("metadata", {}).get("widgets", {})
    models = state.get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    replaced = 0
    for cell in notebook["cells"]:
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            view = data.get(WIDGET_VIEW)
            text = bar_text(models, view["model_id"]) if view else None
            if text is not None:
                data["text/plain"] = text
                replaced += 1
    return replaced


def bar_text(models: dict, model_id: str) -> str | None:
    """tqdm's notebook bar (a box of a label, a progress bar and a count) as one line of
    text, in its stored last state; None for any other widget."""
    box = models.get(model_id, {})
    children = box.get("state", {}).get("children", [])
    parts = [models.get(child.removeprefix("IPY_MODEL_"), {}) for child in children]
    names = [part.get("model_name") for part in parts]
    if box.get("model_name") != "HBoxModel" or names != [
        "HTMLModel",
        "FloatProgressModel",
        "HTMLModel",
    ]:
        return None
    label, bar, count = (part["state"] for part in parts)
    filled = int(10 * bar["value"] / bar["max"]) if bar.get("max") else 0
    blocks = "█" * filled + " " * (10 - filled)
    return f"{html.unescape(label['value'])}|{blocks}|{html.unescape(count['value'])}"


def main(names: list[str]) -> int:
    paths = [HERE / name for name in names] or sorted(HERE.glob("[0-9]*.ipynb"))
    command = [sys.executable, "-m", "envoykit.cli", "serve", "--model", "demo", "--tp", "3"]
    server = subprocess.Popen([*command, "--port", "0"], stdout=subprocess.PIPE, text=True)
    ready = re.search(r" at (http://\S+) ", server.stdout.readline())
    if ready is None:
        server.kill()
        print("envoykit serve did not start", file=sys.stderr)
        return 1
    try:
        for path in paths:
            subprocess.run(
                [sys.executable, "-m", "jupyter", "nbconvert", "--to", "notebook", "--execute",
                 "--inplace", str(path)],
                check=True, cwd=HERE, env={**os.environ, "ENVOYKIT_SERVER": ready[1]},
            )  # fmt: skip
            notebook = json.loads(path.read_text())
            replaced = finished_bars(notebook)
            path.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n")
            print(f"{path.name}: executed; {replaced} progress bar(s) stored finished")
    finally:
        server.terminate()
        server.wait(120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
