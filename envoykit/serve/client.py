"""`ek.connect()`: the engine surface of a running `envoykit serve`, over HTTP.

A `Connection` is an `EngineSurface` like `Engine`: the same lens, attribution, patching,
comparison and trace methods, the same checks and the same results. What it holds is the
served model's envoy tree built on the meta device (structure only, no weights, no ranks)
with envoykit's envoys map and shard guard, whose traces go to the server through nnsight's
own serve backend (``trace(..., serve=url)``): the trace is authored here, shipped with the
envoys it names (they travel by value, so the whole-tensor envoys are the ones that run), run
on the server's ranks, and its saved values come back into the caller's variables.

The tree is built from the served checkpoint's own config and tokenizer files; when this
machine does not have them at the server's path, the server sends them (no weights). A tuned
lens's translators go to the server once (`Connection._install_translator`), which checks and
installs them on its ranks; lenses then name them by key, as in process. An SAE goes the
same way (`Connection._install_sae`), once while the server's ranks keep it. Errors
come back as what they would be in-process: `ShardedValue`, `InvalidRequest`, an exception
in trace code, and `EngineDead` when the server's engine dies; a server that cannot be
reached, or that refuses the token, is a `ServerUnavailable` within the connect timeout.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nnsight.modeling.vllm.serve.backend import LocalServeBackend

from envoykit import _compat as compat
from envoykit._compat import Model
from envoykit.analyses import sae as sae_module
from envoykit.analyses.surface import EngineSurface
from envoykit.engine import ModelInfo, _OnRank
from envoykit.errors import EngineDead, InvalidRequest, ServerUnavailable
from envoykit.model.envoys import EnvoykitVLLM, guard_shards, raise_as_envoykit
from envoykit.runtime import logs, models, platform
from envoykit.serve import tokens

if TYPE_CHECKING:
    from envoykit.analyses.sae import SAE
    from envoykit.analyses.tuned import TunedLens

SERVER_ENV = "ENVOYKIT_SERVER"
TOKEN_ENV = "ENVOYKIT_TOKEN"
DEFAULT_TIMEOUT = 5.0
# A trace's answer may be a long time coming (a long generation, a queue of other clients).
_READ_TIMEOUT = 600.0
# The tree is never dispatched here: no rank ever builds a worker from this name.
_NO_WORKERS = "auto"
_BUILDING = threading.Lock()


def connect(
    url: str | None = None, *, token: str | None = None, timeout: float = DEFAULT_TIMEOUT
) -> Connection:
    """Connect to a running `envoykit serve`; the connection offers the `Engine` surface.

    ``url``: the server's address; None means ``$ENVOYKIT_SERVER``, else the newest server of
    this user on this machine. ``token``: None means the token a server on this machine left
    for this user at that address (`envoykit.serve.tokens`), else ``$ENVOYKIT_TOKEN`` (a server
    elsewhere, reached through a tunnel). ``timeout``: seconds to wait for the server to
    answer before `ServerUnavailable`.

    ``close()`` (or leaving a ``with`` block) disconnects; the server keeps running.
    """
    url = url or os.environ.get(SERVER_ENV) or None
    record = tokens.find(url)
    if url is None:
        if record is None:
            raise ServerUnavailable(
                "no envoykit server of yours runs on this machine: start one with "
                "`envoykit serve --model demo`, or pass its URL (or set $ENVOYKIT_SERVER)"
            )
        url = record.url
    token = token or (record.token if record else None) or os.environ.get(TOKEN_ENV)
    if not token:
        raise ServerUnavailable(
            f"no token for {url}: pass ek.connect(url, token=...) or set $ENVOYKIT_TOKEN "
            "(a server on this machine leaves its token where its user's clients find it)"
        )
    return Connection(url, token, timeout)


class Connection(EngineSurface):
    """A running server's engine, used from this process; see `connect`."""

    # The server may be another machine's (a tunnelled port): a collection's rows come back
    # with its traces and this process writes the store.
    _ranks_see_this_disk = False

    def __init__(self, url: str, token: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        import httpx

        self.url = url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.url,
            headers={tokens.TOKEN_HEADER: token},
            timeout=httpx.Timeout(timeout, read=_READ_TIMEOUT),
        )
        self._timeout = timeout
        self._lock = threading.RLock()
        self._model: ServedVLLM | None = None
        self._closed = False
        self.log_file: Path | None = None
        try:
            described = self._get("/v1/envoykit/info")
            self._info = ModelInfo(**described["info"])
            self._model = self._build_model(described["files"])
        except BaseException:
            self._http.close()
            raise

    # -- the engine surface ---------------------------------------------------------------

    @property
    def model(self) -> ServedVLLM:
        """The served model's envoy tree (meta, no weights); its traces run on the server."""
        self._refuse_if_closed()
        assert self._model is not None  # built by __init__, dropped only by close()
        return self._model

    def _refuse_if_closed(self) -> None:
        if self._closed:
            raise EngineDead("this connection is closed (the server keeps running): ek.connect()")

    @property
    def info(self) -> ModelInfo:
        """The served engine's `ModelInfo`, as the server reports it."""
        return self._info

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """This connection to one thread at a time: nnsight cannot build two traces on one
        model from two threads at once. Other clients of the server are not held up."""
        with self._lock:
            self.model  # noqa: B018 - a closed connection refuses here
            yield

    def _install_translator(self, translator: TunedLens) -> str:
        """Have the server install ``translator`` on its ranks (`Engine._install_translator`
        there): asked for by key first, sent (safetensors bytes) only when the ranks lack
        it, and checked by the server against the served model; its key."""
        from envoykit.analyses.tuned import TunedLens

        if not isinstance(translator, TunedLens):
            raise InvalidRequest(
                f"translator takes an ek.TunedLens, not {type(translator).__name__}"
            )
        path = f"/v1/envoykit/translators/{translator.key}"
        if not self._get(path)["installed"]:
            self._request(
                "POST",
                path,
                content=translator.to_file_bytes(),
                headers={"Content-Type": "application/octet-stream"},
            )
        return translator.key

    def _install_sae(self, sae: SAE) -> str:
        """Have the server install ``sae`` on its ranks (`Engine._install_sae` there, each
        rank keeping its slice): asked for by key first, sent (`SAE.to_bytes`) only when the
        ranks lack it, and checked by the server against the served model; its key."""
        path = f"/v1/envoykit/saes/{sae.key}"
        if not self._get(path)["installed"]:
            self._request(
                "POST",
                path,
                content=sae.to_bytes(),
                headers={"Content-Type": "application/octet-stream"},
            )
        return sae.key

    def sae_bytes(self, sae: SAE) -> list[int]:
        """The bytes of ``sae`` each of the server's ranks holds (its slice of the
        features), installing it."""
        for _ in range(2):  # another client's SAEs may drop it between the install and the ask
            sae_module.require(self, sae)
            held = self._get(f"/v1/envoykit/saes/{sae.key}/bytes")["bytes"]
            if held is not None:
                return held
        raise ServerUnavailable(
            f"the server's ranks dropped SAE {sae.key} for other clients' SAEs as soon as it "
            "was installed: ask again"
        )

    def _raise_cancel_flag(self, key: str) -> None:
        # The server puts the flag where its ranks look, and takes it down after a while.
        self._request("POST", f"/v1/envoykit/cancel/{key}", timeout=self._timeout)

    def _steered_trace(self, additions: Any, prompts: tuple, kwargs: dict) -> Any:
        raise InvalidRequest(
            "a steered engine.trace installs a block on the ranks, which needs the engine in "
            "this process; through a server, steer with lens(..., steer=), "
            "generate(..., steer=) or steer_sweep"
        )

    def _greedy(self, prompt: str, max_tokens: int) -> Any:
        with self.exclusive():
            return _completion(self.model, prompt, max_tokens)

    def status(self, workers: bool = False) -> dict[str, Any]:
        """The server's load: vLLM requests in flight; with ``workers=True`` also how many
        requests' workers each rank still holds (asked of the ranks, between two steps)."""
        return self._get(f"/v1/envoykit/status?workers={str(workers).lower()}")

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Disconnect (idempotent). The server and its engine keep running."""
        with self._lock:
            self._closed = True
            self._model = None
            self._http.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple:
        # Trace code that names the connection (``engine.model.lm_head(...)``) is shipped to
        # the server and on to the ranks; there it is the envoy tree, as for an `Engine`.
        return (_OnRank, (self.model,))

    def __repr__(self) -> str:
        info = self._info
        state = "closed" if self.closed else f"tp={info.tp}, {info.platform}, {info.dtype}"
        return f"Connection({info.name!r} at {self.url}, {state})"

    # -- transport ------------------------------------------------------------------------

    def _get(self, path: str) -> Any:
        # A question about the server, not a trace: it answers at once, or not at all.
        return self._request("GET", path, timeout=self._timeout).json()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        """One HTTP exchange; every way it can fail short of an answer is an envoykit error."""
        import httpx

        self._refuse_if_closed()
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as error:
            waited = _READ_TIMEOUT if isinstance(error, httpx.ReadTimeout) else self._timeout
            waited = self._timeout if "timeout" in kwargs else waited
            raise ServerUnavailable(
                f"the envoykit server at {self.url} did not answer within {waited:g} s "
                f"({type(error).__name__})"
            ) from error
        except httpx.TransportError as error:
            raise ServerUnavailable(
                f"no envoykit server answers at {self.url} ({error}): is `envoykit serve` "
                "running, and is this its address?"
            ) from error
        if response.status_code == 401:
            raise ServerUnavailable(
                f"the server at {self.url} refused the token: pass the one it made (its file "
                "under the cache directory's servers/), or set $ENVOYKIT_TOKEN"
            )
        if response.status_code in (400, 422) and _detail(response).get("invalid_request"):
            raise InvalidRequest(_detail(response).get("detail", ""))
        if response.status_code == 503:
            detail = _detail(response)
            if detail.get("engine_dead"):
                raise EngineDead(f"the server's engine died: {detail.get('detail')}")
            raise ServerUnavailable(
                f"the server at {self.url} cannot run requests now: {detail.get('detail')}"
            )
        if response.status_code != 200:
            raise ServerUnavailable(
                f"the server at {self.url} answered {response.status_code}: "
                f"{_detail(response).get('detail', response.reason_phrase)}"
            )
        return response

    def _build_model(self, files: dict[str, str]) -> ServedVLLM:
        """The served model's envoy tree on the meta device, built from its checkpoint's
        config and tokenizer: from the server's path when this machine has the same files
        there, else from copies the server sends."""
        info = self._info
        checkpoint = self._checkpoint(files)
        # vLLM's notes while it builds the tree (a dozen lines) go to a log file, as an
        # engine's do; errors still reach the screen. One build at a time in a process: each
        # brings vLLM's process-wide model-parallel state up and down, and sets the
        # environment vLLM reads its logging from.
        with _BUILDING:
            self.log_file, log_env = _client_log()
            with platform.environment(log_env, forced={}):
                model = ServedVLLM(
                    checkpoint,
                    worker_cls=_NO_WORKERS,
                    tensor_parallel_size=info.tp,
                    dtype=info.dtype,
                    max_model_len=info.max_model_len,
                )
        model._connection = weakref.ref(self)
        guard = weakref.WeakMethod(self.exclusive)
        model.request_guard = lambda: (guard() or contextlib.nullcontext)()
        return model

    def _checkpoint(self, files: dict[str, str]) -> str:
        path = self._info.path
        if not files or _same_files(Path(path), files):
            return path
        digest = hashlib.sha256(repr(sorted(files.items())).encode()).hexdigest()[:16]
        copy = models.cache_dir() / "served" / f"{self._info.name}-{digest}"
        if not _same_files(copy, files):
            copy.mkdir(parents=True, exist_ok=True)
            for name in files:
                if Path(name).name != name or name.startswith("."):
                    raise ServerUnavailable(f"the server offered a file named {name!r}: refused")
                url = f"/v1/envoykit/files/{name}"
                content = self._request("GET", url, timeout=self._timeout).content
                (copy / name).write_bytes(content)
        return str(copy)


@functools.cache
def _client_log() -> tuple[Path, dict[str, str]]:
    """This process's log file for vLLM's notes while it builds trees (one per process, not
    one per connection), and the variables that send them there."""
    return logs.configure(models.cache_dir() / "logs", "ERROR")


def _completion(model: Model, prompt: str, max_tokens: int) -> Any:
    """vLLM's greedy completion of ``prompt``, from a trace with nothing but a read of its
    finished request."""
    with model.trace(prompt, temperature=0.0, max_tokens=max_tokens) as tracer:
        result = tracer.result.save()
    return result.outputs[0]


def _same_files(directory: Path, files: dict[str, str]) -> bool:
    try:
        return all(
            hashlib.sha256((directory / name).read_bytes()).hexdigest() == digest
            for name, digest in files.items()
        )
    except OSError:
        return False


def _detail(response: Any) -> dict:
    try:
        content = response.json()
    except ValueError:
        return {}
    return content if isinstance(content, dict) else {}


class ServedVLLM(EnvoykitVLLM):
    """A served model's envoy tree in a client: never dispatched, every trace on the server.

    With no engine of its own the tree is only ever built on meta, so the shard guard's
    paths are found there (an engine finds them when it loads).
    """

    _connection: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # nnsight brings up a one-rank process group to build the tree and takes it down when
        # an engine loads; with no engine here, down now (torch would otherwise prefix every
        # later traceback in this process with "[rank0]:").
        compat.release_build_process_group(self)

    def _load_meta(self, repo_id: str, **kwargs: Any) -> Any:
        meta_model = super()._load_meta(repo_id, **kwargs)
        guard_shards(self._envoys_map, meta_model, self._split)
        return meta_model

    def trace(self, *inputs: Any, **kwargs: Any) -> Any:
        connection = self._connection() if self._connection is not None else None
        if connection is not None and kwargs.get("backend") is None:
            kwargs["backend"] = _ServerBackend(self, connection)
        return super().trace(*inputs, **kwargs)

    def dispatch(self) -> None:
        raise EngineDead(
            "this model's engine runs in an envoykit server; its traces go there (a closed "
            "connection has none)"
        )

    def __getstate__(self) -> dict:
        # Shipped to the server with every trace: the connection (and its token) stays here.
        state = super().__getstate__()
        state.pop("_connection", None)
        return state


class _ServerBackend(LocalServeBackend):
    """nnsight's serve backend on the connection's HTTP client (its token, its timeouts, its
    kept-alive socket), under the connection's guard, with envoykit's errors as themselves."""

    def __init__(self, model: ServedVLLM, connection: Connection) -> None:
        super().__init__(model, connection.url)
        self._connection = connection

    def __call__(self, tracer: Any) -> None:
        with self.model.request_guard():
            super().__call__(tracer)

    def _send(self, blob: bytes) -> dict:
        import torch
        from nnsight.intervention.errors import raise_deferred

        response = self._connection._request(
            "POST",
            "/v1/nnsight/generate",
            content=blob,
            headers={"Content-Type": "application/octet-stream", "nnsight-compress": "False"},
        )
        result = torch.load(io.BytesIO(response.content), map_location="cpu", weights_only=False)
        # envoykit's own errors from the ranks as themselves, as `EnvoykitVLLM._collect` does.
        error = result.get("error") or {}
        raise_as_envoykit(error)
        raise_deferred(error)
        return result.get("saves", {})
