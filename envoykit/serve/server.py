"""`envoykit serve`: an envoykit engine behind nnsight's server, with a token and a lifetime.

The engine is the one `ek.Engine` starts — same model resolution, core binding, envoys map,
shard guard, lifeline, janitor and log file — in vLLM's async mode, served by nnsight's own
FastAPI app (``nnsight.modeling.vllm.serve``) as `envoykit.serve.app` extends it. Notebooks
reach it with `ek.connect()`.

A server runs the code its clients send. So it listens on the loopback interface unless told
otherwise, and then only with a token the user chose; every request but ``/health`` carries
the token, which is made fresh at each start and left where only this user can read it
(`envoykit.serve.tokens`), never printed or logged.

Lifetime: SIGTERM or Ctrl-C lets requests in flight finish (5 s at most, then they are
aborted), stops the engine (every rank, the engine core, their shared memory) and removes
the token file. If the server is killed outright, its ranks die with it
(`envoykit.runtime.lifeline`)
and janitors remove their shared memory and the token file (`envoykit.runtime.janitor`). If a rank
or the engine core dies, requests in flight get `EngineDead`, and the server exits with status
3 saying why, or starts a fresh engine with ``restart=True``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import signal
import socket
import stat
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envoykit import _compat as compat
from envoykit.engine import EngineLifetime
from envoykit.errors import InvalidRequest
from envoykit.runtime.info import DEFAULT_DTYPE, DEFAULT_LOG_LEVEL, DEFAULT_MODEL
from envoykit.runtime.janitor import Janitor
from envoykit.serve import tokens
from envoykit.serve.app import ServerState, install, small_files

DEFAULT_PORT = 6677
ENGINE_DEAD_EXIT = 3
_WATCH_SECONDS = 0.25
# After the engine dies, how long requests in flight get to send their EngineDead answers.
_DEATH_GRACE_SECONDS = 1.0
# On SIGTERM / Ctrl-C, how long requests in flight may take before they are aborted.
_SHUTDOWN_GRACE_SECONDS = 5
_MIN_TOKEN_LENGTH = 16

if TYPE_CHECKING:
    from envoykit.analyses.sae import SAE
    from envoykit.analyses.tuned import TunedLens

logger = logging.getLogger("envoykit.serve.server")


class ServedEngine(EngineLifetime):
    """An engine in vLLM's async mode (``AsyncLLM``), for the server's event loop.

    It has an engine's lifetime and none of `Engine`'s analyses: their traces are
    synchronous, and an engine in async mode answers a trace only by being awaited on its
    loop (the server runs what its clients send that way). For the same reason it is not
    self-checked at load: its info says so (nothing validated, nothing failed).
    """

    def __init__(self, model: str, tensor_parallel_size: int | None, **kwargs: Any) -> None:
        self._fingerprint: dict | None = None
        self._installing = asyncio.Lock()
        super().__init__(model, tensor_parallel_size, mode="async", **kwargs)

    def has_translator(self, key: str) -> bool:
        """Whether the ranks hold the translators of this key (a restart forgets them)."""
        return key in self._translators

    async def install_translator(self, translator: TunedLens) -> str:
        """`Engine._install_translator` on the event loop: ``translator`` checked against
        this model (`TunedLens.check_fingerprint`), sent to every rank through the same
        worker RPC, once per key; its key. An engine in async mode answers a trace and an
        RPC by awaiting them, which the in-process path cannot."""
        async with self._installing:
            keep = self._translators.keep_for(translator.key)
            if keep is not None:
                translator.check_fingerprint(await self.fingerprint())
                await self.model.vllm_entrypoint.collective_rpc(
                    "envoykit_install_translators",
                    args=(translator.key, translator.to_bytes(), keep),
                )
                self._translators.installed(translator.key, keep)
        return translator.key

    async def has_sae(self, key: str) -> bool:
        """Whether the ranks hold the SAE of this key (a restart forgets them), marking it as
        just used, as `Engine._install_sae` does for an SAE it holds: a request reads up to
        `InstalledSAEs.LIMIT` SAEs, and a client asks for each before sending any, so an
        SAE it was told is held must not be the one the next install drops. Asked under the
        install lock: an install under way may be dropping it."""
        async with self._installing:
            return key in self._saes and self._saes.keep_for(key) is None

    def sae_bytes(self, key: str) -> list[int] | None:
        """The bytes each rank holds of the SAE ``key`` (its slice of the features), as the
        ranks reported them when it was installed; None unless they hold it."""
        return self._sae_bytes.get(key) if key in self._saes else None

    async def install_sae(self, sae: SAE) -> str:
        """`Engine._install_sae` on the event loop: ``sae`` checked against this model
        (`SAE.check_engine`), sent to every rank through the same worker RPC, once while the
        ranks keep it (`InstalledSAEs`); its key. Checked even when the ranks hold its key:
        the key is the hash of what they hold (the weights), not of where the SAE reads or
        which model it names."""
        sae.check_engine(self.info)
        async with self._installing:
            keep = self._saes.keep_for(sae.key)
            if keep is not None:
                config, blob = sae.to_wire()
                held = await self.model.vllm_entrypoint.collective_rpc(
                    "envoykit_install_sae", args=(sae.key, config, blob, keep)
                )
                self._saes.installed(sae.key, keep)
                self._remember_sae_bytes(sae.key, keep, held)
        return sae.key

    async def fingerprint(self) -> dict:
        """`EngineBase.fingerprint` of the served model, from one trace on the async
        engine (built before its first await, as the server builds every trace); kept, as
        the model is the same after a restart."""
        import nnsight

        from envoykit.analyses.base import fingerprint_ids, fingerprint_of
        from envoykit.model.readout import at

        if self._fingerprint is None:
            # The same trace as `fingerprint`'s, written here: nnsight compiles a trace from
            # the `with` block of the function that opens it, and an async engine's must be
            # opened in the coroutine that awaits it.
            ids = fingerprint_ids(self.info.vocab)
            model = self.model
            readout = model.readout
            with model.trace("The", temperature=0.0, max_tokens=1) as tracer:
                # Bound on the finished output only: an async trace's saves are not pushed
                # back into this frame.
                rows = nnsight.save(at(model, readout.unembedding).rows(ids).float().cpu())  # noqa: F841
            finished = await tracer.backend
            self._fingerprint = fingerprint_of(self.info, finished.saves["rows"])
        return self._fingerprint


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(path: Path) -> str:
    """A token the user chose, from a file only they can read (as ssh treats its keys)."""
    info = path.stat()
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise InvalidRequest(
            f"{path} can be read by other users (mode {stat.S_IMODE(info.st_mode):o}): "
            f"chmod 600 {path}"
        )
    token = path.read_text().strip()
    if len(token) < _MIN_TOKEN_LENGTH or any(c.isspace() for c in token):
        raise InvalidRequest(
            f"the token in {path} must be one word of at least {_MIN_TOKEN_LENGTH} characters"
        )
    return token


def serve(
    model: str = DEFAULT_MODEL,
    *,
    tensor_parallel_size: int | None = None,
    dtype: str = DEFAULT_DTYPE,
    max_model_len: int | None = None,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token_file: Path | None = None,
    restart: bool = False,
    log_level: str = DEFAULT_LOG_LEVEL,
    engine_kwargs: dict[str, Any] | None = None,
) -> int:
    """Start the engine, serve it until SIGTERM / Ctrl-C or its death; the exit status.

    Everything that can be refused (a host other than loopback without ``token_file``, a
    port in use, a model or TP size that cannot work) is refused before any rank starts.
    ``engine_kwargs`` go to vLLM unchanged (``distributed_executor_backend``, ...).
    """
    if not is_loopback(host) and token_file is None:
        raise InvalidRequest(
            f"--host {host} lets other machines reach a server that runs the code they send: "
            "it needs a token you chose (--token-file FILE, mode 600), or use an SSH tunnel "
            "to 127.0.0.1"
        )
    token = read_token(token_file) if token_file is not None else tokens.new_token()
    listener = _bind(host, port)
    try:
        engine = ServedEngine(
            model,
            tensor_parallel_size,
            dtype=dtype,
            max_model_len=max_model_len,
            log_level=log_level,
            **(engine_kwargs or {}),
        )
        try:
            return _serve(engine, listener, host, token, restart)
        finally:
            engine.close()
            _forget_engine()
    finally:
        listener.close()


def _forget_engine() -> None:
    """Free the closed engine's vLLM ``AsyncLLM`` now, while the modules it uses still
    exist. Something made during the engine's start keeps a frame of that start alive, and
    through it the envoy tree; freed only at interpreter exit, the ``AsyncLLM``'s
    ``__del__`` ran a second shutdown with its module's globals gone and printed a
    ``TypeError`` traceback."""
    import gc

    model = compat.forget_served_model()
    if model is not None:
        model.vllm_entrypoint = None
    gc.collect()


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound but not listening: while the engine starts, a client is
    refused at once rather than left waiting; a port in use fails before any rank starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as error:
        listener.close()
        raise InvalidRequest(f"cannot listen on {host}:{port}: {error.strerror}") from error
    return listener


def _serve(
    engine: ServedEngine, listener: socket.socket, host: str, token: str, restart: bool
) -> int:
    import uvicorn
    from nnsight.modeling.vllm.serve.server import app, set_model

    _log_to(engine.log_file)
    state = ServerState(engine=engine, files=small_files(engine.info.path))
    set_model(engine.model)
    install(app, token, state)
    config = uvicorn.Config(
        app,
        log_config=None,
        lifespan="off",
        timeout_graceful_shutdown=_SHUTDOWN_GRACE_SECONDS,
    )
    server = uvicorn.Server(config)
    name = f"[{host}]" if ":" in host else host
    url = f"http://{name}:{listener.getsockname()[1]}"
    # uvicorn stops on SIGINT and SIGTERM, then raises the signal again for its previous
    # handler: SIGTERM then ends the process as Ctrl-C does, through the cleanup below.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        asyncio.run(_run(server, listener, engine, state, url, token, restart))
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    if state.engine_dead:
        print(f"envoykit serve: exiting: {state.unavailable}", file=sys.stderr, flush=True)
        return ENGINE_DEAD_EXIT
    return 0


async def _run(
    server: Any,
    listener: socket.socket,
    engine: ServedEngine,
    state: ServerState,
    url: str,
    token: str,
    restart: bool,
) -> None:
    """Serve until stopped; the token record exists exactly while the server listens."""
    serving = asyncio.ensure_future(server.serve(sockets=[listener]))
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if serving.done():
        await serving
        return
    record = tokens.write_record(url, token, engine.info.name)
    # Removes the record should this process be killed (no process of its own to watch).
    janitor = Janitor([str(record)], existing=[])
    janitor.watch([], [])
    watch = asyncio.ensure_future(_watch(server, engine, state, restart))
    try:
        info = engine.info
        print(
            f"envoykit serve: {info.name} on {info.tp} {info.platform} rank(s), {info.dtype}, "
            f"ready in {engine.load_seconds:.1f} s at {url} (token in {record}; vLLM log: "
            f"{engine.log_file})",
            flush=True,
        )
        await serving
    finally:
        watch.cancel()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(record)
        janitor.release()


async def _watch(server: Any, engine: ServedEngine, state: ServerState, restart: bool) -> None:
    """Notice the engine's death: refuse requests saying why, then stop or restart."""
    from nnsight.modeling.vllm.serve.server import set_model

    names = _process_names(engine)
    while True:
        await asyncio.sleep(_WATCH_SECONDS)
        if not engine.model.vllm_entrypoint.errored:
            continue
        gone = [name for pid, name in names.items() if not _alive(pid)]
        state.unavailable = (
            f"the engine's processes died ({', '.join(gone) or 'the engine core'} gone; the vLLM "
            f"log {engine.log_file} has the cause)"
        )
        state.engine_dead = True
        logger.error(state.unavailable)
        await asyncio.sleep(_DEATH_GRACE_SECONDS)
        if not restart:
            server.should_exit = True
            return
        print(f"envoykit serve: {state.unavailable}; restarting", file=sys.stderr, flush=True)
        state.unavailable, state.engine_dead = "the server's engine is restarting", False
        started = time.perf_counter()
        try:
            await asyncio.get_running_loop().run_in_executor(None, engine.restart)
        except Exception as error:
            state.unavailable = f"the engine died and could not be restarted: {error}"
            state.engine_dead = True
            server.should_exit = True
            return
        set_model(engine.model)
        names = _process_names(engine)
        state.unavailable = None
        print(
            f"envoykit serve: engine restarted in {time.perf_counter() - started:.1f} s, serving",
            file=sys.stderr,
            flush=True,
        )


def _process_names(engine: EngineLifetime) -> dict[int, str]:
    names = {}
    for process in engine.processes:
        with contextlib.suppress(Exception):
            names[process.pid] = process.name()
    return names


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            return stat_file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _log_to(log_file: Path | None) -> None:
    """The HTTP side's log (uvicorn's, requests included, and envoykit's) to the engine's log
    file; warnings and errors to the screen too. Requests are logged by path: the token is a
    header, never part of one."""
    formatter = logging.Formatter(
        "%(levelname)s %(asctime)s [pid %(process)d] %(name)s: %(message)s"
    )
    handlers: list[logging.Handler] = []
    if log_file is not None:
        handlers.append(logging.FileHandler(log_file))
    screen = logging.StreamHandler(sys.stderr)
    screen.setLevel(logging.WARNING)
    handlers.append(screen)
    for handler in handlers:
        handler.setFormatter(formatter)
    for name in ("uvicorn", "nnsight.serve", "envoykit.serve.server"):
        target = logging.getLogger(name)
        target.handlers[:] = handlers
        target.setLevel(logging.INFO)
        target.propagate = False
