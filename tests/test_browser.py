"""The widgets in a real browser: JupyterLab + Debian's chromium, driven by Playwright.

One test runs `LensExplorer` on a 2-rank ``tiny`` engine inside a JupyterLab kernel and
checks, against the values the kernel itself holds, that the tooltip shows the cell's top-k,
that a click reaches the kernel as a selection and that pinning a token re-runs the lens and
redraws the trajectory. The other opens the standalone HTML export with no kernel at all.
Screenshots land in ``artifacts/``.
"""

from __future__ import annotations

import json
import os
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

import envoykit as ek
from envoykit.explorer import LensExplorer

CHROMIUM = "/usr/bin/chromium"
ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"
NOTEBOOK = Path(__file__).parent / "browser" / "explorer.ipynb"

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


def hover_cell(page: Any, layer: int, position: int) -> dict[str, Any]:
    """Move the mouse over a heatmap cell; the tooltip's rows as the page shows them."""
    heatmap = page.locator(".ek-heatmap")
    heatmap.evaluate("root => root.scrollIntoView({block: 'center'})")
    point = heatmap.evaluate("(root, [l, p]) => root.ekCellCenter(l, p)", [layer, position])
    page.mouse.move(point["x"], point["y"])
    tip = page.locator(".ek-tooltip")
    tip.wait_for(state="visible", timeout=5000)
    assert tip.get_attribute("data-layer") == str(layer)
    assert tip.get_attribute("data-position") == str(position)
    rows = tip.locator(".ek-token").evaluate_all(
        "buttons => buttons.map(b => ({id: Number(b.dataset.id),"
        " token: decodeURIComponent(b.dataset.token), prob: Number(b.dataset.prob)}))"
    )
    return {"point": point, "rows": rows}


def assert_tooltip_matches(rows: list[dict], ids: list, tokens: list, probs: list) -> None:
    assert [r["id"] for r in rows] == ids
    assert [r["token"] for r in rows] == tokens
    np.testing.assert_allclose([r["prob"] for r in rows], probs, atol=1e-6)


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
        page.locator(".ek-tooltip .ek-token").first.click()
        assert page.evaluate("window.ekModel.get('pinned')") == [
            int(res.top_ids[layer, position, 0])
        ]
        page.select_option("#ek-metric", "kl")
        assert page.evaluate("window.ekModel.get('metric')") == "kl"
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / f"standalone_{shape[0]}x{shape[1]}.png"))
    finally:
        page.close()
    print(f"standalone {shape}: {time.monotonic() - started:.1f} s")


# -- JupyterLab with a real 2-rank engine in the kernel -------------------------------------


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
    kernel_tree: list[psutil.Process] = []
    try:
        timings["lab"] = time.monotonic() - started
        page.goto(lab.url("explorer.ipynb"))
        page.wait_for_function(
            "() => window.jupyterapp?.shell.currentWidget?.sessionContext?.session?.kernel",
            timeout=60000,
        )
        # Every cell but the last, which closes the engine at the end of the test.
        page.evaluate(
            """async () => {
                const panel = window.jupyterapp.shell.currentWidget;
                await panel.sessionContext.ready;
                panel.content.activeCellIndex = panel.content.widgets.length - 1;
                window.jupyterapp.commands.execute('notebook:run-all-above');
            }"""
        )
        run_button = page.locator("button.widget-button", has_text="Run")
        run_button.wait_for(timeout=240000)
        kernel_tree = [_process(wait_for(lambda: state().get("pid"), 30, "the kernel state"))]
        kernel_tree += _children(kernel_tree[0].pid)
        timings["notebook + engine"] = time.monotonic() - started - timings["lab"]

        t = time.monotonic()
        run_button.click()
        wait_for(lambda: state().get("result"), 120, "the lens result in the kernel")
        page.wait_for_selector(".ek-heatmap[data-drawn]", timeout=30000)
        # Enabled again means the kernel has finished the whole Run (result, heatmap, plot).
        wait_for(run_button.is_enabled, 60, "the Run button to come back")
        timings["run"] = time.monotonic() - t

        t = time.monotonic()
        res = state()["result"]
        layer, position = len(res["layer_labels"]) - 1, len(res["top_ids"][0]) - 1
        tip = hover_cell(page, layer, position)
        assert_tooltip_matches(
            tip["rows"],
            res["top_ids"][layer][position],
            res["top_tokens"][layer][position],
            res["top_probs"][layer][position],
        )

        page.mouse.click(tip["point"]["x"], tip["point"]["y"])
        wait_for(lambda: state().get("selected") == [layer, position], 30, "the selection")
        before = page.evaluate("() => document.querySelector('.widget-output img').src")

        new_id = next(r["id"] for r in tip["rows"] if r["id"] not in res["target_ids"])
        page.locator(f'.ek-tooltip .ek-token[data-id="{new_id}"]').click()
        pinned = wait_for(
            lambda: (s := state()) and str(new_id) in s.get("trajectory", []) and s,
            120,
            "the pinned token's trajectory",
        )
        assert pinned["pinned"] == [new_id]
        assert new_id in pinned["result"]["target_ids"]
        assert pinned["selected"] == [layer, position]
        page.wait_for_function(
            "before => document.querySelector('.widget-output img')?.src !== before",
            arg=before,
            timeout=30000,
        )
        timings["hover + select + pin"] = time.monotonic() - t

        page.locator(".widget-textarea textarea").evaluate(
            "el => el.scrollIntoView({block: 'start'})"
        )
        hover_cell(page, layer, position)
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "explorer_jupyterlab.png"), full_page=True)

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
    except Exception:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "explorer_jupyterlab_failure.png"))
        (ARTIFACTS / "explorer_jupyterlab_failure.json").write_text(json.dumps(state()))
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
