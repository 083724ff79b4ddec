"""The browser modules and style sheet in ``widgets/``, found and read once per process.

In a checkout they sit in the top-level ``widgets/`` folder; a wheel ships them inside the
package (``envoykit/widgets``). Widgets and the standalone export both read them through
`asset`, so each file is read from disk once, not on every widget construction. A browser
module's source goes through `module`, which puts ``dom.js`` (the element helper every module
uses) and the module's parts (`PARTS`) in front of it: each module is loaded as one source
text, with nothing to import.
"""

from __future__ import annotations

import functools
from pathlib import Path


def widgets_dir() -> Path:
    """The folder of the browser modules: inside the package in a wheel, top-level in a checkout."""
    package = Path(__file__).resolve().parents[1]  # envoykit/, from envoykit/explorer/
    for folder in (package / "widgets", package.parent / "widgets"):
        if (folder / "heatmap.js").is_file():
            return folder
    raise FileNotFoundError(f"envoykit's widgets/ folder is missing next to {package}")


@functools.cache
def asset(name: str) -> str:
    """The text of ``widgets/<name>``."""
    return (widgets_dir() / name).read_text(encoding="utf-8")


PARTS: dict[str, tuple[str, ...]] = {
    "heatmap.js": ("colour.js", "canvas.js", "tooltip.js", "drag.js"),
}
"""The files a browser module is joined from, in order, before its own: by module name.

anywidget loads one ES module as one source text, and there is no bundler, so a module split
into files by job is joined here, the way ``dom.js`` always was. The parts are named in this
table rather than in a comment at the top of each module: one place says how every module is
put together, nothing parses JavaScript, and a part that is missing or misnamed fails in
`module` with the file's name. Each part uses only the parts before it; the entry module,
last, holds ``render`` and the ``export default``. A module not named here is ``dom.js`` and
itself.
"""


@functools.cache
def module(name: str) -> str:
    """The source of browser module ``widgets/<name>`` as it is loaded: ``dom.js``, its
    `PARTS` in order, then it, one after another with a newline between."""
    return "\n".join(asset(part) for part in ("dom.js", *PARTS.get(name, ()), name))
