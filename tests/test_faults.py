"""Faults with real rank processes and real signals: nothing hangs, nothing is silently wrong."""

from __future__ import annotations

import _thread
import contextlib
import itertools
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


@pytest.fixture(autouse=True)
def nothing_left_in_shared_memory():
    """No fault leaves a segment in /dev/shm: the engines shared by tests start before this
    (a session's fixtures come first), so what a test adds is what its own engines, killed
    or closed, left behind."""
    before = set(os.listdir("/dev/shm"))
    yield
    assert set(os.listdir("/dev/shm")) <= before


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


def rank(engine: ek.Engine, number: int | str) -> psutil.Process:
    """Rank ``number``'s process (vLLM names it "VLLM::Worker_TP<n>", and "VLLM::Worker"
    at TP=1), or with "core" the engine core's."""
    name = "VLLM::Worker" if engine.info.tp == 1 else f"VLLM::Worker_TP{number}"
    name = "VLLM::EngineCore" if number == "core" else name
    (found,) = [p for p in engine.processes if p.name() == name]
    return found


# What the engine is doing when a rank is killed: each runs until it fails.
ACTIVITIES = {
    "idle": None,
    "lens": lambda engine, _: engine.lens(PROMPT, generate=200, top_k=3),
    "generation": lambda engine, _: engine.generate(PROMPT, max_tokens=200),
    "collect": lambda engine, out: engine.collect(
        ek.shipped_corpus() * 4, out=out, layers=[1], progress=False
    ),
}


def seconds_to_engine_dead(engine: ek.Engine, activity: str, victim: int | str, out: Path) -> float:
    """Kill rank ``victim`` while the engine does ``activity``; the seconds from the kill to
    the `EngineDead` the caller gets (idle: that of the next lens)."""
    work = ACTIVITIES[activity]
    if work is None:
        killed = time.monotonic()
        rank(engine, victim).send_signal(signal.SIGKILL)
        time.sleep(0.5)  # the death lands while nothing runs
        _, error, _ = call_with_deadline(lambda: engine.lens(PROMPT, top_k=3), 60)
    else:

        def again():  # one after the other until one fails: the kill lands in one
            for turn in itertools.count():
                work(engine, out / str(turn))

        thread, box = call_in_thread(again)
        time.sleep(1.0)
        assert thread.is_alive(), f"{activity} stopped before the kill: {box.get('error')!r}"
        killed = time.monotonic()
        rank(engine, victim).send_signal(signal.SIGKILL)
        _, error, _ = finish(thread, box, 60)
    took = time.monotonic() - killed
    assert isinstance(error, ek.EngineDead), (activity, error)
    assert "restart" in str(error)
    assert engine.closed and engine.processes == []
    return took


@pytest.mark.parametrize("tp", [1, 2])
def test_killed_rank_gives_engine_dead_within_3_s_then_restart_works(tp, tmp_path):
    """A rank killed while the engine is idle, in a lens, in a generation and in a collect,
    and the engine core killed in a lens: each time `EngineDead` within 3 s of the kill
    (vLLM alone took 10.5 s for a rank at TP=2, and never answered the lens whose core was
    killed: `envoykit.runtime.rank_watch`), and `restart()` gives the lens it gave before.
    Idle, the death is reported by the next request."""
    engine = start("tiny", tp)
    try:
        before = engine.lens(PROMPT, top_k=3)
        kills = [(activity, turn % tp) for turn, activity in enumerate(ACTIVITIES)]
        took = {}
        for activity, victim in [*kills, ("lens", "core")]:
            took[activity, victim] = seconds_to_engine_dead(engine, activity, victim, tmp_path)
            engine.restart()
            np.testing.assert_array_equal(engine.lens(PROMPT, top_k=3).top_ids, before.top_ids)
        assert max(took.values()) < 3, took
    finally:
        engine.close()


@pytest.mark.slow
def test_killed_rank_at_tp3_gives_engine_dead_within_3_s():
    """The same at TP=3 (demo), killing the middle rank during a lens."""
    engine = start("demo", 3)
    try:
        took = seconds_to_engine_dead(engine, "lens", 1, Path("unused"))
        assert took < 3, took
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


def cancel_when_started(engine, thread: threading.Thread) -> str:
    """Cancel the lens ``thread`` runs as soon as it has a key; the key."""
    while thread.is_alive():
        key = engine.cancel(thread)
        if key:
            assert re.fullmatch("[0-9a-f]{32}", key), key
            return key
        time.sleep(0.001)
    raise AssertionError("the lens ended before it could be cancelled")


def lens_cancelled_at_once(engine, prompt: str) -> BaseException | None:
    """Start a lens of ``prompt`` on a thread, cancel it as soon as it has a key, and return
    what the thread raised."""
    thread, box = call_in_thread(lambda: engine.lens(prompt, top_k=3))
    cancel_when_started(engine, thread)
    thread.join(120)
    assert not thread.is_alive()
    return box.get("error")


def test_cancel_stops_the_lens_of_the_thread_it_names(tiny2):
    """Two threads' lenses at once: cancelling the second's stops that one only, whether
    it was on the ranks or waiting for them; the first returns the lens of a quiet engine.
    Then a cancel without a thread stops the one lens in flight and names its key."""
    expected = tiny2.lens(LONG, top_k=3)
    first, first_box = call_in_thread(lambda: tiny2.lens(LONG, top_k=3))
    second, second_box = call_in_thread(lambda: tiny2.lens(LONG, top_k=3))
    key = cancel_when_started(tiny2, second)
    first.join(120)
    second.join(120)
    assert isinstance(second_box.get("error"), ek.Cancelled), second_box
    assert first_box.get("error") is None, first_box
    np.testing.assert_array_equal(first_box["result"].top_ids, expected.top_ids)
    np.testing.assert_allclose(first_box["result"].top_probs, expected.top_probs, atol=1e-6)
    assert tiny2.cancel(first) is None and tiny2.cancel() is None  # both have ended

    only, box = call_in_thread(lambda: tiny2.lens(LONG, top_k=3))
    while only.is_alive() and not (stopped := tiny2.cancel()):
        time.sleep(0.001)
    only.join(120)
    assert isinstance(box.get("error"), ek.Cancelled), box
    assert re.fullmatch("[0-9a-f]{32}", stopped) and stopped != key, (stopped, key)


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


def test_cancel_stops_the_corpus_lens_inside_its_batch(tiny2):
    """engine.cancel(thread) stops a corpus lens on the ranks inside the batch in flight (one
    batch of the whole corpus here, so a stop between batches could not be it): it raises
    ek.Cancelled naming the corpus lens, leaves no flag, and the next corpus lens equals one
    run before."""
    texts = [f"Document {i}: the quick brown fox jumps over the lazy dog." for i in range(300)]
    expected = tiny2.lens_corpus(texts[:20], progress=False)
    thread, box = call_in_thread(
        lambda: tiny2.lens_corpus(texts, batch_tokens=10**6, progress=False)
    )
    cancel_when_started(tiny2, thread)
    thread.join(120)
    assert not thread.is_alive()
    error = box.get("error")
    assert isinstance(error, ek.Cancelled) and "the corpus lens was cancelled" in str(error), box
    assert not [n for n in os.listdir(tiny2.scratch) if n.startswith("envoykit-cancel-")]
    again = tiny2.lens_corpus(texts[:20], progress=False)
    np.testing.assert_array_equal(again.document_sums, expected.document_sums)


@pytest.mark.parametrize("steered", [False, True], ids=["plain", "steered"])
def test_cancel_stops_a_generation_on_the_ranks(tiny2, steered):
    """engine.cancel(thread) stops a long greedy generation between two steps: a steered
    one, and a plain one in a trace (``cancellable=True``, which a plain vLLM request is
    not); it raises ek.Cancelled, leaves no flag, and the next generation is as before,
    with the plain one in a trace giving vLLM's own ids."""
    steer = ek.Steer(np.ones(tiny2.info.d_model, dtype=np.float32), 1, scale=0.5)
    options = {"steer": steer} if steered else {"cancellable": True}
    expected = tiny2.generate(PROMPT, 8, **options)
    if not steered:
        assert expected.token_ids == tiny2.generate(PROMPT, 8).token_ids
    thread, box = call_in_thread(lambda: tiny2.generate(PROMPT, 240, **options))
    cancel_when_started(tiny2, thread)
    thread.join(120)
    assert not thread.is_alive()
    error = box.get("error")
    assert isinstance(error, ek.Cancelled), box
    assert "the steered generation was cancelled" in str(error)
    assert not [n for n in os.listdir(tiny2.scratch) if n.startswith("envoykit-cancel-")]
    assert tiny2.generate(PROMPT, 8, **options).token_ids == expected.token_ids


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
    from envoykit.ranks.lens import DEFAULT_MEMORY_BUDGET

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


def vllm_processes() -> list[psutil.Process]:
    """This process's descendants that vLLM started (it names them "VLLM::...")."""
    found = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if process.name().startswith("VLLM::"):
                found.append(process)
    return found


def test_a_start_vllm_gives_up_on_says_why_and_leaves_nothing(tmp_path):
    """A checkpoint with a weight the model does not have: the rank's error is in the vLLM
    log, and vLLM's client raises only "Engine core initialization failed. See root cause
    above". The start's `EngineDead` names the rank's line and the log, its progress bar is
    closed, and no process of the engine is left."""
    from safetensors.torch import load_file, save_file
    from tqdm import tqdm

    from envoykit.runtime import architectures

    architectures.build("llama", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    renamed = next(name for name in weights if "layers.1.mlp" in name)
    weights["model.layers.1.mlp.bogus.weight"] = weights.pop(renamed)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    others = set(vllm_processes())  # other tests' engines, alive meanwhile
    with pytest.raises(ek.EngineDead) as caught:
        ek.Engine(str(tmp_path), tensor_parallel_size=2, progress=True)
    message = str(caught.value)
    assert "did not start" in message and "See root cause" not in message, message
    assert "ValueError: There is no module or parameter named 'layers.1.mlp.bogus'" in message
    log = re.search(r"the vLLM log (\S+\.log)", message).group(1)
    assert "layers.1.mlp.bogus" in Path(log).read_text()
    assert not [bar for bar in tqdm._instances if tmp_path.name in str(bar.desc)]
    # (the fork server, its resource tracker and their janitor serve every engine start)
    assert set(vllm_processes()) <= others
