"""Start vLLM's engine core by forking a process that has imported vLLM already.

Spawned, an engine core starts a fresh interpreter and imports torch, vLLM, nnsight and
envoykit's worker: 6.6 s of a 20 s start of ``demo`` at TP=1 on two cores, paid after the
owner's own imports of the same modules. Python's fork server (``multiprocessing.forkserver``)
is one process per owner that imports them once (`PRELOAD`) and forks each engine core from
there. On the CPU it starts as the owner first looks up ``envoykit.Engine`` (`start_early`),
before the owner imports torch, so its imports run beside the owner's on another core, and
every later engine of the same owner (a restart, the next test) forks its core at once
(elsewhere an engine starts it first thing, `start`); ``ENVOYKIT_FORK_CORE=0`` spawns the core
as vLLM does. Like Python's resource tracker the server lives as long as its owner: it exits
when the owner does, a janitor removes its socket's directory after a killed owner, and
`envoykit.runtime.cleanup` leaves both alone. Its preload list is the process's one: an
owner that uses the fork server for its own work gets these imports too.

Forking the owner itself would be quicker still, but an owner is a Jupyter kernel: threads,
sockets, shared memory of the user's, and GNU OpenMP's thread pool, which does not survive
a fork (after the owner has run a parallel torch op, the child's next one waits forever).
The fork server is a clean interpreter that has run no torch op.

A forked core starts with the fork server's state, so it takes over what the owner would
have handed a spawned core (`_EngineCore.run`): the owner's environment as the engine was
started, vLLM's logging config for this engine (vLLM reads it when it is imported), the
signal at its parent's death against the fork server, and a collection before it exits
(a forked process leaves with ``os._exit``; see `envoykit.runtime.lifeline`), the only one
of its teardown (`_cleanup_without_collection`).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing.context
import multiprocessing.util
import os
import tempfile
from collections.abc import Iterator
from multiprocessing import forkserver
from typing import Any

from envoykit import _compat as compat
from envoykit.model.loader_calls import no_collections
from envoykit.runtime import lifeline, logs
from envoykit.runtime.janitor import Janitor

# "0" spawns engine cores as vLLM does; unset or "1", they are forked from the fork server.
FORK_CORE = "ENVOYKIT_FORK_CORE"
# What an engine core imports before it reads its config: vLLM's engine core and executor,
# through the worker module torch, nnsight and the model's vLLM classes, and the analyses whose
# code the owner's requests send to the ranks (`envoykit.engine` imports them all; the package
# itself imports nothing); first, torch and the engine's logging config
# (`envoykit.runtime.preload`); last, a freeze of the heap they built, which the forked
# processes' collections then skip (`envoykit.runtime.preloaded`).
PRELOAD = [
    "envoykit.runtime.preload",
    "vllm.v1.engine.core",
    "vllm.v1.executor.multiproc_executor",
    "envoykit.ranks.cpu",
    "envoykit.engine",
    "envoykit.runtime.preloaded",
]


def enabled() -> bool:
    """Not turned off in this process's environment (read at each start, so a test or a
    user can spawn one engine's core and fork the next one's)."""
    return os.environ.get(FORK_CORE, "1") != "0"


def start() -> None:
    """Start this process's fork server in the current environment, unless it runs.

    Returns at once; the server imports `PRELOAD` in the background and serves the first
    fork when it is done. The environment is the one its children's memory settings come
    from (glibc reads ``MALLOC_*`` when a process starts, see
    `envoykit.runtime.platform.rank_environment`); everything else a core reads is the owner's
    environment at the time the core is made.
    """
    forkserver.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    _watch_server()


def start_early() -> None:
    """Start the fork server before this process's own imports, when an engine is wanted.

    The first lookup of ``envoykit.Engine`` calls this (the package imports lazily, see
    `envoykit`): the server's 6 s of imports then run beside the owner's torch, nnsight and
    vLLM rather than after the first 1.6 s of them, and the engine core that `Engine` forks
    is ready that much sooner. Only where an engine will fork its core and that is known
    without importing torch: a CPU-only torch build, outside an engine's own processes
    (which import envoykit too). Elsewhere `Engine` starts the server itself, as before.
    The server's environment is an engine's: every variable of
    `envoykit.runtime.platform.rank_environment` that a process reads as it starts is the
    same for any number of ranks, and each core takes the owner's environment of its own
    engine when it is forked. vLLM's notes as the server imports it go to a log file in the
    engines' log directory, not to the screen.
    """
    from envoykit.runtime import models, platform
    from envoykit_vllm_plugin import ENGINE

    if not enabled() or ENGINE in os.environ or not _cpu_only_torch():
        return
    _log_file, log_env = logs.configure(models.cache_dir() / "logs", "ERROR")
    env = {**platform.rank_environment("cpu", 1), **log_env, ENGINE: "1"}
    with platform.environment(env, forced={}):
        start()


def _cpu_only_torch() -> bool:
    """Whether the installed torch is a CPU-only build (its version's local part, as the
    wheels of download.pytorch.org name it), read without importing torch."""
    from importlib import metadata

    try:
        return metadata.version("torch").endswith("+cpu")
    except metadata.PackageNotFoundError:
        return False


def running() -> list[int]:
    """The processes this process's fork server keeps for the owner's life: the server and
    its janitor (`_watch_server`); empty if no server was started."""
    return [] if _watched is None else [_watched[0], _watched[1].pid]


def _server_pid() -> int | None:
    """The process id of this process's fork server (Python's own record of it)."""
    return compat.forkserver_pid()


# The fork server (its process id) and the janitor that cleans up after it.
_watched: tuple[int, Janitor] | None = None


def _watch_server() -> None:
    """Start a janitor that removes the server's temporary directory once the owner is gone.

    The server listens on a socket in the owner's multiprocessing temporary directory
    (``pymp-*``), which Python removes only when the owner exits normally: every kernel
    killed from its manager would leave one behind. One janitor per server; a server that
    died and was started again gets a new one.
    """
    global _watched
    import psutil

    server = _server_pid()
    assert server is not None  # called once ensure_running has started it
    if _watched is not None and _watched[0] == server:
        return
    others = [p.pid for p in psutil.Process().children(recursive=True) if p.pid != server]
    janitor = Janitor([multiprocessing.util.get_temp_dir()], existing=others)
    janitor.watch([server], [])
    _watched = (server, janitor)


@contextlib.contextmanager
def engine_core() -> Iterator[None]:
    """While vLLM starts an engine in this block, fork its engine core from the fork server."""
    import vllm.v1.engine.utils as engine_utils

    spawn_context = engine_utils.get_mp_context
    engine_utils.get_mp_context = _ForkServerContext
    try:
        yield
    finally:
        engine_utils.get_mp_context = spawn_context


class _EngineCore(multiprocessing.context.ForkServerProcess):
    """vLLM's engine-core process, forked by the fork server; see the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        start()
        self._server = _server_pid()
        self._environ = dict(os.environ)

    def run(self) -> None:
        with contextlib.suppress(ImportError):
            import setproctitle

            # It moves the environment out of its way on first use, and gives up (vLLM names
            # no process) if the environment has been rebuilt before.
            setproctitle.getproctitle()
        os.environ.clear()
        os.environ.update(self._environ)
        tempfile.tempdir = None  # the fork server's, computed in another environment
        logs.apply_engine_config()
        # The fork server's end of its life line: held here, it would keep the server (this
        # process's parent) alive after the owner's death, and so this process too.
        compat.close_forkserver_alive_fd()
        lifeline.die_with_parent(parent=self._server)
        lifeline.wait_quietly()  # before the ranks it forks inherit its queue classes
        _cleanup_without_collection()
        try:
            super().run()
        finally:
            gc.collect()


def _cleanup_without_collection() -> None:
    """In this engine core, vLLM's teardown (``EngineCore.shutdown``) without its collection
    of the whole heap (`no_collections`): `_EngineCore.run` collects once after it, when the
    engine's objects are garbage too, where vLLM's runs while they are still held."""
    import vllm.v1.engine.core as engine_core

    cleanup = engine_core.cleanup_dist_env_and_memory

    def cleanup_uncollected(*args: Any, **kwargs: Any) -> None:
        with no_collections():
            cleanup(*args, **kwargs)

    engine_core.cleanup_dist_env_and_memory = cleanup_uncollected


class _ForkServerContext(multiprocessing.context.ForkServerContext):
    Process = _EngineCore
