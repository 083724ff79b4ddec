"""A notebook shows the engine's progress bar and its one summary line, nothing else.

What used to reach a notebook's stderr on every start and close: torch's "Triton not
available" line from every process, every rank's "Loading safetensors checkpoint shards" bar,
and tracebacks from Python's resource tracker when ``close()`` unregistered segments it had
no record of. The kernel test runs the real thing in a fresh Jupyter kernel; the notebook
test reads the outputs stored in ``notebooks/`` (what a reader of the repository sees).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The engine's own progress bar (tqdm writes it to stderr where it cannot draw a widget):
# "<model>: preparing", "<model>: starting N rank(s)", "<model>: ready".
PROGRESS = re.compile(r"^[\w.-]+: (preparing|starting \d+ rank\(s\)|ready)\b")
NOISE = re.compile(r"Traceback|Error\b|Warning\b|WARNING|^[WEF]\d{4} ", re.MULTILINE)


def unexpected_stderr(text: str) -> list[str]:
    """The lines of ``text`` (stderr) that are not the engine's progress bar."""
    pieces = re.split(r"[\r\n]+", text)
    return [piece for piece in pieces if piece.strip() and not PROGRESS.match(piece)]


@pytest.mark.engine
def test_kernel_start_lens_close_writes_only_the_progress_bar():
    """A fresh kernel starts a two-rank engine, runs a lens and closes it: stderr holds only
    the progress bar, stdout only the summary line, and nothing arrives after the close."""
    from jupyter_client.manager import start_new_kernel

    # Under pytest (PYTEST_CURRENT_TEST set) ipykernel does not forward what subprocesses
    # write to the kernel's stderr; a notebook's kernel does, and so must this one.
    env = {key: value for key, value in os.environ.items() if key != "PYTEST_CURRENT_TEST"}
    manager, client = start_new_kernel(kernel_name="python3", env=env)
    streams: dict[str, list[str]] = {"stdout": [], "stderr": []}
    errors: list[str] = []

    def keep(msg: dict) -> None:
        if msg["msg_type"] == "stream":
            streams[msg["content"]["name"]].append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            errors.append(f"{msg['content']['ename']}: {msg['content']['evalue']}")

    cells = [
        "import envoykit as ek\nengine = ek.Engine('tiny', tensor_parallel_size=2)",
        "top = engine.lens('The capital of France is', top_k=3).top1(-1)[-1]",
        "engine.close()",
        # The resource tracker and the ranks write from their own processes: give anything
        # they had to say time to arrive.
        "import time; time.sleep(3)",
    ]
    try:
        for cell in cells:
            reply = client.execute_interactive(cell, timeout=300, output_hook=keep)
            assert reply["content"]["status"] == "ok", errors
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    assert errors == []
    assert unexpected_stderr("".join(streams["stderr"])) == []
    (summary,) = "".join(streams["stdout"]).splitlines()
    assert summary.startswith("envoykit: tiny on 2 cpu rank(s)"), summary


NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.name)
def test_stored_notebook_outputs_hold_no_traceback_or_warning(notebook: Path):
    found = []
    for number, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        for output in cell.get("outputs", []):
            if output["output_type"] == "error":
                found.append((number, output["ename"]))
            elif output["output_type"] == "stream":
                text = "".join(output["text"])
                if output["name"] == "stderr":
                    found += [(number, line) for line in unexpected_stderr(text)]
                found += [(number, line) for line in text.splitlines() if NOISE.search(line)]
    assert found == []


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda path: path.name)
def test_stored_progress_bars_are_stored_finished(notebook: Path):
    """A bar's plain-text form is what a reader without the widget state sees: never the bar
    as first drawn, at 0%, beside the finished result (`notebooks/resave.py` stores each
    bar's last state)."""
    frozen = []
    for number, cell in enumerate(json.loads(notebook.read_text())["cells"]):
        for output in cell.get("outputs", []):
            text = "".join(output.get("data", {}).get("text/plain", ""))
            if re.search(r"(?<!\d)0%\|", text):
                frozen.append((number, text))
    assert frozen == []


SEGMENT_SCRIPT = """
import multiprocessing, os
from multiprocessing import shared_memory
from envoykit.runtime import cleanup

def make_and_die(conn):
    segment = shared_memory.SharedMemory(create=True, size=4096)  # registered with the tracker
    conn.send(segment.name.lstrip("/"))
    os._exit(0)  # killed before it could unlink it

if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    maker = context.Process(target=make_and_die, args=(theirs,))
    maker.start()
    python_made = mine.recv()
    maker.join()
    # vLLM's CPU all-reduce buffers are made by C++ (never registered) and have ':' in names
    cpp_made = "envoykit-test-{unique}-tp:0-[0-1]-cpushm_0"
    open(os.path.join(cleanup.SHM, cpp_made), "w").close()
    for name in (python_made, cpp_made, python_made):  # the last: gone already
        cleanup.unlink_segment(name)
    assert not any(os.path.exists(os.path.join(cleanup.SHM, n)) for n in (python_made, cpp_made))
"""


def test_unlinking_left_segments_keeps_the_resource_tracker_quiet(tmp_path):
    """Segments a killed rank left behind are unlinked, and the resource tracker has nothing
    to say then or at exit: no KeyError for a name it does not hold, no ValueError for a name
    with ':' that was never Python's, no leak warning for the one it does hold."""
    script = tmp_path / "segments.py"  # a file: spawn re-imports the maker from it
    script.write_text(SEGMENT_SCRIPT.replace("{unique}", str(time.monotonic_ns())))
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
