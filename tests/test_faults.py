"""Faults with real rank processes and real signals: nothing hangs, nothing is silently wrong."""

from __future__ import annotations

import _thread
import os
import signal
import threading
import time

import numpy as np
import psutil
import pytest
from conftest import start
from test_foundation import children

import envoykit as ek

PROMPT = "The capital of France is"


def call_with_deadline(fn, seconds: float):
    """Run ``fn`` in a thread: (result, error, elapsed), or fail if it outlives ``seconds``."""
    box: dict = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as error:
            box["error"] = error

    began = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"no answer within {seconds} s: the call hung"
    return box.get("result"), box.get("error"), time.monotonic() - began


def test_killed_rank_gives_engine_dead_then_restart_works():
    others = children()  # the session's engines have ranks too
    engine = start("tiny", 2)
    try:
        before = engine.lens(PROMPT, top_k=3)
        ranks = [
            p
            for p in psutil.Process().children(recursive=True)
            if p.pid not in others and "Worker_TP1" in p.name()
        ]
        assert len(ranks) == 1
        ranks[0].send_signal(signal.SIGKILL)
        _, error, elapsed = call_with_deadline(lambda: engine.lens(PROMPT, top_k=3), 60)
        assert isinstance(error, ek.EngineDead), error
        assert "restart" in str(error)
        assert elapsed < 30
        engine.restart()
        after = engine.lens(PROMPT, top_k=3)
        np.testing.assert_array_equal(after.top_ids, before.top_ids)
    finally:
        engine.close()


def test_two_threads_are_served_one_after_the_other(tiny2):
    prompts = ["The cat sat on the mat", "One two three four five six"]
    expected = [tiny2.lens(p, top_k=3) for p in prompts]
    results: dict[int, ek.LensResult] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, tiny2.lens(prompts[i], top_k=3)))
        for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for i in range(2):
        np.testing.assert_array_equal(results[i].top_ids, expected[i].top_ids)
        np.testing.assert_allclose(results[i].top_probs, expected[i].top_probs, atol=1e-6)


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


def test_repeated_open_close_leaks_nothing():
    """Two open/close cycles (more run in bench/soak.py): no process, file or thread left."""
    me = psutil.Process()
    children_before = children()
    shm_before = set(os.listdir("/dev/shm"))
    threads_before = threading.active_count()
    rss = []
    for _ in range(2):
        with start("tiny", 2) as engine:
            engine.lens(PROMPT, top_k=2)
        rss.append(me.memory_info().rss)
        assert children() == children_before
        assert set(os.listdir("/dev/shm")) - shm_before == set()
    assert threading.active_count() <= threads_before + 1
    assert rss[-1] <= rss[0] * 1.10, [r // 2**20 for r in rss]
