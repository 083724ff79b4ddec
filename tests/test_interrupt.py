"""The kernel's stop button during a button's long work: a real IPython kernel (ipykernel,
driven by jupyter_client as JupyterLab drives it) runs the explorer on `tiny`, a panel's
button starts its work on a thread while the kernel is idle, and the kernel is interrupted
as the stop button does. The work stops and says "interrupted", the engine serves the next
request, an interrupt with nothing in flight leaves the kernel alive, and one during a cell
is still that cell's KeyboardInterrupt."""

from __future__ import annotations

import time
from typing import Any

import pytest

SETUP = """
import envoykit as ek
from envoykit.explorer import LensExplorer
engine = ek.Engine("tiny", tensor_parallel_size=1, progress=False)
explorer = LensExplorer(engine, prompt="The capital of France is", targets=[" Paris"])
training, corpus = explorer.training_panel, explorer.corpus_panel
training.seconds.value = 600
corpus.texts.value = "\\n".join(
    f"Document {i}: the quick brown fox jumps over the lazy dog, again and again."
    for i in range(4000)
)
"""


class Kernel:
    """A fresh kernel and its client; `run` executes a cell and returns its stdout, or the
    name of the error it raised."""

    def __init__(self) -> None:
        import os

        from jupyter_client.manager import start_new_kernel

        env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
        self.manager, self.client = start_new_kernel(kernel_name="python3", env=env)

    def run(self, code: str, timeout: float = 300) -> str:
        out: list[str] = []
        errors: list[str] = []

        def keep(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                errors.append(msg["content"]["ename"])

        self.client.execute_interactive(code, timeout=timeout, output_hook=keep)
        return errors[0] if errors else "".join(out).strip()

    def until(self, code: str, expected: str, timeout: float, what: str) -> float:
        """Run ``code`` until it prints ``expected``; the seconds that took."""
        began = time.monotonic()
        while (printed := self.run(code)) != expected:
            assert time.monotonic() - began < timeout, f"{what}: {printed!r}"
            time.sleep(0.2)
        return time.monotonic() - began

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def kernel():
    kernel = Kernel()
    try:
        assert kernel.run(SETUP) == ""
        yield kernel
        assert kernel.run("engine.close()") == ""
    finally:
        kernel.close()


def interrupt_while(kernel: Kernel, panel: str, underway: str) -> str:
    """Press ``panel``'s button, wait until ``underway`` is in its header, interrupt the
    idle kernel; the header once the work has ended."""
    assert kernel.run(f"{panel}.button.click()") == ""
    kernel.until(f"print({underway!r} in {panel}.header.value)", "True", 120, "underway")
    kernel.manager.interrupt_kernel()
    kernel.until(f"print({panel}.work.busy)", "False", 60, f"{panel} to stop")
    return kernel.run(f"print({panel}.header.value)")


@pytest.mark.engine
def test_the_stop_button_stops_training_and_keeps_the_best_so_far(kernel):
    header = interrupt_while(kernel, "training", "training:")
    assert "interrupted after" in header and "Traceback" not in header
    assert kernel.run("print(training.tuned.model['stopped'])") == "True"
    assert kernel.run("print(training.button.disabled, training.cancel_button.disabled)") == (
        "False True"
    )


@pytest.mark.engine
def test_the_stop_button_stops_the_corpus_lens_and_the_engine_serves_on(kernel):
    header = interrupt_while(kernel, "corpus", "tokens")
    assert "interrupted after" in header and "the engine is free" in header
    assert kernel.run("print(corpus.result)") == "None"
    # The engine serves the next request, and the explorer's Run draws it.
    assert kernel.run("print(explorer.run().top1(-1)[-1] is not None)") == "True"
    assert kernel.run("print(explorer.status.value.startswith('logit lens'))") == "True"


@pytest.mark.engine
def test_an_interrupt_with_nothing_in_flight_or_during_a_cell_is_the_kernels(kernel):
    # Idle, nothing running: the kernel ignores it, as it always has, and stays alive.
    kernel.manager.interrupt_kernel()
    time.sleep(1)
    assert kernel.manager.is_alive() and kernel.run("print(1 + 1)") == "2"
    # During a cell: that cell's KeyboardInterrupt, not the panels'.
    kernel.client.execute("import time; time.sleep(30)")
    time.sleep(2)
    kernel.manager.interrupt_kernel()
    reply = kernel.client.get_shell_msg(timeout=20)
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    assert kernel.run("print(training.header.value.count('interrupted'))") == "1"
