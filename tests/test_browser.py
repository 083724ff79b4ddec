"""The widgets in a real browser: JupyterLab + Debian's chromium, driven by Playwright.

One test runs `LensExplorer` on a 2-rank ``tiny`` engine inside a JupyterLab kernel and
checks, against the values the kernel itself holds, that the tooltip shows the cell's top-k,
that a click reaches the kernel as a selection and opens the attribution panel at its
position, that pinning a token re-runs the lens and redraws the trajectory, that sub-layer
sites picked in the layer picker (a click, a drag) come back as labelled heatmap rows whose
cells attribute too, and, in compare mode, that the diff heatmap draws, that a cell dragged
from the second prompt's heatmap onto the first's patches it in and redraws the first, and
that the Sweep button fills its progress bar and draws the map. Others open the standalone
HTML export with no kernel at all, and a stored result whose every text is markup, read-only
in JupyterLab and in the export: it must show as text and run nothing, in the light and the
dark theme. Screenshots land in ``artifacts/`` (git-ignored).
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from test_explorer import XSS_IMG, hostile_result

import envoykit as ek
from envoykit.explorer import LensExplorer
from envoykit.plot.text import token_text

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"
NOTEBOOK = Path(__file__).parent / "browser" / "explorer.ipynb"
READ_ONLY_NOTEBOOK = Path(__file__).parent / "browser" / "readonly.ipynb"
ATTENTION_NOTEBOOK = Path(__file__).parent / "browser" / "attention.ipynb"
STEERING_NOTEBOOK = Path(__file__).parent / "browser" / "steering.ipynb"
CORPUS_NOTEBOOK = Path(__file__).parent / "browser" / "corpus.ipynb"
FEATURES_NOTEBOOK = Path(__file__).parent / "browser" / "features.ipynb"
# The heatmaps of an explorer: the first prompt's, and in compare mode the second prompt's
# (cells to drag) and the diff. The standalone page has one, of no explorer.
HEATMAP = ".ek-heatmap"
MAIN = ".ek-main-heatmap .ek-heatmap"
SOURCE = ".ek-source-heatmap .ek-heatmap"
DIFF = ".ek-diff-heatmap .ek-heatmap"
# A panel's figure as the light theme shows it (each comes in both themes' inks).
FIGURE = "img.ek-figure-light"
PROMPT = "The capital of France is"  # the notebook's
OTHER = "The capital of Italy is"  # as many tokens as PROMPT on tiny

pytestmark = pytest.mark.skipif(
    not Path(CHROMIUM).exists(),
    reason=f"{CHROMIUM} is missing: apt-get install chromium to run the browser tests",
)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
            ],
        )
        yield chromium
        chromium.close()


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


# Cell (l, p)'s centre on screen, scrolled into the heatmap's view, and whether the heatmap's
# canvas is what a pointer there would hit (a kernel output still landing may move the page).
CELL_CENTER = """(el, [l, p]) => {
    const point = el.ekCellCenter(l, p);
    const hit = document.elementFromPoint(point.x, point.y);
    return {...point, hit: hit === el.querySelector("canvas.ek-canvas")};
}"""


def cell_center(page: Any, root: str, layer: int, position: int) -> dict[str, float]:
    """Where on screen cell (layer, position) of heatmap ``root`` is, scrolled into its view,
    once the page has settled so that a pointer there lands on the cell."""
    heatmap = page.locator(root)
    return wait_for(
        lambda: (point := heatmap.evaluate(CELL_CENTER, [layer, position]))["hit"] and point,
        10,
        f"cell {layer, position} of {root} to be under the pointer's point",
    )


def hover_cell(page: Any, layer: int, position: int, root: str = HEATMAP) -> dict[str, Any]:
    """Move the mouse over a cell of heatmap ``root``; the tooltip's rows as the page shows
    them."""
    page.locator(root).evaluate("el => el.scrollIntoView({block: 'center'})")
    point = cell_center(page, root, layer, position)
    page.mouse.move(point["x"], point["y"])
    tip = page.locator(f"{root} .ek-tooltip")
    tip.wait_for(state="visible", timeout=5000)
    assert tip.get_attribute("data-layer") == str(layer)
    assert tip.get_attribute("data-position") == str(position)
    rows = tip.locator(".ek-token").evaluate_all(
        "buttons => buttons.map(b => ({id: Number(b.dataset.id),"
        " token: b.dataset.token, prob: Number(b.dataset.prob)}))"
    )
    return {"point": point, "rows": rows}


def assert_tooltip_matches(rows: list[dict], ids: list, tokens: list, probs: list) -> None:
    assert [r["id"] for r in rows] == ids
    assert [r["token"] for r in rows] == tokens
    np.testing.assert_allclose([r["prob"] for r in rows], probs, atol=1e-6)


# Luminance (0 dark .. 1 light) of the canvas pixels in the middle of cell (l, p): the cell's
# own colour (the median) and the extremes, which are the text written on it.
CELL_LUMINANCE = """(root, [l, p]) => {
    const point = root.ekCellCenter(l, p);
    const canvas = root.querySelector("canvas.ek-canvas");
    const rect = canvas.getBoundingClientRect();
    const ratio = canvas.width / rect.width;
    const [w, h] = [40, 14];
    const px = canvas.getContext("2d").getImageData(
        Math.round((point.x - rect.left - w / 2) * ratio),
        Math.round((point.y - rect.top - h / 2) * ratio),
        Math.round(w * ratio), Math.round(h * ratio)).data;
    const lum = [];
    for (let i = 0; i < px.length; i += 4)
        lum.push((0.2126 * px[i] + 0.7152 * px[i + 1] + 0.0722 * px[i + 2]) / 255);
    lum.sort((a, b) => a - b);
    return {fill: lum[lum.length >> 1], min: lum[0], max: lum[lum.length - 1]};
}"""

# The canvas's corner, where no cell is: the page's background as the heatmap paints it.
CANVAS_BACKGROUND = """root => {
    const [r, g, b] = root.querySelector("canvas.ek-canvas").getContext("2d")
        .getImageData(0, 0, 1, 1).data;
    return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255;
}"""


def css_luminance(colour: str) -> float:
    """Luminance of a computed CSS colour, ``rgb(r, g, b)`` or ``rgba(r, g, b, a)``."""
    r, g, b = (float(c) for c in colour[colour.index("(") + 1 : -1].split(",")[:3])
    return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255


def assert_model_text_is_text(page: Any, res: ek.LensResult, root: str = HEATMAP) -> None:
    """Every token in the tooltip of the last layer's cells shows literally, none became
    markup, and no handler in the text ran."""
    for position in range(len(res.tokens)):
        layer = len(res.layers) - 1
        tip = hover_cell(page, layer, position, root)
        tokens = res.top_tokens[layer, position].tolist()
        assert_tooltip_matches(
            tip["rows"],
            res.top_ids[layer, position].tolist(),
            tokens,
            res.top_probs[layer, position].tolist(),
        )
        shown = page.locator(f"{root} .ek-tooltip .ek-token").all_inner_texts()
        assert shown == [json.dumps(token) for token in tokens]
        head = page.locator(f"{root} .ek-tooltip .ek-tip-head").inner_text()
        assert json.dumps(res.tokens[position]) in head
    assert_nothing_ran(page)


def assert_nothing_ran(page: Any) -> None:
    """No markup from the model text is in the page and none of its handlers ran."""
    page.wait_for_timeout(300)  # an image's onerror fires after its load fails
    assert page.locator(".ek-heatmap img, .ek-heatmap script, .ek-heatmap b").count() == 0
    assert page.locator("img[src='x']").count() == 0
    assert page.evaluate("() => window.__pwned") is None


# -- standalone HTML export: no kernel ------------------------------------------------------


def synthetic_result(n_layers: int, n_pos: int, k: int = 5, seed: int = 0) -> ek.LensResult:
    """A result of any size with plausible numbers, to check the view scales."""
    rng = np.random.default_rng(seed)
    probs = np.sort(rng.dirichlet(np.ones(50), size=(n_layers, n_pos))[..., :k], axis=-1)[..., ::-1]
    ids = rng.integers(0, 1000, size=(n_layers, n_pos, k))
    return ek.LensResult(
        prompt="synthetic",
        token_ids=np.arange(n_pos),
        tokens=tuple(f"t{i}" for i in range(n_pos)),
        positions=np.arange(n_pos),
        layers=np.arange(n_layers),
        top_ids=ids,
        top_tokens=np.vectorize(lambda i: f" w{i}", otypes=[object])(ids),
        top_probs=probs.astype(np.float32),
        entropy=rng.random((n_layers, n_pos)).astype(np.float32) * 5,
        kl=rng.random((n_layers, n_pos)).astype(np.float32),
        target_ids=np.array([7]),
        target_labels=(" w7",),
        target_tokens=(" w7",),
        target_probs=rng.random((n_layers, n_pos, 1)).astype(np.float32) * 0.1,
        target_ranks=rng.integers(0, 100, size=(n_layers, n_pos, 1)),
    )


@pytest.mark.parametrize("shape", [(30, 64), (80, 512)])
def test_standalone_html_renders_without_kernel(browser, tmp_path, shape):
    res = synthetic_result(*shape)
    explorer = LensExplorer(res)
    explorer.metric.value = "entropy"
    path = explorer.export(tmp_path / "lens.html")
    started = time.monotonic()
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    try:
        page.goto(path.as_uri())
        page.wait_for_selector(".ek-heatmap[data-drawn]", timeout=15000)
        drawn = int(page.locator(".ek-heatmap").get_attribute("data-drawn"))
        assert 0 < drawn <= shape[0] * shape[1]
        coloured = page.locator("canvas.ek-canvas").evaluate(
            """canvas => {
                const px = canvas.getContext('2d')
                    .getImageData(0, 0, canvas.width, canvas.height).data;
                let n = 0;
                for (let i = 0; i < px.length; i += 4) if (px[i] < 250 || px[i + 2] < 250) n++;
                return n;
            }"""
        )
        assert coloured > 1000, "the canvas drew no coloured cells"
        layer, position = shape[0] - 1, shape[1] - 1  # far corner: needs scrolling
        tip = hover_cell(page, layer, position)
        assert_tooltip_matches(
            tip["rows"],
            res.top_ids[layer, position].tolist(),
            res.top_tokens[layer, position].tolist(),
            res.top_probs[layer, position].tolist(),
        )
        page.mouse.click(tip["point"]["x"], tip["point"]["y"])
        assert page.evaluate("window.ekModel.get('selected')") == [layer, position]
        # Focus is on no element of the heatmap (a canvas takes none): Escape still closes.
        assert page.evaluate("() => document.activeElement === document.body")
        page.keyboard.press("Escape")
        page.locator(".ek-tooltip").wait_for(state="hidden", timeout=5000)
        page.mouse.click(tip["point"]["x"], tip["point"]["y"])
        page.locator(".ek-tooltip").wait_for(state="visible", timeout=5000)
        page.locator(".ek-tooltip .ek-token").first.click()
        assert page.evaluate("window.ekModel.get('pinned')") == [
            int(res.top_ids[layer, position, 0])
        ]
        # The tooltip stays open over its own tokens; a press anywhere else closes it.
        page.locator(".ek-tooltip").wait_for(state="visible", timeout=5000)
        page.mouse.click(2, 2)
        page.locator(".ek-tooltip").wait_for(state="hidden", timeout=5000)
        page.select_option("#ek-metric", "kl")
        assert page.evaluate("window.ekModel.get('metric')") == "kl"
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"standalone_{shape[0]}x{shape[1]}.png"))
    finally:
        page.close()
    print(f"standalone {shape}: {time.monotonic() - started:.1f} s")


def test_standalone_page_shows_model_text_as_text(browser, tmp_path):
    """Markup in tokens, the target, the prompt and the model name shows as text in the
    exported page and runs nothing; cells write their token legibly; the page follows the
    reader's dark colour scheme."""
    res = hostile_result()
    path = LensExplorer(res).export(tmp_path / "lens.html")
    page = browser.new_page(viewport={"width": 1000, "height": 700})
    try:
        page.goto(path.as_uri())
        page.wait_for_selector(".ek-heatmap[data-drawn]", timeout=15000)
        assert page.title() == f"logit lens: {res.prompt[:60]}"
        assert repr(res.prompt) in page.locator("h3").inner_text()
        assert res.meta["model"] in page.locator("body > p").inner_text()
        assert_model_text_is_text(page, res)

        options = page.locator("#ek-metric option").all_inner_texts()
        assert options[-1] == f"p({XSS_IMG!r})"
        page.select_option("#ek-metric", XSS_IMG)
        assert_nothing_ran(page)
        assert f"p({XSS_IMG!r})" in page.locator(".ek-legend").inner_text()
        page.select_option("#ek-metric", "prob")

        heatmap = page.locator(".ek-heatmap")
        dark = heatmap.evaluate(CELL_LUMINANCE, [2, 0])  # p = 0.9: deep blue
        light = heatmap.evaluate(CELL_LUMINANCE, [0, 1])  # p = 0.4: pale blue
        assert dark["fill"] < 0.4 and dark["max"] > dark["fill"] + 0.4, dark
        assert light["fill"] > 0.55 and light["min"] < light["fill"] - 0.4, light
        assert heatmap.evaluate(CANVAS_BACKGROUND) > 0.9

        page.emulate_media(color_scheme="dark")
        page.wait_for_function(
            f"() => ({CANVAS_BACKGROUND})(document.querySelector('.ek-heatmap')) < 0.1",
            timeout=5000,
        )
        legend = page.locator(".ek-legend").evaluate("el => getComputedStyle(el).color")
        assert css_luminance(legend) > 0.8
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "standalone_dark.png"))
        assert page.evaluate("() => window.__pwned") is None
    finally:
        page.close()


# -- JupyterLab with a real 2-rank engine in the kernel -------------------------------------


@pytest.mark.engine
def test_exports_of_a_patched_and_a_tuned_run_say_so_in_chromium(browser, tiny2, tmp_path):
    """What a reader of an exported page sees, with no kernel: its title, heading and the
    heatmap's legend name the run (patched where, or the tuned lens), every panel the
    explorer showed is there under its title with its figure loaded and whole, and in a
    dark colour scheme each figure is its dark drawing."""
    from seeded import seeded_tuned_lens

    explorer = LensExplorer(tiny2, prompt=PROMPT, targets=[" Paris"], compare_with=OTHER)
    explorer.picker.rows = [(0, "resid"), (2, "resid"), (4, "resid")]
    explorer.run()
    explorer.heatmap.set_state({"drop": {"source": [1, 3], "target": [1, 3]}})
    assert explorer.wait(60)
    assert explorer.result.meta.get("patches")
    exports = [(explorer.export(tmp_path / "patched.html"), "logit lens, patched (layer 2 resid)")]
    explorer.compare.value = False
    explorer.set_translator(seeded_tuned_lens(tiny2))
    explorer.lens_kind.value = "tuned"
    explorer.run()
    explorer.heatmap.selected = [2, 6]  # a cell: its trajectory and attribution are panels
    assert explorer.wait(60)
    exports.append((explorer.export(tmp_path / "tuned.html"), "tuned lens"))
    ARTIFACTS.mkdir(exist_ok=True)
    for path, run in exports:
        for scheme in ("light", "dark"):
            page = browser.new_page(color_scheme=scheme, viewport={"width": 1280, "height": 900})
            try:
                page.goto(path.as_uri())
                page.wait_for_selector(f"{HEATMAP}[data-drawn]", timeout=30000)
                assert page.title().startswith(f"{run}: ")
                assert page.locator("h3").inner_text().startswith(f"{run.capitalize()} of ")
                assert run in page.locator(".ek-legend").inner_text()
                sections = page.locator("section.ek-panel")
                assert sections.count() >= 2, sections.count()  # diff + trajectory, or
                for i in range(sections.count()):  # trajectory + attribution
                    section = sections.nth(i)
                    assert section.locator("h4").inner_text()
                    shown = section.locator(f"img.ek-figure-{scheme}")
                    hidden = section.locator(
                        f"img.ek-figure-{'dark' if scheme == 'light' else 'light'}"
                    )
                    assert shown.is_visible() and not hidden.is_visible()
                    assert shown.evaluate("img => img.complete && img.naturalWidth > 0")
                    box = shown.bounding_box()
                    assert box["x"] >= 0 and box["x"] + box["width"] <= 1280, box
                page.screenshot(
                    path=str(ARTIFACTS / f"export_{path.stem}_{scheme}.png"), full_page=True
                )
            finally:
                page.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Lab:
    """A JupyterLab server of this test's own, on a free port, with a token."""

    def __init__(self, root: Path) -> None:
        self.port, self.token = free_port(), secrets.token_hex(16)
        settings = root / "settings" / "@jupyterlab" / "apputils-extension"
        settings.mkdir(parents=True)
        (settings / "notification.jupyterlab-settings").write_text(
            json.dumps({"fetchNews": "false", "checkForUpdates": False})
        )
        env = {
            **os.environ,
            "JUPYTER_RUNTIME_DIR": str(root / "runtime"),
            "TOKENIZERS_PARALLELISM": "false",
        }
        command = [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--ip=127.0.0.1",
            f"--port={self.port}",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={root / 'work'}",
            f"--LabApp.user_settings_dir={root / 'settings'}",
            f"--LabApp.workspaces_dir={root / 'workspaces'}",
            "--LabApp.expose_app_in_browser=True",
        ]
        if os.geteuid() == 0:
            command.append("--allow-root")
        self.log = (root / "lab.log").open("w")
        self.process = subprocess.Popen(
            command, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        wait_for(self.up, 60, "JupyterLab to answer")

    def api(self, path: str, method: str = "GET") -> Any:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/api/{path}",
            method=method,
            headers={"Authorization": f"token {self.token}"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read()
        return json.loads(body) if body else None

    def up(self) -> bool:
        try:
            return bool(self.api("status"))
        except OSError:
            return False

    def url(self, notebook: str) -> str:
        return f"http://127.0.0.1:{self.port}/lab/tree/{notebook}?token={self.token}"

    def stop(self) -> None:
        """Shut the kernels down through the API, then the server; kill what is left."""
        tree = [self.process.pid, *(p.pid for p in _children(self.process.pid))]
        try:
            for kernel in self.api("kernels"):
                self.api(f"kernels/{kernel['id']}", method="DELETE")
        except OSError:
            pass
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.log.close()
        _, alive = psutil.wait_procs([p for p in map(_process, tree) if p], timeout=20)
        for process in alive:
            process.kill()
        assert not alive, f"processes outlived JupyterLab: {[p.pid for p in alive]}"


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _children(pid: int) -> list[psutil.Process]:
    process = _process(pid)
    return process.children(recursive=True) if process else []


@contextlib.contextmanager
def stored_in_lab(
    browser: Any,
    tmp_path: Path,
    res: Any,
    template: Path,
    name: str,
    viewport: dict[str, int],
) -> Iterator[Any]:
    """A page of ``viewport`` in JupyterLab, every cell of a copy of notebook ``template``
    run, its ``__RESULT__`` a stored copy of ``res`` (a read-only view: no engine); a
    failure inside leaves ``{name}_failure.png``."""
    stored = tmp_path / "result.json"
    res.to_json(str(stored))
    work = tmp_path / "work"
    work.mkdir()
    notebook = template.read_text().replace("__RESULT__", str(stored))
    (work / template.name).write_text(notebook)
    lab = Lab(tmp_path)
    page = browser.new_page(viewport=viewport)
    try:
        open_and_run(page, lab, template.name, "notebook:run-all-cells")
        yield page
    except Exception:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"{name}_failure.png"))
        raise
    finally:
        page.close()
        lab.stop()


def dark_theme(page: Any) -> None:
    """Switch JupyterLab to its dark theme, as a person does from the Settings menu."""
    page.evaluate(
        "() => window.jupyterapp.commands.execute("
        "'apputils:change-theme', {theme: 'JupyterLab Dark'})"
    )


def open_and_run(page: Any, lab: Lab, notebook: str, command: str) -> None:
    """Open a notebook once its kernel is up, make the last cell active and run ``command``
    (``notebook:run-all-cells``, ``notebook:run-all-above``)."""
    page.goto(lab.url(notebook))
    page.wait_for_function(
        "() => window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel",
        timeout=60000,
    )
    page.evaluate(
        """async (command) => {
            const panel = window.jupyterapp.shell.currentWidget;
            await panel.sessionContext.ready;
            panel.content.activeCellIndex = panel.content.widgets.length - 1;
            window.jupyterapp.commands.execute(command);
        }""",
        command,
    )


def test_read_only_explorer_in_jupyterlab(browser, tmp_path):
    """A stored result whose every text is markup, read-only in JupyterLab (no engine): the
    heatmap, the metric menu and the legend show it as text and run nothing; switched to
    JupyterLab Dark, the heatmap follows the theme."""
    res = hostile_result()
    started = time.monotonic()
    viewport = {"width": 1200, "height": 900}
    notebook, name = READ_ONLY_NOTEBOOK, "explorer_read_only"
    with stored_in_lab(browser, tmp_path, res, notebook, name, viewport) as page:
        page.wait_for_selector(f"{MAIN}[data-drawn]", timeout=120000)
        assert_model_text_is_text(page, res, MAIN)

        menu = page.locator(".ek-metric select")
        options = [text.replace("\xa0", " ") for text in menu.locator("option").all_inner_texts()]
        assert options[-1] == f"p({XSS_IMG!r})"
        menu.select_option(index=len(options) - 1)  # through the kernel and back
        page.wait_for_function(
            "label => document.querySelector('.ek-legend')?.textContent.includes(label)",
            arg=f"p({XSS_IMG!r})",
            timeout=30000,
        )
        assert_nothing_ran(page)

        # The colour controls, typed by hand: the legend's ends and its label follow.
        boxes = page.locator(".ek-colour-control input")
        boxes.nth(0).fill("0.25")
        boxes.nth(1).fill("0.75")
        page.wait_for_function(
            "() => document.querySelector('.ek-legend-max')?.textContent === '0.75'",
            timeout=30000,
        )
        legend = page.locator(f"{MAIN} .ek-legend")
        assert legend.locator(".ek-legend-min").inner_text() == "0.25"
        assert "limits set" in legend.inner_text()
        page.locator(".ek-colour-control select").select_option("log")
        page.wait_for_function(
            "() => document.querySelector('.ek-legend')?.textContent.includes('log scale')",
            timeout=30000,
        )
        boxes.nth(0).fill("")
        boxes.nth(1).fill("")
        page.locator(".ek-colour-control select").select_option("linear")
        page.wait_for_function(
            "() => !document.querySelector('.ek-legend')?.textContent.includes('limits set')",
            timeout=30000,
        )

        heatmap = page.locator(MAIN)
        assert heatmap.evaluate(CANVAS_BACKGROUND) > 0.9
        dark_theme(page)
        page.wait_for_function(
            f"() => ({CANVAS_BACKGROUND})(document.querySelector('{MAIN}')) < 0.1",
            timeout=30000,
        )
        # JupyterLab covers the page with its splash screen while it switches themes.
        page.locator("#jupyterlab-splash").wait_for(state="detached", timeout=30000)
        legend = heatmap.locator(".ek-legend").evaluate("el => getComputedStyle(el).color")
        assert css_luminance(legend) > 0.8
        hover_cell(page, len(res.layers) - 1, 0, MAIN)
        tip = page.locator(f"{MAIN} .ek-tooltip")
        assert css_luminance(tip.evaluate("el => getComputedStyle(el).backgroundColor")) < 0.2
        assert css_luminance(tip.evaluate("el => getComputedStyle(el).color")) > 0.8
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "explorer_read_only_dark.png"))
    print(f"read-only explorer in JupyterLab: {time.monotonic() - started:.1f} s")


# Elements under ``root`` whose content is wider than they are and that scroll sideways:
# a scrollbar shows. Returned as "tag.class: content/width px".
SIDEWAYS_SCROLLS = """root => [...root.querySelectorAll('*')].filter(el => {
    const overflow = getComputedStyle(el).overflowX;
    return (overflow === 'auto' || overflow === 'scroll') && el.scrollWidth > el.clientWidth + 1;
}).map(el => `${el.tagName}.${el.className}: ${el.scrollWidth}/${el.clientWidth} px`)"""


def test_explorer_layout_fits_thirty_layers(browser, tmp_path):
    """A 30-layer model's stored lens of a short prompt, in JupyterLab at a laptop's width:
    the picker shows the embedding and all 30 layers with every label whole and no sideways
    scroll, there is no scrollbar anywhere in the explorer, and every control's label is
    whole."""
    res, viewport = synthetic_result(31, 8), {"width": 1280, "height": 900}
    notebook, name = READ_ONLY_NOTEBOOK, "explorer_thirty_layers"
    with stored_in_lab(browser, tmp_path, res, notebook, name, viewport) as page:
        page.wait_for_selector(f"{MAIN}[data-drawn]", timeout=120000)
        labels = page.locator(".ek-picker .ek-layer:not(.ek-names) .ek-layer-label")
        assert labels.all_inner_texts() == ["embed"] + [str(n) for n in range(1, 31)]
        cut = labels.evaluate_all(
            "els => els.filter(el => el.scrollWidth > el.clientWidth).map(el => el.textContent)"
        )
        assert cut == []
        explorer = page.locator(".ek-explorer")
        assert explorer.evaluate(SIDEWAYS_SCROLLS) == []
        # Every button, menu and text box shows its whole label or value.
        clipped = explorer.evaluate(
            """root => [...root.querySelectorAll('button, select, .widget-label')]
                .filter(el => el.offsetParent && el.scrollWidth > el.clientWidth + 1)
                .map(el => el.textContent.trim() || el.className)"""
        )
        assert clipped == []
        ARTIFACTS.mkdir(exist_ok=True)
        explorer.screenshot(path=str(ARTIFACTS / "explorer_thirty_layers.png"))


def hostile_attention() -> ek.AttentionResult:
    """Two layers x three heads over four tokens whose text is markup, causal weights."""
    tokens = (XSS_IMG, "<b>bold</b>", " a & b <!--", XSS_IMG)
    weights = np.random.default_rng(0).random((2, 3, 4, 4)) * np.tri(4)
    weights /= weights.sum(-1, keepdims=True)
    return ek.AttentionResult(
        prompt="".join(tokens),
        token_ids=np.arange(4),
        tokens=tokens,
        layers=np.array([1, 2]),
        heads=np.array([0, 1, 2]),
        queries=np.arange(4),
        keys=np.broadcast_to(np.arange(4), (2, 3, 4, 4)),
        weights=weights.astype(np.float32),
    )


def test_attention_view_in_jupyterlab(browser, tmp_path):
    """A stored attention result whose tokens are markup: the grid draws every layer and head,
    a click on a head reaches the kernel and comes back as that head's pattern with the
    tokens as text on both axes, hovering a token lights up its row and its column, nothing
    in the text runs, and JupyterLab Dark darkens the view."""
    res, view, viewport = hostile_attention(), ".ek-attention", {"width": 1200, "height": 900}
    notebook, name = ATTENTION_NOTEBOOK, "attention_view"
    with stored_in_lab(browser, tmp_path, res, notebook, name, viewport) as page:
        page.wait_for_selector(f"{view}[data-drawn='6']", timeout=120000)
        assert page.locator(f"{view} .ek-att-cell").count() == 6
        page.locator(f"{view} .ek-att-cell[data-layer='2'][data-head='1']").click()
        title = f"{view} .ek-att-pattern .ek-att-title"
        page.wait_for_function(
            "sel => document.querySelector(sel)?.textContent === 'layer 2, head 1'",
            arg=title,
            timeout=30000,
        )
        keys = page.locator(f"{view} .ek-att-key").all_text_contents()
        queries = page.locator(f"{view} .ek-att-query").all_text_contents()
        # As text, whitespace marked the way the figures mark it (plot.text.token_text).
        marked = [token_text(t) for t in res.tokens]
        assert keys == marked and queries == marked
        cells = page.locator(f"{view} td.ek-att-w")
        assert cells.count() == 16
        drawn = cells.evaluate_all("tds => tds.map(td => td.title.split(': ').pop())")
        assert [float(w) for w in drawn] == pytest.approx(res.pattern(2, 1).ravel(), abs=1e-4)
        page.locator(f"{view} .ek-att-key[data-key='1']").hover()
        lit = page.locator(f"{view} td.ek-att-lit")
        # Token 1 as a query (its row of 4) and as a key (its column of 4), sharing a cell.
        assert lit.count() == 7
        assert_nothing_ran(page)
        assert page.locator(f"{view} img, {view} b").count() == 0
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator(view).screenshot(path=str(ARTIFACTS / "attention_view.png"))
        dark_theme(page)
        page.wait_for_function(
            "sel => { const c = getComputedStyle(document.querySelector(sel)).backgroundColor;"
            " const [r, g, b] = c.match(/\\d+/g).map(Number); return r + g + b < 150; }",
            arg=view,
            timeout=30000,
        )
        page.locator("#jupyterlab-splash").wait_for(state="detached", timeout=30000)
        page.locator(view).screenshot(path=str(ARTIFACTS / "attention_view_dark.png"))


@pytest.mark.engine
def test_steering_panel_in_jupyterlab(browser, tmp_path):
    """Typed into the steering panel by hand: two prompt lists with markup in them; Generate
    shows the plain and the steered continuation side by side, as the kernel holds them and
    as text, and draws the diff, flat before the steered layer; an empty list is a message,
    not a traceback; JupyterLab Dark darkens the continuations and the diff."""
    work = tmp_path / "work"
    work.mkdir()
    state_path = tmp_path / "state.json"
    notebook = STEERING_NOTEBOOK.read_text().replace("__STATE__", str(state_path))
    (work / "steering.ipynb").write_text(notebook)

    def state() -> dict:
        try:
            return json.loads(state_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    lab = Lab(tmp_path)
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    view = ".ek-steering"
    kernel_tree: list[psutil.Process] = []
    try:
        open_and_run(page, lab, "steering.ipynb", "notebook:run-all-above")
        button = page.locator(f"{view} button.widget-button", has_text="Generate")
        button.wait_for(timeout=240000)
        kernel_tree = [_process(wait_for(lambda: state().get("pid"), 60, "the kernel state"))]
        kernel_tree += _children(kernel_tree[0].pid)
        boxes = page.locator(f"{view} textarea")
        boxes.nth(1).fill(f"I love it {XSS_IMG}\nwhat a great day")
        button.click()  # the negative list is still empty
        wait_for(lambda: "negative prompts are empty" in state().get("header", ""), 60, "refusal")
        assert page.locator(f"{view} .ek-continuation").count() == 0
        assert "Traceback" not in page.locator(view).inner_text()

        boxes.nth(2).fill("I hate it\nwhat an awful day")
        button.click()
        done = wait_for(lambda: (s := state()).get("steered") is not None and s, 120, "Generate")
        assert done["positive"] == [f"I love it {XSS_IMG}", "what a great day"]
        shown = page.locator(f"{view} .ek-continuation")
        wait_for(lambda: shown.count() == 2, 30, "both continuations")
        texts = [el.inner_text() for el in shown.all()]
        assert texts[0].endswith(done["prompt"] + done["plain"])
        assert texts[1].endswith(done["prompt"] + done["steered"])
        assert texts[1].startswith("steered: layer 2, strength +4")
        assert done["plain"] != done["steered"] and done["js_before"] < 1e-12
        page.wait_for_selector(f"{view} .ek-steer-diff .ek-heatmap[data-drawn]", timeout=30000)
        assert_nothing_ran(page)
        assert page.locator(f"{view} img").count() == 0  # the prompt's markup shows as text
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator(view).screenshot(path=str(ARTIFACTS / "steering_panel.png"))

        dark_theme(page)
        page.wait_for_function(
            f"() => ({CANVAS_BACKGROUND})("
            f"document.querySelector('{view} .ek-steer-diff .ek-heatmap')) < 0.1",
            timeout=30000,
        )
        page.locator("#jupyterlab-splash").wait_for(state="detached", timeout=30000)
        colour = shown.nth(1).locator(".ek-continuation-text")
        assert css_luminance(colour.evaluate("el => getComputedStyle(el).color")) > 0.8
        page.locator(view).screenshot(path=str(ARTIFACTS / "steering_panel_dark.png"))

        page.evaluate(
            """() => {
                const panel = window.jupyterapp.shell.currentWidget;
                panel.content.activeCellIndex = panel.content.widgets.length - 1;
                window.jupyterapp.commands.execute('notebook:run-cell');
            }"""
        )
        wait_for((tmp_path / "closed").exists, 60, "the engine to close")
    except Exception:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "steering_panel_failure.png"))
        raise
    finally:
        page.close()
        lab.stop()
        _, alive = psutil.wait_procs([p for p in kernel_tree if p], timeout=20)
        for process in alive:
            process.kill()
        assert not alive, "the kernel or the engine's ranks outlived the test"


def test_corpus_panel_in_jupyterlab(browser, tmp_path):
    """Run corpus pressed by hand: the figure and the summary the kernel holds appear, the
    document with markup in it shows as text and runs nothing."""
    work = tmp_path / "work"
    work.mkdir()
    state_path = tmp_path / "state.json"
    notebook = CORPUS_NOTEBOOK.read_text().replace("__STATE__", str(state_path))
    (work / "corpus.ipynb").write_text(notebook)

    def state() -> dict:
        try:
            return json.loads(state_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    lab = Lab(tmp_path)
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    view = ".ek-corpus"
    kernel_tree: list[psutil.Process] = []
    try:
        open_and_run(page, lab, "corpus.ipynb", "notebook:run-all-above")
        button = page.locator(f"{view} button.widget-button", has_text="Run corpus")
        button.wait_for(timeout=240000)
        kernel_tree = [_process(wait_for(lambda: state().get("pid"), 60, "the kernel state"))]
        kernel_tree += _children(kernel_tree[0].pid)
        assert XSS_IMG in page.locator(f"{view} textarea").input_value()
        button.click()
        done = wait_for(lambda: (s := state()).get("result") and s, 120, "the corpus lens")
        result = done["result"]
        summary = f"{result['n_documents']} documents, {result['n_tokens']} tokens"
        header = page.locator(f"{view} .widget-html").first
        wait_for(lambda: summary in header.inner_text(), 30, "the summary")
        page.locator(f"{view} .jp-OutputArea {FIGURE}").wait_for(timeout=30000)  # the figure
        assert "Traceback" not in page.locator(view).inner_text()
        assert_nothing_ran(page)
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator(view).screenshot(path=str(ARTIFACTS / "corpus_panel.png"))
        page.evaluate(
            """() => {
                const panel = window.jupyterapp.shell.currentWidget;
                panel.content.activeCellIndex = panel.content.widgets.length - 1;
                window.jupyterapp.commands.execute('notebook:run-cell');
            }"""
        )
        wait_for((tmp_path / "closed").exists, 60, "the engine to close")
    except Exception:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "corpus_panel_failure.png"))
        raise
    finally:
        page.close()
        lab.stop()
        _, alive = psutil.wait_procs([p for p in kernel_tree if p], timeout=20)
        for process in alive:
            process.kill()
        assert not alive, "the kernel or the engine's ranks outlived the test"


def center(box: dict[str, float]) -> tuple[float, float]:
    return box["x"] + box["width"] / 2, box["y"] + box["height"] / 2


def open_tab(page: Any, title: str) -> None:
    """Open the explorer's panel tab ``title`` (one panel shows at a time)."""
    tab = page.locator(".ek-panels .lm-TabBar-tab", has_text=title)
    tab.click()
    wait_for(lambda: "lm-mod-current" in (tab.get_attribute("class") or ""), 30, f"tab {title}")


def pick_sites_and_run(page: Any, state: Callable[[], dict], run_button: Any) -> list[str]:
    """In the layer picker, click the last layer's attention row and drag along the "mid"
    line across every decoder layer, then Run; the heatmap's rows as the kernel holds them."""
    n = len(state()["result"]["layer_labels"]) - 1  # every layer is picked at first
    picker = page.locator(".ek-picker")
    picker.evaluate("root => root.scrollIntoView({block: 'center'})")
    picker.locator(f'.ek-cell[data-layer="{n}"][data-site="attn"]').click()
    first = picker.locator('.ek-cell[data-layer="1"][data-site="resid_mid"]').bounding_box()
    last = picker.locator(f'.ek-cell[data-layer="{n}"][data-site="resid_mid"]').bounding_box()
    page.mouse.move(*center(first))
    page.mouse.down()
    page.mouse.move(*center(last), steps=8)
    page.mouse.up()
    sites = [[i, "resid_mid"] for i in range(1, n)] + [[n, "attn"], [n, "resid_mid"]]
    wait_for(lambda: state().get("selected_sites") == sites, 30, "the picked sites")
    assert picker.locator(".ek-cell.ek-on").count() == (n + 1) + len(sites)
    # A line's name picks the whole line, and a second click drops it again.
    line = picker.locator('.ek-line[data-line="mlp"]')
    line.click()
    with_mlp = sorted(sites + [[i, "mlp"] for i in range(1, n + 1)], key=lambda row: row[0])
    wait_for(lambda: state().get("selected_sites") == with_mlp, 30, "the whole mlp line")
    line.click()
    wait_for(lambda: state().get("selected_sites") == sites, 30, "the mlp line dropped")

    run_button.click()
    wait_for(
        lambda: f"{n}.attn" in (state().get("result") or {}).get("layer_labels", []),
        120,
        "the lens of the picked sites",
    )
    wait_for(run_button.is_enabled, 60, "the Run button to come back")
    labels = state()["result"]["layer_labels"]
    expected = ["embed"]
    for i in range(1, n):
        expected += [f"{i}.mid", str(i)]
    expected += [f"{n}.attn", f"{n}.mid", str(n)]
    assert labels == expected
    # The trajectory over those rows is drawn, loaded and whole inside the explorer
    # (tests/test_result.py checks the figure's own lines, markers and ticks).
    open_tab(page, "Trajectory")
    figure = page.locator(f".ek-trajectory {FIGURE}")
    figure.scroll_into_view_if_needed()
    page.wait_for_function(
        "sel => { const img = document.querySelector(sel); return img?.complete"
        " && img.naturalWidth > 0; }",
        arg=f".ek-trajectory {FIGURE}",
        timeout=30000,
    )
    box, frame = figure.bounding_box(), page.locator(".ek-explorer").bounding_box()
    assert frame["x"] <= box["x"] and box["x"] + box["width"] <= frame["x"] + frame["width"]
    ARTIFACTS.mkdir(exist_ok=True)
    figure.screenshot(path=str(ARTIFACTS / "explorer_trajectory_sites.png"))
    return labels


def attribute_a_cell(page: Any, state: Callable[[], dict], label: str, target: int) -> int:
    """Hover the first cell of heatmap row ``label`` (its tooltip names the row), click it and
    check the attribution panel follows: position 0, token ``target``. The row's index."""
    res = state()["result"]
    row = res["layer_labels"].index(label)
    open_tab(page, "Attribution")
    tip = hover_cell(page, row, 0, MAIN)
    head = page.locator(f"{MAIN} .ek-tooltip .ek-tip-head").inner_text()
    assert head.startswith(f"layer {label} · "), head
    assert_tooltip_matches(
        tip["rows"], res["top_ids"][row][0], res["top_tokens"][row][0], res["top_probs"][row][0]
    )
    page.mouse.click(tip["point"]["x"], tip["point"]["y"])
    expected = {"positions": [res["positions"][0]], "target_ids": [target]}
    wait_for(
        lambda: state().get("selected") == [row, 0] and state()["attribution"] == expected,
        60,
        "the attribution at the clicked cell",
    )
    page.wait_for_function(
        "label => document.querySelector('.ek-attribution')?.textContent.includes(label)",
        arg=f"row {label} shaded",
        timeout=30000,
    )
    panel = page.locator(".ek-attribution")
    assert "Direct logit attribution" in panel.inner_text()
    assert f"at position {res['positions'][0]} " in panel.inner_text()
    assert panel.locator(FIGURE).is_visible()
    ARTIFACTS.mkdir(exist_ok=True)
    panel.screenshot(path=str(ARTIFACTS / "explorer_attribution.png"))
    page.locator(".ek-picker").screenshot(path=str(ARTIFACTS / "explorer_picker.png"))
    return row


# A digest of the canvas's pixels: whether what is drawn changed.
CANVAS_DIGEST = """root => {
    const px = root.querySelector("canvas.ek-canvas").getContext("2d")
        .getImageData(0, 0, 400, 300).data;
    let sum = 0;
    for (let i = 0; i < px.length; i++) sum = (sum * 31 + px[i]) % 1000000007;
    return sum;
}"""


def compare_and_drag_to_patch(page: Any, state: Callable[[], dict], run_button: Any) -> None:
    """Tick compare, type the second prompt, Run: the diff heatmap draws. Then drag the
    second prompt's cell (row "2", the first position where the prompts differ) onto the
    first prompt's heatmap, on another row of that column: the kernel patches layer 2 there
    and the first heatmap is redrawn."""
    page.get_by_role("checkbox", name="compare with a second prompt").check()
    tab = page.locator(".ek-panels .lm-TabBar-tab", has_text="Compare")
    wait_for(lambda: "lm-mod-current" in (tab.get_attribute("class") or ""), 30, "its tab")
    page.locator(".widget-textarea textarea").nth(1).fill(OTHER)
    run_button.click()
    compared = wait_for(
        lambda: (s := state()).get("comparison") and s.get("other") and s, 120, "the diff"
    )
    wait_for(run_button.is_enabled, 60, "the Run button to come back")
    res, other = compared["result"], compared["other"]
    assert other["prompt"] == OTHER and other["layer_labels"] == res["layer_labels"]
    assert compared["comparison"]["top_labels"] == ["first", "second"]
    layers = sorted({label.split(".")[0] for label in res["layer_labels"]}, key=_layer_number)
    assert compared["comparison"]["layer_labels"] == layers
    assert compared["comparison"]["shape"] == [len(layers), len(res["tokens"])]
    page.wait_for_selector(f"{DIFF}[data-drawn]", timeout=30000)
    assert "JS divergence" in page.locator(f"{DIFF} .ek-legend").inner_text()

    position = next(i for i, (a, b) in enumerate(zip(res["tokens"], other["tokens"])) if a != b)
    source_row = other["layer_labels"].index("2")
    target_row = len(res["layer_labels"]) - 1  # the top row: not the one that is patched
    page.keyboard.press("Escape")  # the tooltip a click left open
    main = page.locator(MAIN)
    main.evaluate("el => el.scrollIntoView({block: 'start'})")
    before = main.evaluate(CANVAS_DIGEST)
    start = cell_center(page, SOURCE, source_row, position)
    end = cell_center(page, MAIN, target_row, position)
    viewport = page.viewport_size
    assert 0 < start["y"] < viewport["height"] and 0 < end["y"] < viewport["height"]
    # A drop beside the heatmaps: while dragging, the heatmap that takes it is outlined;
    # dropped elsewhere, the ghost says where to drop, then goes, and nothing is patched.
    page.mouse.move(start["x"], start["y"])
    page.mouse.down()
    page.mouse.move(start["x"] + 40, start["y"] + 40, steps=4)
    assert page.locator(f"{MAIN}.ek-drop-ready").count() == 1
    assert page.locator(f"{SOURCE}.ek-drop-ready").count() == 0
    page.mouse.move(2, start["y"], steps=4)  # over the page's margin
    page.mouse.up()
    ghost = page.locator(".ek-ghost")
    assert ghost.inner_text() == "drop it on the outlined heatmap to patch it in"
    assert page.locator(".ek-drop-ready").count() == 0
    ghost.wait_for(state="detached", timeout=10000)
    assert main.evaluate(CANVAS_DIGEST) == before and not state()["result"]["patches"]
    page.mouse.move(start["x"], start["y"])
    page.mouse.down()
    page.mouse.move(end["x"], end["y"], steps=12)
    assert f"→ position {position} " in ghost.inner_text()  # where it lands, said while dragging
    assert ghost.inner_text().endswith(", row 2")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "explorer_drag.png"))
    page.mouse.up()
    assert ghost.count() == 0

    patched = wait_for(lambda: (s := state())["result"]["patches"] and s, 120, "the patched lens")
    assert patched["result"]["patches"] == [
        {
            "source": OTHER,
            "layer": 2,
            "site": "resid",
            "source_position": position,
            "target_position": position,
            "head": None,
        }
    ]
    assert patched["result"]["top_probs"] != res["top_probs"]
    wait_for(
        lambda: (state().get("comparison") or {}).get("top_labels") == ["clean", "patched"],
        60,
        "the diff of the run and its patched run",
    )
    page.wait_for_function(
        f"before => ({CANVAS_DIGEST})(document.querySelector('{MAIN}')) !== before",
        arg=before,
        timeout=30000,
    )
    assert "patched: row 2" in page.locator(".ek-main-heatmap").evaluate(
        "el => el.previousElementSibling.textContent"
    )
    page.screenshot(path=str(ARTIFACTS / "explorer_compare.png"), full_page=True)


def _layer_number(label: str) -> int:
    return 0 if label == "embed" else int(label)


def sweep(page: Any, state: Callable[[], dict]) -> None:
    """Press Sweep: the progress bar fills and the map is drawn, a row per picked layer."""
    page.locator("button.widget-button", has_text="Sweep").click()
    done = wait_for(lambda: (s := state()).get("sweep") and s, 180, "the sweep")
    res = done["result"]
    layers = sorted({_layer_number(label.split(".")[0]) for label in res["layer_labels"]})
    assert done["sweep"] == {
        "shape": [len(layers), len(res["tokens"])],
        "layers": layers,
        "source": OTHER,
        "target": PROMPT,
    }
    assert done["progress"] == [len(layers), len(layers)]
    page.locator(f".ek-sweep {FIGURE}").wait_for(state="visible", timeout=30000)
    bar = page.locator(".ek-sweep .widget-hprogress .progress-bar")
    wait_for(lambda: bar.evaluate("el => el.style.width") == "100%", 30, "a full progress bar")
    page.locator(".ek-sweep").screenshot(path=str(ARTIFACTS / "explorer_sweep.png"))


# Press button ``press``, then button ``target`` the moment it is enabled (a person's click,
# without the round trips of Playwright's checks before it): resolves once clicked.
CLICK_WHEN_ENABLED = """([target, press]) => new Promise(resolve => {
    const watch = new MutationObserver(() => {
        if (!target.disabled) { watch.disconnect(); target.click(); resolve(); }
    });
    watch.observe(target, {attributes: true});
    press.click();
})"""


def cancel_a_sweep(page: Any, state: Callable[[], dict]) -> None:
    """Press Sweep, then Cancel the moment it can be pressed (the notebook's engine takes
    0.5 s more per row of a sweep, `slowed_rows`, and a sweep of ``tiny`` is still too
    short for Playwright's own click to land in): the sweep stops after the row in flight,
    its header says so with no traceback, the bar stays short of full, and Sweep is back
    while Cancel is not. Whether the sweep ends before the Cancel reaches the kernel is not
    in the test's hands (on a loaded machine it can), so that case tries again."""
    sweep_button = page.locator(".ek-sweep button.widget-button", has_text="Sweep")
    cancel = page.locator(".ek-sweep button.widget-button", has_text="Cancel")
    header = page.locator(".ek-sweep .widget-html").first
    for _ in range(3):
        wait_for(sweep_button.is_enabled, 30, "the Sweep button")
        ended = state()["sweeps_ended"]
        page.evaluate(CLICK_WHEN_ENABLED, [cancel.element_handle(), sweep_button.element_handle()])
        wait_for(lambda ended=ended: state()["sweeps_ended"] > ended, 120, "the sweep to end")
        if "cancelled after" in state()["sweep_header"]:
            break
    else:
        raise AssertionError("three sweeps ended before their Cancel landed")
    wait_for(lambda: "cancelled after" in header.inner_text(), 30, "the cancelled sweep shown")
    assert "Traceback" not in page.locator(".ek-sweep").inner_text()
    wait_for(sweep_button.is_enabled, 30, "the Sweep button back")
    assert cancel.is_disabled()
    progress = state()["progress"]
    assert progress[0] < progress[1], progress
    bar = page.locator(".ek-sweep .widget-hprogress .progress-bar")
    assert bar.evaluate("el => el.style.width") != "100%"


# Which drawing of each panel figure on the page shows: "light", "dark", or what is wrong.
SHOWN_FIGURES = """() => [...document.querySelectorAll('.ek-figure')].map(figure => {
    const shown = kind => getComputedStyle(figure.querySelector('.ek-figure-' + kind)).display;
    const light = shown('light') !== 'none', dark = shown('dark') !== 'none';
    return light && !dark ? 'light' : dark && !light ? 'dark' : `light ${light}, dark ${dark}`;
})"""


def shows(page: Any, text: str) -> None:
    """Wait until ``text`` is on screen (the page follows the kernel's widgets a moment
    after the kernel has them)."""
    found = page.get_by_text(text, exact=False).first
    wait_for(found.is_visible, 30, f"{text!r} on screen")


# What the explorer says of a cancelled Run, by where the Cancel landed.
CANCELLED_RUN = (
    "cancelled: the lens was stopped on the ranks",
    "cancelled before the second prompt's lens",
    "cancelled: the second prompt's lens was stopped on the ranks",
)


def type_prompt(box: Any, state: Callable[[], dict], text: str) -> None:
    """Type ``text`` into the explorer's prompt and wait until the kernel has it. A widget's
    value reaches the kernel as a sync that ipywidgets holds back while its last one is
    unanswered, while a button's click is sent at once: a Run pressed straight after typing
    could overtake the text on a loaded machine and lens the prompt before it."""
    box.fill(text)
    wait_for(lambda: state().get("prompt") == text, 30, f"the kernel to hear the prompt {text!r}")


def cancel_a_run(page: Any, state: Callable[[], dict], prompt_box: Any, run_button: Any) -> None:
    """A Run of a long prompt, cancelled the moment Cancel can be pressed: the lens stops on
    the ranks, the explorer says "cancelled" with no traceback, dims the heatmap it leaves,
    and gives Run back; the next Run draws. Whether the lens (under a second on ``tiny``)
    ends before the Cancel lands is not in the test's hands, so that case tries again; with
    two prompts, the Cancel may land during either prompt's lens or between them."""
    type_prompt(prompt_box, state, "The capital of France is " * 32)
    for _ in range(6):
        # Resolved once Cancel is pressed: Run is disabled by then (the kernel disables it
        # before it enables Cancel), and enabled again only once the Run has ended.
        cancel = page.locator(".ek-run-cancel").element_handle()
        page.evaluate(CLICK_WHEN_ENABLED, [cancel, run_button.element_handle()])
        wait_for(run_button.is_enabled, 120, "the Run to end")
        if "cancelled" in state()["message"]:
            break
    else:
        raise AssertionError("six Runs ended before their Cancel landed")
    said = html.unescape(re.sub("<[^>]+>", "", state()["message"]))
    assert said in CANCELLED_RUN, said
    shows(page, said)
    assert page.locator(".ek-main-heatmap.ek-stale").count() == 1
    assert "Traceback" not in page.locator(".ek-explorer").inner_text()
    assert page.locator(".ek-run-cancel").is_disabled()
    type_prompt(prompt_box, state, PROMPT)
    run_button.click()
    wait_for(lambda: "took" in state()["status"] and not state()["message"], 120, "a Run")


# The computed colour of ``el``, and that of JupyterLab's warning colour on this page.
# The text under ``root`` that reads at under 4.5:1 against what is behind it (WCAG's
# contrast ratio, from the computed colours: the text's, and the first ancestor's opaque
# background), as "tag.class: text colour on background = ratio". Disabled controls, a
# dimmed stale heatmap and hidden tabs are left out, as WCAG leaves them out.
LOW_CONTRAST = """root => {
  const channels = c => {
    const v = c.match(/[\\d.]+/g).map(Number);
    return c.startsWith('color(srgb') ? v.map((x, i) => (i < 3 ? x * 255 : x)) : v;
  };
  const linear = v => (v /= 255) <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4;
  const luminance = c => {
    const [r, g, b] = channels(c);
    return 0.2126 * linear(r) + 0.7152 * linear(g) + 0.0722 * linear(b);
  };
  const opaque = c => (channels(c)[3] ?? 1) > 0.5;
  const behind = el => {
    for (let e = el; e; e = e.parentElement) {
      const c = getComputedStyle(e).backgroundColor;
      if (opaque(c)) return c;
    }
    return getComputedStyle(document.body).backgroundColor;
  };
  const low = [];
  for (const el of root.querySelectorAll('*')) {
    if (!el.offsetParent || el.closest(':disabled, .ek-stale, .lm-mod-hidden')) continue;
    const text = [...el.childNodes].filter(n => n.nodeType === 3 && n.textContent.trim())
      .map(n => n.textContent.trim()).join(' ');
    if (!text) continue;
    const fg = getComputedStyle(el).color, bg = behind(el);
    const [a, b] = [luminance(fg), luminance(bg)];
    const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
    if (ratio < 4.5) {
      const what = `${el.tagName}.${el.className}: ${text.slice(0, 30)}`;
      low.push(`${what} ${fg} on ${bg} = ${ratio.toFixed(2)}`);
    }
  }
  return low;
}"""


def several_tokens_and_a_trailing_comma(page: Any) -> None:
    """Typed targets as a person mistypes them: a target of several tokens is flagged in
    the warning colour with its tokens and what is measured instead, and a trailing comma
    adds no blank target; typed back, the flag goes."""
    box = page.get_by_placeholder("comma-separated, spaces kept")
    typed = box.input_value()
    flags = page.locator("b", has_text="is measured")
    before = flags.count()  # the tiny tokenizer splits ' Paris' and ' London' too
    box.fill(typed + ", New York,")
    wait_for(lambda: flags.count() == before + 1, 30, "the several-token flag")
    flag = flags.last
    assert flag.is_visible()
    assert flag.evaluate("el => getComputedStyle(el).color") != box.evaluate(
        "el => getComputedStyle(el).color"
    )  # the warning's colour, not the text's
    assert page.locator(".ek-explorer").evaluate(LOW_CONTRAST) == []
    assert "8 tokens: only ' ' is measured" in flag.inner_text()
    rows = page.locator(".widget-html", has=flag).inner_text()
    assert rows.count("→") == len(typed.split(",")) + 1, rows  # no row for a blank target
    assert "' New York' →" in rows and "' ' →" not in rows
    box.fill(typed)
    wait_for(lambda: flags.count() == before, 30, "the flag to go")


def unpin_tuned_refused_and_dark(page: Any, state: Callable[[], dict], run_button: Any) -> None:
    """The rest of a day's sequence, as a person sees it: the pin chip unpins its token; the
    tuned lens says so in the status line; a target of several tokens is flagged; a refused
    Run (an empty prompt) says why, dims the heatmap it leaves and names whose run that is,
    with no traceback, and the next Run clears both; JupyterLab Dark darkens the heatmap and
    turns every panel figure into its dark drawing."""
    chip = page.locator("button.ek-pin")
    assert chip.count() == 1, chip.count()
    chip.click()
    wait_for(lambda: state().get("pinned") == [], 60, "the unpin")
    wait_for(lambda: chip.count() == 0, 30, "the chip to go")
    wait_for(run_button.is_enabled, 120, "the lens without the pin")

    # The tuned lens reads the residual stream only: the sub-layer sites picked before go.
    picker = page.locator(".ek-picker")
    picker.evaluate("root => root.scrollIntoView({block: 'center'})")
    n = max(_layer_number(label.split(".")[0]) for label in state()["result"]["layer_labels"])
    picker.locator(f'.ek-cell[data-layer="{n}"][data-site="attn"]').click()
    wait_for(lambda: [n, "attn"] not in state()["selected_sites"], 30, "the attention row off")
    mid = picker.locator('.ek-line[data-line="resid_mid"]')
    before = state()["selected_sites"]
    mid.click()  # a line partly or wholly picked: this click picks it whole or drops it
    wait_for(lambda: state()["selected_sites"] != before, 30, "the mid line clicked")
    if state()["selected_sites"]:
        mid.click()
    wait_for(lambda: state()["selected_sites"] == [], 30, "no sub-layer sites")

    lens_menu = page.locator("select", has=page.locator("option", has_text="tuned lens"))
    lens_menu.select_option(label="tuned lens")
    run_button.click()
    wait_for(lambda: "tuned lens" in state().get("status", ""), 120, "the tuned lens's status")
    wait_for(run_button.is_enabled, 60, "the tuned Run to end")
    shows(page, "tuned lens:")
    lens_menu.select_option(label="logit lens")

    several_tokens_and_a_trailing_comma(page)
    prompt_box = page.locator(".widget-textarea textarea").first
    cancel_a_run(page, state, prompt_box, run_button)
    type_prompt(prompt_box, state, "")
    run_button.click()
    wait_for(lambda: "the prompt is empty" in state().get("message", ""), 60, "the refusal")
    shows(page, "the prompt is empty")
    stale = page.locator(".ek-main-heatmap.ek-stale")
    wait_for(lambda: stale.count() == 1, 30, "the heatmap left dimmed")
    shows(page, "still shows the previous run")
    assert "Traceback" not in page.locator(".jp-OutputArea").first.inner_text()
    type_prompt(prompt_box, state, PROMPT)
    run_button.click()
    wait_for(lambda: (s := state()).get("message") == "" and "rows" in s["status"], 120, "a Run")
    wait_for(lambda: stale.count() == 0, 30, "the heatmap undimmed")

    for panel in (".ek-trajectory", ".ek-sweep"):  # figures on screen at this point
        assert page.locator(f"{panel} .ek-figure").count() == 1, panel
    assert page.evaluate(SHOWN_FIGURES) == ["light"] * page.locator(".ek-figure").count()
    dark_theme(page)
    page.wait_for_function(
        f"() => ({CANVAS_BACKGROUND})(document.querySelector('{MAIN}')) < 0.1", timeout=30000
    )
    page.locator("#jupyterlab-splash").wait_for(state="detached", timeout=30000)
    # Every panel's figure is now its dark-theme drawing, light ink on no background.
    page.wait_for_function(
        f"() => ({SHOWN_FIGURES})().every(shown => shown === 'dark')", timeout=30000
    )
    page.screenshot(path=str(ARTIFACTS / "explorer_jupyterlab_dark.png"), full_page=True)


# Every text a canvas draws, recorded on the canvas with where and how (an init script, so
# the heatmaps' own code runs unchanged): what the researcher sees in the cells and axes.
RECORD_CANVAS_TEXT = """(() => {
    const fill = CanvasRenderingContext2D.prototype.fillText;
    CanvasRenderingContext2D.prototype.fillText = function (text, x, y, ...rest) {
        const {a, b, c, d, e, f} = this.getTransform();
        (this.canvas.ekDrawn = this.canvas.ekDrawn || []).push({
            text: String(text), x, y, align: this.textAlign,
            width: this.measureText(String(text)).width, m: [a, b, c, d, e, f],
        });
        return fill.call(this, text, x, y, ...rest);
    };
})()"""

# The heatmap under ``root`` drawn again (a scroll repaints it), and what it drew then.
DRAWN_TEXT = """async root => {
    const canvas = root.querySelector("canvas.ek-canvas");
    canvas.ekDrawn = [];
    root.querySelector(".ek-scroller").dispatchEvent(new Event("scroll"));
    await new Promise(resolve => requestAnimationFrame(() => setTimeout(resolve, 50)));
    return {texts: canvas.ekDrawn, width: canvas.width, height: canvas.height};
}"""


def text_box(drawn: dict) -> list[tuple[float, float]]:
    """The four corners, in canvas pixels, of a text a canvas drew (10 px high, middle
    baseline, as the heatmaps draw), through the transform it was drawn with."""
    width, x, y = drawn["width"], drawn["x"], drawn["y"]
    left = {"right": x - width, "center": x - width / 2}.get(drawn["align"], x)
    a, b, c, d, e, f = drawn["m"]
    corners = [(left, y - 5), (left + width, y - 5), (left + width, y + 5), (left, y + 5)]
    return [(a * u + c * v + e, b * u + d * v + f) for u, v in corners]


def boxes_overlap(one: list[tuple[float, float]], two: list[tuple[float, float]]) -> bool:
    """Whether two convex quadrilaterals overlap (no edge of either separates them)."""
    for quad in (one, two):
        for i in range(4):
            (x1, y1), (x2, y2) = quad[i], quad[(i + 1) % 4]
            normal = (y1 - y2, x2 - x1)
            spans = [[normal[0] * x + normal[1] * y for x, y in q] for q in (one, two)]
            if max(spans[0]) <= min(spans[1]) + 0.5 or max(spans[1]) <= min(spans[0]) + 0.5:
                return False
    return True


def axis_labels_fit(page: Any, root: str) -> list[str]:
    """The token labels under the heatmap at ``root`` (drawn turned): each pair that overlaps,
    and each one cut by the canvas's edge."""
    drawn = page.locator(root).evaluate(DRAWN_TEXT)
    labels = [t for t in drawn["texts"] if abs(t["m"][1]) > 1e-6]  # turned: the axis
    assert labels, "no turned labels drawn"
    boxes = [text_box(t) for t in labels]
    wrong = [
        f"{labels[i]['text']!r} overlaps {labels[j]['text']!r}"
        for i in range(len(boxes))
        for j in range(i + 1, len(boxes))
        if boxes_overlap(boxes[i], boxes[j])
    ]
    for label, box in zip(labels, boxes):
        inside = all(0 <= x <= drawn["width"] and 0 <= y <= drawn["height"] for x, y in box)
        if not inside:
            wrong.append(f"{label['text']!r} is cut by the canvas's edge")
    return wrong


def whitespace_is_marked(page: Any, state: Callable[[], dict]) -> None:
    """The first heatmap draws each token with its whitespace marked: ' capital' as
    '␣capital' on its axis, and no text drawn begins or ends with a bare space; the diff's
    turned labels neither overlap nor are cut."""
    drawn = page.locator(MAIN).evaluate(DRAWN_TEXT)["texts"]
    texts = [t["text"] for t in drawn]
    assert "␣capital" in texts, texts
    assert not [t for t in texts if t != t.strip(" ")], texts
    assert axis_labels_fit(page, MAIN) == []
    open_tab(page, "Compare")
    assert axis_labels_fit(page, DIFF) == []


def sweep_range_is_fitted(state: Callable[[], dict]) -> None:
    """The sweep's colours span the map's own range (its effects of a few hundredths would
    look blank on 0..1), as the toggle says."""
    scale = state()["sweep_scale"]
    assert scale["toggle"] == "fitted"
    np.testing.assert_allclose(scale["clim"], scale["data"], rtol=1e-6, atol=1e-9)
    assert scale["data"] != [0.0, 1.0]


def back_to_unpatched_and_a_heads_pattern(
    page: Any, state: Callable[[], dict], run_button: Any
) -> None:
    """From the patched run a drop made: Run draws the unpatched lens, and no panel keeps a
    notice of the patched run; a cell clicked opens what its position attends to, the
    heads' grid; a head clicked in the grid draws its whole pattern."""
    assert state()["result"]["patches"]  # the drop's patched run is shown
    page.keyboard.press("Escape")
    run_button.click()
    wait_for(lambda: not state()["result"]["patches"], 120, "the unpatched Run")
    wait_for(run_button.is_enabled, 60, "the Run button to come back")
    res = state()["result"]
    layer, position = len(res["layer_labels"]) - 1, len(res["tokens"]) - 2
    open_tab(page, "Attention")
    tip = hover_cell(page, layer, position, MAIN)
    page.mouse.click(tip["point"]["x"], tip["point"]["y"])
    page.keyboard.press("Escape")
    wait_for(
        lambda: (state().get("attention") or {}).get("query") == res["positions"][position],
        60,
        "the attention at the clicked position",
    )
    grid = page.locator(".ek-attention-panel .ek-att-cell")
    wait_for(lambda: grid.count() > 1, 30, "the heads' grid")
    notices = state()["panel_notices"]
    assert not [name for name, text in notices.items() if "patched" in text], notices
    assert "patched" not in page.locator(".ek-panels").text_content()
    head = grid.nth(1)
    clicked = [int(head.get_attribute("data-layer")), int(head.get_attribute("data-head"))]
    head.click()
    wait_for(lambda: state()["attention"]["selected"] == clicked, 30, "the head picked")
    pattern = page.locator(".ek-attention-panel td.ek-att-w")
    wait_for(lambda: pattern.count() > 0, 60, "the head's whole pattern")


def steer_the_prompt(page: Any, state: Callable[[], dict]) -> None:
    """Steering as a newcomer types it: both prompt lists, then Generate; the plain and the
    steered continuation are shown, and the diff measures the explorer's first target
    until another is picked: its first token here, as the lens does (' Paris' and ' London'
    are several tokens to the tiny model, and both begin with ' ', measured once)."""
    open_tab(page, "Steering")
    view = page.locator(".ek-steering")
    view.get_by_placeholder("positive prompts, one per line").fill("I love it\nwhat a great day")
    view.get_by_placeholder("negative prompts, one per line").fill("I hate it\nwhat awful news")
    view.locator("button.widget-button", has_text="Generate").click()
    done = wait_for(lambda: state().get("steering"), 120, "Generate")
    shown = view.locator(".ek-continuation")
    wait_for(lambda: shown.count() == 2, 30, "both continuations")
    # Compared without whitespace: the browser's text turns the model's "\r" into a break.
    texts = ["".join(element.inner_text().split()) for element in shown.all()]
    kernel = ["".join(done[which].split()) for which in ("plain", "steered")]
    assert texts[0].endswith(kernel[0]) and texts[1].endswith(kernel[1]), (texts, kernel)
    assert done["tokens"] == [" "] and done["measures"] == done["labels"][0], done
    view.locator(".ek-steer-diff .ek-heatmap[data-drawn]").wait_for(timeout=30000)


def train_cancel_and_interrupt(page: Any, state: Callable[[], dict], run_button: Any) -> float:
    """The training panel as a newcomer uses it: a short budget is kept within 10% (the
    kernel times the Train button's busy span); Cancel pressed during a long training acts
    within 3 s of reaching the kernel and keeps the best so far; the kernel's stop button
    (Kernel > Interrupt) during another stops it too, says "interrupted" with no traceback,
    and the next Run works. Returns the seconds Cancel took from its arrival in the kernel."""
    open_tab(page, "Training")
    seconds = page.locator(".ek-training input[type='number']")
    train = page.locator(".ek-training button.widget-button", has_text="Train")
    cancel = page.locator(".ek-training button.widget-button", has_text="Cancel")
    seconds.fill("8")
    seconds.press("Enter")
    wait_for(lambda: state()["training_budget"] == 8, 30, "the budget")
    train.click()
    trained = wait_for(
        lambda: (t := state()["trainings"]) and t[-1][1] is not None and t[-1], 120, "training"
    )
    took = trained[1] - trained[0]
    assert took <= 8 * 1.1, f"an 8 s budget took {took:.1f} s"
    wait_for(
        lambda: "closer to the final" in state()["panel_notices"]["training"], 30, "its summary"
    )

    seconds.fill("120")
    seconds.press("Enter")
    wait_for(lambda: state()["training_budget"] == 120, 30, "the long budget")
    count = len(state()["trainings"])
    train.click()
    wait_for(lambda: "training:" in state()["panel_notices"]["training"], 60, "training under way")
    began = time.monotonic()
    cancel.click()
    stopped = wait_for(
        lambda: (s := state())["trainings"][count][1] is not None and s, 30, "the training to stop"
    )
    seen = time.monotonic() - began
    # Timed from the click's arrival in the kernel: what envoykit answers for. The round trip
    # the browser sees (in the message) went past 3 s in two full CI runs (3.0 and 14.2 s);
    # run alone it took 0.3 s, the training stopping 4 ms after the click reached the kernel.
    arrived = stopped["cancels"][-1]
    acted = stopped["trainings"][count][1] - arrived
    assert arrived >= stopped["trainings"][count][0], "no Cancel reached the kernel"
    assert acted < 3, f"Cancel took {acted:.1f} s to act in the kernel ({seen:.1f} s seen)"
    wait_for(lambda: "cancelled after" in state()["panel_notices"]["training"], 30, "'cancelled'")

    train.click()
    wait_for(lambda: "training:" in state()["panel_notices"]["training"], 60, "training again")
    page.evaluate("() => window.jupyterapp.commands.execute('kernelmenu:interrupt')")
    wait_for(lambda: state()["trainings"][count + 1][1] is not None, 30, "the interrupt to act")
    header = page.locator(".ek-training .widget-html").first
    wait_for(lambda: "interrupted after" in header.inner_text(), 30, "'interrupted' shown")
    assert "Traceback" not in page.locator(".jp-OutputArea").first.inner_text()
    run_button.click()
    wait_for(lambda: "took" in state().get("status", ""), 120, "a Run after the interrupt")
    wait_for(run_button.is_enabled, 60, "the Run button to come back")
    return acted


def cells_fill_their_room(page: Any) -> None:
    """The main heatmap's cells fill its half of the explorer's row, from 52 px up to
    96 px: no wider cell would fit, and the panel stays beside the heatmap; on a wide
    screen (1920 px) they grow past 52 px."""
    for wide in (False, True):
        if wide:
            before = page.viewport_size
            page.set_viewport_size({"width": 1920, "height": 1000})
            page.wait_for_timeout(500)
        found = page.evaluate(
            """() => {
                const root = document.querySelector('.ek-main-heatmap .ek-heatmap');
                const row = root.closest('.ek-beside');
                const panels = row.querySelector('.ek-panels').getBoundingClientRect();
                const heatmap = root.getBoundingClientRect();
                return {
                    cell: Number(root.dataset.cellWidth),
                    room: row.clientWidth / 2 - 12,
                    cells: root.querySelector('.ek-spacer').offsetWidth - 52,
                    beside: panels.left >= heatmap.right && panels.top < heatmap.bottom,
                };
            }"""
        )
        cell, room, cells = found["cell"], found["room"], found["cells"]
        assert 52 <= cell <= 96 and found["beside"], found
        positions = cells // cell
        assert 52 + cells + 20 <= room or cell == 52, found  # it fits its share
        assert cell == 96 or 52 + positions * (cell + 1) + 20 > room, found  # none wider would
        if wide:
            assert cell > 52, found
            page.set_viewport_size(before)
            page.wait_for_timeout(500)


def fits_one_screen(page: Any) -> None:
    """At 1280 x 800 the controls, the picker, the heatmap and the open panel (attribution)
    fit in the notebook's view: scrolled to the explorer, nothing of it is below the fold."""
    page.set_viewport_size({"width": 1280, "height": 800})
    open_tab(page, "Attribution")
    explorer = page.locator(".ek-explorer")
    explorer.evaluate("el => el.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(500)
    box = explorer.bounding_box()
    view = page.locator(".jp-NotebookPanel-notebook").bounding_box()
    assert box["height"] <= view["height"], (box, view)
    cells_fill_their_room(page)
    # The open panel's figure at its own size: its 8-point legend reads at 11 px.
    scaled = page.locator(".ek-panels .ek-figure img").evaluate_all(
        "imgs => imgs.filter(img => img.offsetParent && img.clientWidth !== img.naturalWidth)"
        ".map(img => `${img.alt}: ${img.clientWidth} of ${img.naturalWidth} px`)"
    )
    assert scaled == []
    page.screenshot(path=str(ARTIFACTS / "explorer_1280x800.png"))


@pytest.mark.engine
def test_explorer_in_jupyterlab(browser, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    state_path = tmp_path / "state.json"
    (work / "explorer.ipynb").write_text(NOTEBOOK.read_text().replace("__STATE__", str(state_path)))

    def state() -> dict:
        try:
            return json.loads(state_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    timings = {}
    started = time.monotonic()
    lab = Lab(tmp_path)
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.add_init_script(RECORD_CANVAS_TEXT)
    kernel_tree: list[psutil.Process] = []
    try:
        timings["lab"] = time.monotonic() - started
        # Every cell but the last, which closes the engine at the end of the test.
        open_and_run(page, lab, "explorer.ipynb", "notebook:run-all-above")
        run_button = page.locator("button.widget-button.mod-primary", has_text="Run")
        run_button.wait_for(timeout=240000)
        kernel_tree = [_process(wait_for(lambda: state().get("pid"), 30, "the kernel state"))]
        kernel_tree += _children(kernel_tree[0].pid)
        timings["notebook + engine"] = time.monotonic() - started - timings["lab"]

        t = time.monotonic()
        run_button.click()
        wait_for(lambda: state().get("result"), 120, "the lens result in the kernel")
        page.wait_for_selector(f"{MAIN}[data-drawn]", timeout=30000)
        # Enabled again means the kernel has finished the whole Run (result, heatmap, plot).
        wait_for(run_button.is_enabled, 60, "the Run button to come back")
        timings["run"] = time.monotonic() - t

        t = time.monotonic()
        res = state()["result"]
        layer, position = len(res["layer_labels"]) - 1, len(res["top_ids"][0]) - 1
        open_tab(page, "Attribution")  # before the click: a press elsewhere closes a tooltip
        tip = hover_cell(page, layer, position, MAIN)
        assert_tooltip_matches(
            tip["rows"],
            res["top_ids"][layer][position],
            res["top_tokens"][layer][position],
            res["top_probs"][layer][position],
        )

        page.mouse.click(tip["point"]["x"], tip["point"]["y"])
        wait_for(lambda: state().get("selected") == [layer, position], 30, "the selection")
        # The click also attributes the prediction at that position, for the first target.
        attribution = wait_for(lambda: state().get("attribution"), 60, "the attribution")
        assert attribution == {
            "positions": [res["positions"][position]],
            "target_ids": [res["target_ids"][0]],
        }
        page.locator(f".ek-attribution {FIGURE}").wait_for(state="visible", timeout=30000)
        before = page.evaluate(
            "() => document.querySelector('.ek-trajectory .ek-figure-light').src"
        )

        new_id = next(r["id"] for r in tip["rows"] if r["id"] not in res["target_ids"])
        page.locator(f'{MAIN} .ek-tooltip .ek-token[data-id="{new_id}"]').click()
        pinned = wait_for(
            lambda: (s := state()) and str(new_id) in s.get("trajectory", []) and s,
            120,
            "the pinned token's trajectory",
        )
        assert pinned["pinned"] == [new_id]
        assert new_id in pinned["result"]["target_ids"]
        assert pinned["selected"] == [layer, position]
        page.wait_for_function(
            "before => document.querySelector('.ek-trajectory .ek-figure-light')?.src !== before",
            arg=before,
            timeout=30000,
        )
        # The pin is for display: the attribution still measures the first target, and
        # measures the pinned token once it is picked in the attribution panel.
        assert state()["attribution"]["target_ids"] == [res["target_ids"][0]]
        token = next(r["token"] for r in tip["rows"] if r["id"] == new_id)
        page.locator(".ek-attribution .ek-target-choice select").select_option(
            label=f"{token!r} (pinned)"
        )
        wait_for(
            lambda: state()["attribution"]["target_ids"] == [new_id],
            60,
            "the attribution of the pinned token, picked in its panel",
        )
        timings["hover + select + pin"] = time.monotonic() - t

        t = time.monotonic()
        labels = pick_sites_and_run(page, state, run_button)
        row = attribute_a_cell(page, state, labels[-3], new_id)  # the last layer's attention
        timings["sub-layer sites + attribution"] = time.monotonic() - t

        page.locator(".widget-textarea textarea").first.evaluate(
            "el => el.scrollIntoView({block: 'start'})"
        )
        hover_cell(page, row, 0, MAIN)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "explorer_jupyterlab.png"), full_page=True)

        t = time.monotonic()
        compare_and_drag_to_patch(page, state, run_button)
        timings["compare + drag to patch"] = time.monotonic() - t
        t = time.monotonic()
        cancel_a_sweep(page, state)
        sweep(page, state)
        sweep_range_is_fitted(state)
        timings["a cancelled sweep + a sweep"] = time.monotonic() - t
        t = time.monotonic()
        back_to_unpatched_and_a_heads_pattern(page, state, run_button)
        whitespace_is_marked(page, state)
        cells_fill_their_room(page)
        timings["unpatched + heads + labels"] = time.monotonic() - t
        t = time.monotonic()
        steer_the_prompt(page, state)
        timings["steering"] = time.monotonic() - t
        t = time.monotonic()
        timings["Cancel acted in"] = train_cancel_and_interrupt(page, state, run_button)
        timings["training + cancel + interrupt"] = time.monotonic() - t
        assert page.locator(".ek-explorer").evaluate(LOW_CONTRAST) == []
        t = time.monotonic()
        unpin_tuned_refused_and_dark(page, state, run_button)
        timings["unpin + tuned + refused + dark"] = time.monotonic() - t
        assert page.locator(".ek-explorer").evaluate(LOW_CONTRAST) == []
        fits_one_screen(page)

        t = time.monotonic()
        page.evaluate(
            """() => {
                const panel = window.jupyterapp.shell.currentWidget;
                panel.content.activeCellIndex = panel.content.widgets.length - 1;
                window.jupyterapp.commands.execute('notebook:run-cell');
            }"""
        )
        wait_for((tmp_path / "closed").exists, 60, "the engine to close")
        timings["close"] = time.monotonic() - t
    except Exception as err:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "explorer_jupyterlab_failure.png"))
        seen = state()
        (ARTIFACTS / "explorer_jupyterlab_failure.json").write_text(json.dumps(seen))
        # What the kernel said last, in the report itself (a CI log keeps no artifacts).
        err.add_note(f"kernel's message: {seen.get('message')!r}")
        err.add_note(f"kernel's status: {seen.get('status')!r}")
        raise
    finally:
        page.close()
        lab.stop()
        _, alive = psutil.wait_procs([p for p in kernel_tree if p], timeout=20)
        for process in alive:
            process.kill()
        assert not alive, "the kernel or the engine's ranks outlived the test"
    timings["total"] = time.monotonic() - started
    print("timings:", {name: round(seconds, 1) for name, seconds in timings.items()})


@pytest.mark.engine
def test_features_panel_in_jupyterlab(browser, tmp_path):
    """An SAE's features on a prompt with markup in it: the chips are the features the
    kernel read, tokens as text; a click on a chip reaches the kernel as the selection and
    comes back as the feature's activation row and logit effects; Generate clamped shows
    the plain and the clamped continuation side by side; JupyterLab Dark darkens the
    panel."""
    from envoykit.plot.text import visible

    work = tmp_path / "work"
    work.mkdir()
    state_path = tmp_path / "state.json"
    notebook = FEATURES_NOTEBOOK.read_text().replace("__STATE__", str(state_path))
    notebook = notebook.replace(
        "__SAE__", str(ROOT / "tests" / "data" / "sae" / "saelens_jumprelu")
    )
    (work / "features.ipynb").write_text(notebook)

    def state() -> dict:
        try:
            return json.loads(state_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    lab = Lab(tmp_path)
    page = browser.new_page(viewport={"width": 1300, "height": 1000})
    view = ".ek-features-panel"
    kernel_tree: list[psutil.Process] = []
    try:
        open_and_run(page, lab, "features.ipynb", "notebook:run-all-above")
        page.wait_for_selector(f"{view} .ek-features[data-drawn]", timeout=240000)
        read = wait_for(lambda: (s := state()).get("chips") and s, 60, "the kernel state")
        kernel_tree = [_process(read["pid"])]
        kernel_tree += _children(kernel_tree[0].pid)
        chips = page.locator(f"{view} .ek-chip")
        assert chips.count() == sum(len(c) for c in read["chips"])
        drawn = chips.evaluate_all(
            "els => els.map(el => [Number(el.dataset.position), Number(el.dataset.feature),"
            " Number(el.dataset.act)])"
        )
        assert drawn == [[p, f, a] for p, c in enumerate(read["chips"]) for f, a in c]
        labels = page.locator(f"{view} .ek-feat-token").evaluate_all(
            "els => els.map(el => el.textContent)"
        )
        assert labels == read["labels"] and XSS_IMG not in read["tokens"]
        assert any("<" in token for token in read["tokens"])  # markup, drawn as text

        last = len(read["chips"]) - 1
        feature = read["chips"][last][0][0]
        page.locator(f"{view} .ek-chip[data-position='{last}']").first.click()
        done = wait_for(
            lambda: (s := state()).get("selected") == feature and "activation" in s and s,
            60,
            "the selection to reach the kernel",
        )
        row = page.locator(f"{view} .ek-feat-activation .ek-feat-tok")
        wait_for(lambda: row.count() == len(read["tokens"]), 30, "the activation row")
        shown = row.evaluate_all("els => els.map(el => Number(el.dataset.act))")
        np.testing.assert_allclose(shown, done["activation"], rtol=1e-6)
        logits = page.locator(f"{view} .ek-feat-logit").evaluate_all(
            "els => els.map(el => JSON.parse(el.dataset.token))"
        )
        assert logits == [token for side in ("up", "down") for token, _ in done["logits"][side]]
        marked = page.locator(f"{view} .ek-chip.ek-chip-on")
        assert marked.count() == sum(f == feature for c in read["chips"] for f, _ in c)
        assert page.locator(f"{view} input[type='text']").input_value() == str(feature)

        page.locator(f"{view} button.widget-button", has_text="Generate clamped").click()
        done = wait_for(lambda: (s := state()).get("clamped") is not None and s, 120, "Generate")
        assert done["plain"] != done["clamped"]
        texts = page.locator(f"{view} .ek-continuation-text")
        wait_for(lambda: texts.count() == 2, 30, "both continuations")
        assert [el.text_content() for el in texts.all()] == [
            visible(done["plain"]),
            visible(done["clamped"]),
        ]
        titles = page.locator(f"{view} .ek-continuation b").all_inner_texts()
        assert titles == ["plain", f"feature {feature} clamped to 300"]
        assert "Traceback" not in page.locator(view).inner_text()
        assert_nothing_ran(page)
        assert page.locator(f"{view} img").count() == 0  # the prompt's markup shows as text
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator(view).screenshot(path=str(ARTIFACTS / "features_panel.png"))

        column = f"{view} .ek-feat-col"
        light = page.locator(column).first.evaluate("el => getComputedStyle(el).backgroundColor")
        assert css_luminance(light) > 0.8
        dark_theme(page)
        page.wait_for_function(
            "sel => { const c = getComputedStyle(document.querySelector(sel)).backgroundColor;"
            " const [r, g, b] = c.match(/\\d+/g).map(Number); return r + g + b < 300; }",
            arg=column,
            timeout=30000,
        )
        page.locator("#jupyterlab-splash").wait_for(state="detached", timeout=30000)
        token = page.locator(f"{view} .ek-feat-token").first
        assert css_luminance(token.evaluate("el => getComputedStyle(el).color")) > 0.8
        text = texts.nth(1).evaluate("el => getComputedStyle(el).color")
        assert css_luminance(text) > 0.8
        page.locator(view).screenshot(path=str(ARTIFACTS / "features_panel_dark.png"))

        page.evaluate(
            """() => {
                const panel = window.jupyterapp.shell.currentWidget;
                panel.content.activeCellIndex = panel.content.widgets.length - 1;
                window.jupyterapp.commands.execute('notebook:run-cell');
            }"""
        )
        wait_for((tmp_path / "closed").exists, 60, "the engine to close")
    except Exception:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "features_panel_failure.png"))
        raise
    finally:
        page.close()
        lab.stop()
        _, alive = psutil.wait_procs([p for p in kernel_tree if p], timeout=20)
        for process in alive:
            process.kill()
        assert not alive, "the kernel or the engine's ranks outlived the test"
