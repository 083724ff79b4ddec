"""Faults with real rank processes and real signals: nothing hangs, nothing is silently wrong."""

from __future__ import annotations

import _thread
import os
import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import rank_processes, start

import envoykit as ek

pytestmark = pytest.mark.engine

PROMPT = "The capital of France is"


def call_in_thread(fn) -> tuple[threading.Thread, dict]:
    """Start ``fn`` in a thread; its result or error lands in the returned dict."""
    box: dict = {"began": time.monotonic()}

    def target():
        try:
            box["result"] = fn()
        except BaseException as error:
            box["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def finish(thread: threading.Thread, box: dict, seconds: float):
    """(result, error, seconds since the call began), or fail if it outlives ``seconds``."""
    thread.join(seconds)
    assert not thread.is_alive(), f"no answer within {seconds} s: the call hung"
    return box.get("result"), box.get("error"), time.monotonic() - box["began"]


def call_with_deadline(fn, seconds: float):
    return finish(*call_in_thread(fn), seconds)


def rank(engine: ek.Engine, number: int) -> psutil.Process:
    (found,) = [p for p in engine.processes if f"Worker_TP{number}" in p.name()]
    return found


def test_killed_rank_gives_engine_dead_then_restart_works():
    """Rank 0 killed during a lens, then rank 1 killed while idle: each time `EngineDead`
    within 30 s of the kill; after the first, `restart()` gives the lens it gave before.
    The lenses before the first kill run back to back: one 200-token lens of ``tiny`` at
    TP=2 takes 0.6-0.8 s here, so a single one may end before the kill."""
    engine = start("tiny", 2)
    try:
        before = engine.lens(PROMPT, top_k=3)

        def lenses():  # one after the other until one fails: the kill lands in a lens
            while True:
                engine.lens(PROMPT, generate=200, top_k=3)

        thread, box = call_in_thread(lenses)
        time.sleep(1.0)
        assert thread.is_alive(), f"the lenses stopped before the kill: {box.get('error')!r}"
        killed = time.monotonic()
        rank(engine, 0).send_signal(signal.SIGKILL)
        _, error, _ = finish(thread, box, 60)
        assert isinstance(error, ek.EngineDead), error
        assert time.monotonic() - killed < 30
        engine.restart()
        np.testing.assert_array_equal(engine.lens(PROMPT, top_k=3).top_ids, before.top_ids)

        rank(engine, 1).send_signal(signal.SIGKILL)
        _, error, elapsed = call_with_deadline(lambda: engine.lens(PROMPT, top_k=3), 60)
        assert isinstance(error, ek.EngineDead), error
        assert "restart" in str(error)
        assert elapsed < 30
        assert engine.closed and engine.processes == []
    finally:
        engine.close()


def test_two_threads_are_served_one_after_the_other(tiny2, monkeypatch):
    """Two threads call `lens` at the same moment: the engine serves one request, then the
    other. The intervals in which vLLM runs them do not overlap although the second call was
    made while the first was running, and each thread gets the lens it gets alone."""
    prompts = ["The cat sat on the mat", "One two three four five six"]
    lens = [lambda p=p: tiny2.lens(p, top_k=3, generate=20) for p in prompts]
    expected = [run() for run in lens]
    llm = tiny2.model.vllm_entrypoint
    generate = llm.generate
    served: list[tuple[float, float]] = []  # (start, end) of each run of the engine

    def timed_generate(*args, **kwargs):
        start = time.monotonic()
        try:
            return generate(*args, **kwargs)
        finally:
            served.append((start, time.monotonic()))

    monkeypatch.setattr(llm, "generate", timed_generate)
    barrier = threading.Barrier(2)
    called: list[float] = []

    def at_once(run):
        barrier.wait()
        called.append(time.monotonic())
        return run()

    calls = [call_in_thread(lambda run=run: at_once(run)) for run in lens]
    for (thread, box), want in zip(calls, expected):
        result, error, _ = finish(thread, box, 120)
        assert error is None, error
        np.testing.assert_array_equal(result.top_ids, want.top_ids)
        np.testing.assert_allclose(result.top_probs, want.top_probs, rtol=0, atol=1e-6)
    assert len(served) == 2, served
    first, second = sorted(served)
    assert max(called) < first[1], "the calls did not overlap: nothing was left to serialise"
    assert first[1] <= second[0], f"the engine ran both requests at once: {served}"


def test_interrupt_during_lens_leaves_engine_usable(tiny2):
    expected = tiny2.lens(PROMPT, top_k=3)
    # A kernel's interrupt is SIGINT's default handler raising KeyboardInterrupt; other
    # libraries in this process (the browser driver) may have installed their own.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.3, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in range(200):  # long enough that the interrupt lands inside a request
                tiny2.lens(PROMPT, generate=20, top_k=3)
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    result, error, _ = call_with_deadline(lambda: tiny2.lens(PROMPT, top_k=3), 60)
    assert error is None, error
    np.testing.assert_array_equal(result.top_ids, expected.top_ids)


LONG = "The capital of France is " * 32  # about 225 of the tiny model's 256 positions


def lens_cancelled_at_once(engine, prompt: str) -> BaseException | None:
    """Start a lens of ``prompt`` on a thread, cancel it as soon as it has a key, and return
    what the thread raised."""
    thread, box = call_in_thread(lambda: engine.lens(prompt, top_k=3))
    while engine._lens_in_flight is None and thread.is_alive():
        time.sleep(0.001)
    assert engine.cancel()
    thread.join(120)
    assert not thread.is_alive()
    return box.get("error")


def test_cancel_stops_a_lens_on_the_ranks_and_the_engine_answers(tiny_engines):
    """engine.cancel() from another thread: the lens raises ek.Cancelled (every rank stopped
    at the same chunk: none is left waiting in an exchange), no flag is left behind, and
    the next lens equals one run before."""
    for engine in tiny_engines.values():
        expected = engine.lens(PROMPT, top_k=3)
        assert not engine.cancel()  # nothing in flight: nothing to stop
        error = lens_cancelled_at_once(engine, LONG)
        assert isinstance(error, ek.Cancelled), error
        assert "cancelled" in str(error) and "Traceback" not in str(error)
        assert not [n for n in os.listdir(engine.scratch) if n.startswith("envoykit-cancel-")]
        result, error, _ = call_with_deadline(lambda e=engine: e.lens(PROMPT, top_k=3), 60)
        assert error is None, error
        np.testing.assert_array_equal(result.top_ids, expected.top_ids)
        np.testing.assert_allclose(result.top_probs, expected.top_probs, atol=1e-6)
        assert engine.lens(LONG, top_k=3).top_ids.shape[1] > 100  # not cancelled again


def test_interrupt_during_sweep_leaves_engine_usable(tiny2):
    """Ctrl-C during a causal-tracing sweep stops it and the engine serves the next sweep."""
    sweep = lambda: tiny2.patch_sweep(  # noqa: E731
        PROMPT, "The capital of Italy is", target_token=5, batch=1, progress=False
    )
    expected = sweep()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in range(50):  # a sweep of 35 one-cell batches, many times over
                sweep()
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    result, error, _ = call_with_deadline(sweep, 120)
    assert error is None, error
    np.testing.assert_array_equal(result.values, expected.values)


def peak_rss_since_reset(process: psutil.Process) -> int:
    status = Path(f"/proc/{process.pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


@pytest.mark.slow
def test_lens_beyond_memory_is_chunked(demo3):
    """Unchunked, this lens's full-vocab temporaries (logits, log-probs, scratch) would take
    gigabytes on every rank (over 8 budgets); chunked, they fit the budget. A rank's first
    long lens still raises its peak by 2.6-3.0 budgets (656-769 MiB measured): ranks keep
    freed memory in the heap (``MALLOC_MMAP_MAX_=0``), where the forward's and the lens's
    allocations cannot all reuse each other's space; a rank that has served a lens once
    needs almost nothing more for it (`test_ranks_reuse_their_working_memory`)."""
    from envoykit.analyses.lens import DEFAULT_MEMORY_BUDGET

    prompt = " ".join(["The capital of France is Paris, and the capital of Italy is Rome."] * 10)
    info = demo3.info
    n_pos = len(demo3.tokenizer(prompt).input_ids)
    unchunked = info.n_layers * n_pos * info.vocab * 4 * 3
    assert unchunked > 8 * DEFAULT_MEMORY_BUDGET  # the lens is far beyond the budget
    ranks = rank_processes(demo3)
    assert len(ranks) == 3
    for process in ranks:  # "5" resets the peak resident set to the current one
        Path(f"/proc/{process.pid}/clear_refs").write_text("5")
    resident = {process.pid: process.memory_info().rss for process in ranks}
    res = demo3.lens(prompt, top_k=5)
    growth = max(peak_rss_since_reset(p) - resident[p.pid] for p in ranks)
    assert res.top_probs.shape == (info.n_layers, n_pos, 5)
    assert np.isfinite(res.kl).all() and np.all(res.kl >= 0)
    assert growth < 4 * DEFAULT_MEMORY_BUDGET, (growth >> 20, unchunked >> 20)


@pytest.mark.slow
def test_ranks_reuse_their_working_memory(demo3):
    """A rank keeps the memory a lens freed for the next call (``MALLOC_MMAP_MAX_=0``, see
    `envoykit.runtime.platform`): the same lens again needs no memory the rank does not already
    hold. With glibc's default, the logits of this lens (over 32 MiB per rank) were unmapped at
    free and mapped afresh each call, and each call's peak rose ~177 MiB above its start.
    Measured after two calls: in a fresh rank the second call's forward pass lands in part
    of the space the first call's lens freed, and its lens then raises the peak once more
    (by 42-85 MiB here); from the third call on it rises by 0-1 MiB."""
    prompt = " ".join(["The capital of France is Paris."] * 8)
    ranks = rank_processes(demo3)
    info = demo3.info
    n_pos = len(demo3.tokenizer(prompt).input_ids)
    assert (info.n_layers + 1) * n_pos * (info.vocab // 3) * 4 > 64 * 2**20  # past glibc's mmap
    first = demo3.lens(prompt, top_k=3)
    demo3.lens(prompt, top_k=3)
    for process in ranks:
        Path(f"/proc/{process.pid}/clear_refs").write_text("5")
    resident = {process.pid: process.memory_info().rss for process in ranks}
    again = demo3.lens(prompt, top_k=3)
    growth = max(peak_rss_since_reset(p) - resident[p.pid] for p in ranks)
    np.testing.assert_array_equal(again.top_ids, first.top_ids)
    assert growth < 16 * 2**20, growth >> 20
