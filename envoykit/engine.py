"""`Engine`: start, use and close a multi-rank vLLM engine under nnsight.

One object owns the engine's processes for its whole lifetime: it picks the platform and the
tensor-parallel size, checks the request before any rank starts, keeps vLLM's log out of the
notebook, serialises requests from several threads, and closes every rank process and shared
memory segment on ``close()``, on garbage collection and at interpreter exit (see
`envoykit.runtime.cleanup`). Ranks also die with the owning process if it is killed (see
`envoykit.runtime.lifeline`), and a janitor process unlinks their shared memory then (see
`envoykit.runtime.janitor`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Self

from envoykit._compat import Model
from envoykit.analyses import sae as sae_module
from envoykit.analyses import selfcheck
from envoykit.analyses.installed import InstalledSAEs, InstalledTranslators
from envoykit.analyses.surface import EngineSurface
from envoykit.errors import EngineDead, EnvoykitError, InvalidRequest
from envoykit.model.config import read_config
from envoykit.ranks.cancel import LensCancelled, cancel_message, flag_path, lower_flag, raise_flag
from envoykit.runtime import forkserver, logs, models, platform
from envoykit.runtime.cleanup import SHM as _SHM
from envoykit.runtime.cleanup import descendants as _descendants
from envoykit.runtime.cleanup import engine_semaphores as _engine_semaphores
from envoykit.runtime.cleanup import mapped_segments as _mapped_segments
from envoykit.runtime.cleanup import orphans_since as _orphans_since
from envoykit.runtime.cleanup import shutdown as _shutdown
from envoykit.runtime.cleanup import stop as _stop
from envoykit.runtime.cleanup import unlink_segment as _unlink_segment
from envoykit.runtime.info import (
    DEFAULT_DTYPE,
    DEFAULT_LOG_LEVEL,
    DEFAULT_MODEL,
    DTYPES,
    MAX_MODEL_LEN_CAP,
    ModelInfo,
    ModelShape,
    choose_tp,
    refuse_unknown_arguments,
)
from envoykit.runtime.janitor import Janitor
from envoykit.runtime.rank_watch import RankWatch, wake_waiting_client
from envoykit_vllm_plugin import ENGINE

if TYPE_CHECKING:
    from pathlib import Path

    from envoykit.analyses.sae import SAE
    from envoykit.analyses.tuned import TunedLens


class EngineLifetime:
    """The processes of a tensor-parallel vLLM engine under nnsight, from start to close.

    What `Engine` (synchronous, for notebooks and scripts) and the server's engine (vLLM's
    async mode, `envoykit.serve.server.ServedEngine`) share; it offers no analyses, whose
    traces need the synchronous engine.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        tensor_parallel_size: int | None = None,
        *,
        dtype: str = DEFAULT_DTYPE,
        max_model_len: int | None = None,
        log_level: str = DEFAULT_LOG_LEVEL,
        progress: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        """Start the engine; every check that can fail runs before a rank starts.

        ``dtype="auto"`` is float32 on CPU (numerics comparable with a float32 reference;
        bfloat16 is 1.5-2x faster and may be asked for) and the checkpoint's dtype on GPU.
        ``log_level`` is what vLLM may print on screen (everything from INFO up goes to
        ``engine.log_file``); its warnings on this backend are notes about the set-up
        (eager mode, no Triton, no tcmalloc), about twenty per start, hence ERROR.
        ``engine_kwargs`` go to ``vllm.LLM`` unchanged.
        """
        platform.refuse_unguarded_script()
        if dtype not in DTYPES:
            raise InvalidRequest(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
        self._platform = platform.platform_name()
        self._source = models.resolve(model)
        config = read_config(self._source.path)
        self._shape = ModelShape.from_config(config)
        platform.refuse_known_wrong(self._platform, config)
        self._platform_defaults = platform.engine_defaults(self._platform, config)
        if "attention_config" in engine_kwargs:  # the user's own names the backend
            self._platform_defaults.pop("attention_backend", None)
        self._tp = choose_tp(config, tensor_parallel_size, self._platform)
        self._dtype = "float32" if dtype == "auto" and self._platform == "cpu" else dtype
        limit = self._shape.max_positions or MAX_MODEL_LEN_CAP
        self._max_model_len = max_model_len or min(limit, MAX_MODEL_LEN_CAP)
        if self._max_model_len > limit:
            raise InvalidRequest(
                f"max_model_len={max_model_len} exceeds the model's {limit} positions"
            )
        self._log_level = log_level
        self._progress = progress
        self._checks: dict[str, str | None] = {}
        self._engine_kwargs = engine_kwargs
        self._lock = threading.RLock()
        self._llm: Any = None
        # The tuned-lens translators this engine's ranks hold (a restart forgets them).
        self._translators = InstalledTranslators()
        self._saes = InstalledSAEs()  # the SAEs whose slices the ranks hold
        self._sae_bytes: dict[str, list[int]] = {}  # key -> what each rank holds of it
        self._processes: list[Any] = []
        self._finalizer: weakref.finalize | None = None
        self.log_file: Path | None = None
        self.scratch: str | None = None  # the engine's own temporary directory (its TMPDIR)
        self._start()

    def _remember_sae_bytes(self, key: str, kept: tuple[str, ...], held: Any) -> None:
        """Record what each rank reported holding of SAE ``key`` at its install, and forget
        the SAEs the ranks dropped for it."""
        self._sae_bytes = {k: v for k, v in self._sae_bytes.items() if k in kept}
        self._sae_bytes[key] = [int(n) for n in held]

    # -- lifetime -------------------------------------------------------------------------

    def _start(self) -> None:
        import psutil
        from tqdm.auto import tqdm

        started = time.perf_counter()
        already_running = _descendants()
        steps = tqdm(total=3, desc=f"{self._source.name}: preparing", disable=not self._progress)
        self._translators.clear()
        self._saes.clear()
        self._sae_bytes = {}
        self.log_file, log_env = logs.configure(models.cache_dir() / "logs", self._log_level)
        env = {
            **platform.rank_environment(self._platform, self._tp),
            **log_env,
            ENGINE: "1",  # arms envoykit's vLLM plugin in this engine's processes
        }
        fork_core = self._platform == "cpu" and forkserver.enabled()
        if fork_core:  # its imports run beside this process's
            with platform.environment(env, forced={}):
                forkserver.start()
        worker_cls = platform.worker_class(self._platform)
        # The engine's temporary files (vLLM's ZeroMQ sockets, a few dozen per engine, and its
        # rendezvous file, which vLLM leaves behind) go to a directory of the engine's own,
        # removed with it. (mkdtemp also fixes this process's own temporary directory first.)
        scratch = self.scratch = tempfile.mkdtemp(prefix="envoykit-")
        # Watching before the first process starts: an owner killed mid-start leaves nothing.
        not_adopted = [p.pid for p in already_running] + forkserver.running()
        watcher = Janitor([scratch], existing=not_adopted)
        not_the_engine = {*already_running, psutil.Process(watcher.pid)}
        shared_memory = set(os.listdir(_SHM))
        try:
            with forkserver.engine_core() if fork_core else contextlib.nullcontext():
                llm = self._spawn(worker_cls, env, scratch, steps)
        except BaseException as error:
            steps.close()
            _stop(_descendants() - not_the_engine)
            for name in _orphans_since(shared_memory):
                _unlink_segment(name)
            watcher.release()  # it removes what the stopped processes were seen to map
            if isinstance(error, Exception) and not isinstance(error, EnvoykitError):
                raise self._failed_start(error) from error
            raise
        self._adopt(llm, not_the_engine, watcher, scratch)
        try:
            self._ready(llm, steps)
        except BaseException:
            steps.close()
            raise
        steps.set_description(f"{self._source.name}: ready")
        steps.update()
        steps.close()
        self.load_seconds = time.perf_counter() - started
        if self._progress:
            self._announce()

    def _adopt(self, llm: Any, not_the_engine: set[Any], watcher: Janitor, scratch: str) -> None:
        """Take the started engine's processes as this engine's: recorded, watched by the
        janitor and a rank watch, and ended by the finalizer if the engine is never closed."""
        self._llm = llm
        processes = _descendants() - not_the_engine
        self._processes = sorted(processes, key=lambda process: process.pid)
        platform.yield_to_ranks(self._platform, self._tp, self._processes)
        # What they made so far, for close() and the janitor: a process that dies first (a
        # killed rank takes the engine core down) can no longer be asked.
        made = _mapped_segments(processes) | _engine_semaphores(processes)
        segments = sorted(os.path.join(_SHM, name) for name in made)
        watcher.watch([p.pid for p in self._processes], segments)
        # A dead process takes the others down, and a death wakes a call waiting on the
        # engine core. (vLLM's entry point read when needed, not kept: a served engine drops
        # it at close)
        rank_watch = RankWatch(
            [p.pid for p in self._processes],
            lambda: _mapped_segments(processes) | _engine_semaphores(processes),
            lambda: wake_waiting_client(llm.vllm_entrypoint),
        )
        self._finalizer = weakref.finalize(
            self, _shutdown, llm, processes, watcher, scratch, rank_watch
        )

    def _failed_start(self, error: Exception) -> EngineDead:
        """What a start vLLM gave up on says: the line of the log that names the cause (a
        rank's error is in the log, not in the exception the client gets), and the log."""
        cause = logs.root_cause(self.log_file) or f"{type(error).__name__}: {error}"
        return EngineDead(
            f"{self._source.name} did not start on vLLM ({self._platform}, TP={self._tp}): "
            f"{cause} (the vLLM log {self.log_file} has the whole story)"
        )

    def _ready(self, llm: Any, steps: Any) -> None:
        """What a subclass does once the engine is up, before the start is announced."""

    def _announce(self) -> None:
        """The line a start prints under its progress bar: none here (a server prints its
        own, with its URL)."""

    def _spawn(self, worker_cls: str, env: dict[str, str], scratch: str, steps: Any) -> Any:
        """vLLM's engine under nnsight, its processes started with ``env`` and ``scratch``."""
        forced = {"TMPDIR": scratch, "VLLM_RPC_BASE_PATH": scratch}
        with platform.environment(env, forced=forced):
            from envoykit.model.envoys import EnvoykitVLLM

            refuse_unknown_arguments(self._engine_kwargs)
            steps.update()
            steps.set_description(f"{self._source.name}: starting {self._tp} rank(s)")
            # Every rank would draw its own "Loading safetensors checkpoint shards" bar in the
            # notebook, beside the one progress bar the engine shows.
            kwargs = {
                "use_tqdm_on_load": False,
                **self._platform_defaults,
                **self._engine_kwargs,
            }
            llm = EnvoykitVLLM(
                self._source.path,
                worker_cls=worker_cls,
                dispatch=True,
                tensor_parallel_size=self._tp,
                dtype=self._dtype,
                max_model_len=self._max_model_len,
                **kwargs,
            )
            # What vLLM resolved ("auto" on a GPU is the checkpoint's dtype): what runs.
            resolved = llm.vllm_entrypoint.model_config.dtype  # (LLM and AsyncLLM alike)
            self._dtype = str(resolved).removeprefix("torch.")
            steps.update()
        return llm

    def close(self) -> None:
        """Stop every rank and the engine core; free their shared memory. Idempotent."""
        with self._lock:
            if self._finalizer is not None:
                self._finalizer()
            self._llm = None

    def restart(self) -> None:
        """Close (if needed) and start a fresh engine with the same settings."""
        with self._lock:
            self.close()
            self._start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._llm is None

    @property
    def processes(self) -> list[Any]:
        """The engine core and rank processes this engine started (``psutil.Process``), to
        watch their memory or CPU; empty once closed."""
        return [] if self.closed else list(self._processes)

    # -- use ------------------------------------------------------------------------------

    @property
    def model(self) -> Any:
        """nnsight's VLLM envoy tree of the model, with envoykit's envoys map installed."""
        if self._llm is None:
            raise EngineDead("the engine is closed: call engine.restart() or start a new Engine")
        return self._llm

    @property
    def info(self) -> ModelInfo:
        shape = self._shape
        return ModelInfo(
            name=self._source.name,
            path=self._source.path,
            n_layers=shape.n_layers,
            d_model=shape.d_model,
            vocab=shape.vocab,
            n_heads=shape.n_heads,
            n_kv_heads=shape.n_kv_heads,
            tp=self._tp,
            platform=self._platform,
            dtype=self._dtype,
            max_model_len=self._max_model_len,
            validated=tuple(name for name, why in self._checks.items() if why is None),
            failed=tuple((name, why) for name, why in self._checks.items() if why is not None),
        )

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"tp={self._tp}, {self._platform}, {self._dtype}"
        return f"{type(self).__name__}({self._source.name!r}, {state})"


class Engine(EngineLifetime, EngineSurface):
    """A tensor-parallel vLLM engine whose modules are nnsight envoys.

    >>> import envoykit as ek
    >>> with ek.Engine("tiny", tensor_parallel_size=2) as engine:  # doctest: +SKIP
    ...     engine.info.tp, engine.info.n_layers
    (2, 4)

    (Not run as a doctest: a start costs tens of seconds, and the tests start this engine.)
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        tensor_parallel_size: int | None = None,
        *,
        validate: bool = True,
        **kwargs: Any,
    ) -> None:
        """Start the engine (`EngineLifetime`, whose options ``kwargs`` are: ``dtype``,
        ``max_model_len``, ``log_level``, ``progress``, and vLLM's own).

        ``validate``: run the self-check at load (`envoykit.analyses.selfcheck`, 0.3-0.4 s
        of a demo start at TP=1), which confirms the readout on the model's real weights and
        disables an analysis whose check fails; ``engine.info.validated`` says what passed.
        """
        self._validate = validate
        super().__init__(model, tensor_parallel_size, **kwargs)

    def _ready(self, llm: Any, steps: Any) -> None:
        # Everything the engine runs, nnsight traces included, goes through one guard. Held
        # weakly: the engine must stay collectable (its finalizer closes the ranks).
        guard = weakref.WeakMethod(self.exclusive)
        llm.request_guard = lambda: (guard() or contextlib.nullcontext)()
        if self._validate:
            steps.set_description(f"{self._source.name}: self-check")
            self._checks = selfcheck.run(self)

    @contextlib.contextmanager
    def _stoppable(self, key: str) -> Iterator[None]:
        """`exclusive`, with vLLM's steps checked for the cancel flag of ``key``: once it is
        up, the requests in flight are aborted before the next step and the work raises
        as a cancel on the ranks would. A generation needs this: a rank's error ends its
        part of the trace, but nnsight keeps the request scheduled to its last token."""
        with self.exclusive():
            assert self.scratch is not None  # a request runs on a started engine
            engine, flag = self.model.vllm_entrypoint.llm_engine, flag_path(self.scratch, key)
            step = engine.step

            def step_unless_cancelled() -> Any:
                if os.path.exists(flag):
                    unfinished = list(engine.output_processor.request_states)
                    if unfinished:
                        engine.abort_request(unfinished, internal=True)
                    raise LensCancelled(cancel_message(key))
                return step()

            engine.step = step_unless_cancelled
            try:
                yield
            finally:
                del engine.step  # the class's own again

    def _raise_cancel_flag(self, key: str) -> None:
        assert self.scratch is not None  # a lens in flight runs on a started engine
        raise_flag(self.scratch, key)

    def _lower_cancel_flag(self, key: str) -> None:
        assert self.scratch is not None  # a lens in flight runs on a started engine
        lower_flag(self.scratch, key)

    def _announce(self) -> None:
        """The one line a start prints under its progress bar (a server prints its own)."""
        print(
            f"envoykit: {self._source.name} on {self._tp} {self._platform} rank(s), "
            f"{self._dtype}, ready in {self.load_seconds:.1f} s{self._check_note()}; "
            f"vLLM log: {self.log_file}"
        )

    def _check_note(self) -> str:
        """What the self-check at load found, in a few words for the start line."""
        if self.readout.family is None:
            return (
                f"; {self.readout.architecture} has no readout contract: analyses are refused, "
                "plain traces work"
            )
        failed = [name for name, why in self._checks.items() if why is not None]
        if failed:
            return f"; self-check failed {', '.join(failed)} (engine.info.failed says why)"
        return "; self-check passed" if self._checks else ""

    # -- requests -------------------------------------------------------------------------

    def _install_translator(self, translator: TunedLens) -> str:
        """Check ``translator`` belongs to this model and send it to every rank, once while
        the ranks keep it (`InstalledTranslators`)."""
        from envoykit.analyses.tuned import TunedLens

        if not isinstance(translator, TunedLens):
            raise InvalidRequest(
                f"translator takes an ek.TunedLens, not {type(translator).__name__}"
            )
        keep = self._translators.keep_for(translator.key)
        if keep is not None:
            translator.check(self)
            self.model.vllm_entrypoint.collective_rpc(
                "envoykit_install_translators", args=(translator.key, translator.to_bytes(), keep)
            )
            self._translators.installed(translator.key, keep)
        return translator.key

    def _install_sae(self, sae: SAE) -> str:
        """Send ``sae`` to every rank, each keeping its slice of the features, once while the
        ranks keep it (`InstalledSAEs`); its key."""
        keep = self._saes.keep_for(sae.key)
        if keep is not None:
            config, blob = sae.to_wire()
            with self.exclusive():
                held = self.model.vllm_entrypoint.collective_rpc(
                    "envoykit_install_sae", args=(sae.key, config, blob, keep)
                )
            self._saes.installed(sae.key, keep)
            self._remember_sae_bytes(sae.key, keep, held)
        return sae.key

    def sae_bytes(self, sae: SAE) -> list[int]:
        """The bytes of ``sae`` each rank holds (its slice of the features), installing it;
        as the ranks reported them at its install."""
        sae_module.require(self, sae)
        return list(self._sae_bytes[sae.key])

    def _steered_trace(self, additions: Any, prompts: tuple, kwargs: dict) -> Any:
        """Install a block that makes ``additions`` at every step of every request that
        names it (an nnsight edit), and the trace that names it; it is cleared once that
        trace has run (`EnvoykitVLLM._call`)."""
        from envoykit.analyses.generation import steer_in_trace
        from envoykit.model.envoys import STEER_EDIT

        name = f"{STEER_EDIT}{uuid.uuid4().hex[:12]}"
        model, readout = self.model, self.readout  # the block ships its locals, not the engine
        with self.exclusive():
            model.clear_steer_edits()
            with model.edit(name=name) as (tracer, _):
                steer_in_trace(model, readout, additions, tracer)
        return model.trace(*prompts, edits=[name], **kwargs)

    def _greedy(self, prompt: str, max_tokens: int) -> Any:
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        with self.exclusive():
            self.model.clear_steer_edits()  # a plain request runs every edit left installed
            outputs = self.model.vllm_entrypoint.generate([prompt], params, use_tqdm=False)
        return outputs[0].outputs[0]

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """The engine to this thread alone, for work that spans several traces (a patched
        lens, a sweep, a comparison; every lens and trace already takes it).

        One request at a time; a dead engine core becomes `EngineDead`; an interrupt aborts
        what it left in flight, so the next request does not meet its outputs.
        """
        from vllm.v1.engine.exceptions import EngineDeadError

        with self._lock:
            engine = self.model.vllm_entrypoint.llm_engine
            try:
                yield
            except EngineDeadError as error:
                raise self._died() from error
            except Exception as error:
                # A rank killed while the client waits on a call to the ranks (nnsight's
                # ``collect_nnsight`` after each request) fails that call with vLLM's plain
                # "cancelled" before the engine core itself reports its death.
                if self._a_process_died():
                    raise self._died() from error
                raise
            except KeyboardInterrupt:
                unfinished = list(engine.output_processor.request_states)
                if unfinished:
                    engine.abort_request(unfinished, internal=True)
                raise

    def _a_process_died(self) -> bool:
        """Whether the engine core or a rank has exited (or is a zombie)."""
        import psutil

        for process in self._processes:
            try:
                if not process.is_running() or process.status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.Error:
                return True
        return False

    def _died(self) -> EngineDead:
        """Close what is left of a dead engine; the error that says so."""
        self.close()
        return EngineDead(
            "the engine's processes died (a rank was killed or crashed; the vLLM log "
            f"{self.log_file} has the cause): call engine.restart()"
        )

    def __reduce__(self) -> tuple:
        # Trace code that names the engine (``engine.model.lm_head(...)``) is shipped to the
        # ranks; there the engine is its envoy tree, which nnsight maps to the rank's own.
        return (_OnRank, (self.model,))


class _OnRank:
    """What an `Engine` named inside trace code is on a rank: its model's envoy tree."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.tokenizer = model.tokenizer
