"""The line a failed start quotes from the vLLM log (`envoykit.runtime.logs.root_cause`)."""

from __future__ import annotations

from envoykit.runtime.logs import root_cause

# The shape of a TP=2 start whose rank failed: the rank's traceback, then the engine core's,
# which wraps it and points back at it.
LOG = """INFO 2026-12-04 02:08:20,101 [pid 10327] vllm.config: Resolved architecture
ERROR 2026-12-04 02:08:25,412 [pid 10401] vllm.v1.executor: WorkerProc failed to start.
Traceback (most recent call last):
  File "/x/vllm/v1/executor/multiproc_executor.py", line 600, in worker_main
    worker = WorkerProc(*args, **kwargs)
             ^^^^^^^^^^^^^^^^^^^^^^^^^^^
ValueError: There is no module or parameter named 'layers.1.mlp.bogus' in LlamaModel.
ERROR 2026-12-04 02:08:25,900 [pid 10390] vllm.v1.engine.core: EngineCore failed to start.
Traceback (most recent call last):
  File "/x/vllm/v1/executor/multiproc_executor.py", line 815, in wait_for_ready
    raise e from None
Exception: WorkerProc initialization failed due to an exception in a background process. \
See stack trace for root cause.
"""


def test_the_first_exception_that_is_not_vllms_wrapper(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(LOG)
    assert root_cause(log) == (
        "ValueError: There is no module or parameter named 'layers.1.mlp.bogus' in LlamaModel."
    )


def test_a_chained_traceback_gives_its_first_cause(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(
        "Traceback (most recent call last):\n  File 'a.py', line 1, in f\n"
        "KeyError: 'layers.1.mlp.gate.e_score_correction_bias'\n\n"
        "During handling of the above exception, another exception occurred:\n\n"
        "Traceback (most recent call last):\n  File 'b.py', line 2, in g\n"
        "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert root_cause(log) == "KeyError: 'layers.1.mlp.gate.e_score_correction_bias'"


def test_no_traceback_or_no_log_is_none(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("INFO all well\nERROR a line that is no traceback's\n")
    assert root_cause(log) is None
    assert root_cause(tmp_path / "missing.log") is None
    assert root_cause(None) is None
