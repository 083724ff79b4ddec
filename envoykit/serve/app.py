"""What envoykit adds to nnsight's server app: a token on every request, aborts on
disconnect, the model's description, and a trace route that keeps every invoke's values.

nnsight 0.8.1's FastAPI ``app`` (``nnsight.modeling.vllm.serve.server``) already rebuilds a
client's serialized trace against the served engine, submits one vLLM request per invoke and
collects the saves; `install` extends that app in place rather than writing another server:

* `Guard`, an ASGI middleware around the whole app: every path but ``/health`` needs the
  token in nnsight's own ``ndif-api-key`` header (compared in constant time), else 401 and
  nothing runs; once the engine is dead every request gets 503 saying so; and a request
  whose client disconnects is cancelled, which aborts its vLLM requests and frees their
  workers on the ranks (stock uvicorn never cancels a handler on disconnect).
* ``GET /v1/envoykit/info``: the served engine's `ModelInfo` and the checkpoint's small files
  (config, tokenizer), from which a client on another machine builds its envoy tree.
* ``GET /v1/envoykit/status``: vLLM requests in flight, and (``?workers=true``) the workers
  each rank still holds.
* ``GET /v1/envoykit/translators/{key}``: whether the ranks hold a tuned lens's translators;
  ``POST`` the same path with the lens as safetensors bytes (`TunedLens.to_file_bytes`: data,
  no pickle) installs them: refused with 400 when the body is not a tuned lens or its hash is
  not ``key``, with 422 when it belongs to another model (`TunedLens.check_fingerprint`
  against the served model's own fingerprint), else sent to every rank once per key
  (`envoykit.serve.server.ServedEngine.install_translator`). A refusal says
  ``"invalid_request": true``; the client raises it as `InvalidRequest`.
* ``GET /v1/envoykit/saes/{key}``: whether the ranks hold an SAE (each its slice of the
  features); ``POST`` the same path with the SAE as safetensors bytes (`SAE.to_bytes`: data,
  no pickle) installs it: refused with 400 when the body is not an SAE or its key is not
  ``key``, with 422 when it does not fit the served model (`SAE.check_engine`), else sent to
  every rank once while they keep it (`envoykit.serve.server.ServedEngine.install_sae`).
  ``GET /v1/envoykit/saes/{key}/bytes``: what each rank holds of it (`Engine.sae_bytes`).
* ``POST /v1/envoykit/cancel/{key}``: the cancel flag of the lens with that key, which its
  ranks look for between two chunks of work (`envoykit.ranks.cancel`); a client's
  ``engine.cancel()`` sends it.
* ``POST /v1/nnsight/generate``, replaced: nnsight's handler merges the saves of a trace's
  invokes with ``dict.update``, so a name each invoke saves (a lens of several prompts, a
  patch-sweep batch) came back with the last invoke's value only. This one collects each
  invoke as nnsight's handler does and merges the way its in-process path does
  (``VLLM._collect``): one value per invoke, in order; a body that is not a serialized trace
  is refused with 400; a dead engine answers 503.

It builds each trace before its first ``await``, as nnsight's handler does: concurrent
requests share the model's one interleaver, and the engine batches their requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fastapi import HTTPException, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from envoykit import _compat as compat
from envoykit.serve.tokens import TOKEN_HEADER

logger = logging.getLogger("envoykit.serve.server")

OPEN_PATHS = frozenset({"/health"})
# Checkpoint files a client may fetch: what a structure-only build reads, never weights.
_SMALL_FILE_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")
_SMALL_FILE_LIMIT = 64 * 2**20
# How long a cancel flag stays up: longer than a lens waits in the queue before it starts.
_CANCEL_FLAG_SECONDS = 600

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


@dataclass
class ServerState:
    """What the routes read: the engine being served, and why it cannot serve, if so."""

    engine: Any
    files: dict[str, str] = field(default_factory=dict)  # small checkpoint files: name -> sha256
    unavailable: str | None = None  # set while the engine is dead or restarting
    engine_dead: bool = False
    cleanups: set = field(default_factory=set)  # frees in flight, kept from the collector


class Guard:
    """ASGI middleware: the token, the engine's death, and cancellation on disconnect."""

    def __init__(self, app: Any, token: str, state: ServerState) -> None:
        self.app = app
        self.token = token.encode()
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path not in OPEN_PATHS:
            given = dict(scope["headers"]).get(TOKEN_HEADER.encode(), b"")
            if not hmac.compare_digest(given, self.token):
                await _json(send, 401, {"detail": "missing or wrong token"})
                return
        if self.state.unavailable is not None:
            detail = {"detail": self.state.unavailable, "engine_dead": self.state.engine_dead}
            await _json(send, 503, detail)
            return
        await _cancel_on_disconnect(self.app, scope, receive, send)


async def _cancel_on_disconnect(app: Any, scope: Scope, receive: Receive, send: Send) -> None:
    """Run ``app``; if the client goes away before the response is complete, cancel it.

    Once the app has read the whole body, a watcher takes over the connection's receive
    channel: the next message it can bring is the disconnect. Should the app ask for another
    message, it gets the watcher's. A client gone while it still sends its body (a killed
    kernel) makes the app's read raise `ClientDisconnect`: nothing ran, nothing to answer,
    and no traceback for the server's log.
    """
    body_read = asyncio.Event()
    responded = False
    watcher: asyncio.Future | None = None

    async def watch() -> dict:
        await body_read.wait()
        return await receive()

    async def app_receive() -> dict:
        if body_read.is_set():
            assert watcher is not None  # made before the handler first runs
            return await asyncio.shield(watcher)
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            body_read.set()
        return message

    async def app_send(message: dict) -> None:
        nonlocal responded
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            responded = True
        await send(message)

    handler = asyncio.ensure_future(app(scope, app_receive, app_send))
    watcher = asyncio.ensure_future(watch())
    try:
        while not handler.done():
            await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher.done() and not handler.done():
                if watcher.result()["type"] == "http.disconnect" and not responded:
                    logger.info("client went away: cancelling %s", scope["path"])
                    handler.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await handler
                    return
                await handler
        await handler
    except ClientDisconnect:
        logger.info("client went away while sending %s", scope["path"])
    finally:
        watcher.cancel()
        if not handler.done():  # this middleware itself cancelled (server shutdown)
            handler.cancel()


async def _json(send: Send, status: int, content: dict) -> None:
    body = json.dumps(content).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def small_files(checkpoint: str) -> dict[str, str]:
    """The checkpoint directory's small non-weight files, name -> sha256 (none for a hub id)."""
    directory = Path(checkpoint)
    if not directory.is_dir():
        return {}
    found, total = {}, 0
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name.endswith(_SMALL_FILE_SUFFIXES):
            total += path.stat().st_size
            if total > _SMALL_FILE_LIMIT:
                break
            found[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def install(app: Any, token: str, state: ServerState) -> None:
    """Extend nnsight's ``app`` with the guard and envoykit's routes (once per process)."""
    app.router.routes[:] = [
        route
        for route in app.router.routes
        if not (isinstance(route, APIRoute) and route.path == "/v1/nnsight/generate")
    ]

    @app.get("/v1/envoykit/info")
    async def info() -> dict:
        return {"info": asdict(state.engine.info), "files": state.files}

    @app.get("/v1/envoykit/files/{name}")
    async def checkpoint_file(name: str) -> Response:
        if name not in state.files:
            raise HTTPException(status_code=404, detail=f"no checkpoint file {name!r} here")
        content = (Path(state.engine.info.path) / name).read_bytes()
        return Response(content=content, media_type="application/octet-stream")

    @app.get("/v1/envoykit/status")
    async def status(workers: bool = False) -> dict:
        llm = state.engine.model.vllm_entrypoint
        found = {"in_flight": llm.get_num_unfinished_requests()}
        if workers:  # the ranks answer between two steps: as late as the step is long
            found["workers"] = list(await llm.collective_rpc("nnsight_request_count"))
        return found

    @app.get("/v1/envoykit/translators/{key}")
    async def translator(key: str) -> dict:
        return {"key": key, "installed": state.engine.has_translator(key)}

    @app.post("/v1/envoykit/translators/{key}")
    async def install_translator(key: str, request: Request) -> Any:
        return await install_translators(key, await request.body(), state)

    @app.get("/v1/envoykit/saes/{key}")
    async def sae(key: str) -> dict:
        return {"key": key, "installed": await state.engine.has_sae(key)}

    @app.post("/v1/envoykit/saes/{key}")
    async def post_sae(key: str, request: Request) -> Any:
        return await install_sae(key, await request.body(), state)

    @app.get("/v1/envoykit/saes/{key}/bytes")
    async def sae_bytes(key: str) -> dict:
        return {"key": key, "bytes": state.engine.sae_bytes(key)}

    @app.post("/v1/envoykit/cancel/{key}")
    async def cancel(key: str) -> Any:
        return raise_cancel_flag(key, state)

    @app.post("/v1/nnsight/generate")
    async def generate(request: Request) -> Response:
        return await run_trace(await request.body(), request.headers, state)

    app.add_middleware(Guard, token=token, state=state)


async def install_translators(key: str, body: bytes, state: ServerState) -> Any:
    """Install the tuned lens in ``body`` on the ranks unless they hold ``key`` already;
    ``{"key": key}``, or a refusal (400: not a tuned lens, or not the lens of ``key``; 422:
    the lens of another model) the client raises as `InvalidRequest`."""
    from vllm.v1.engine.exceptions import EngineDeadError

    from envoykit.analyses.tuned import TunedLens
    from envoykit.errors import InvalidRequest

    try:
        lens = TunedLens.from_bytes(body)
    except InvalidRequest as error:
        return _refused(400, str(error))
    if lens.key != key:
        return _refused(400, f"the translators sent are those of key {lens.key}, not {key}")
    try:
        await state.engine.install_translator(lens)
    except InvalidRequest as error:
        return _refused(422, str(error))
    except EngineDeadError:
        detail = "the engine's processes died while installing translators"
        return JSONResponse(status_code=503, content={"detail": detail, "engine_dead": True})
    logger.info("tuned-lens translators %s installed on the ranks", key)
    return {"key": key}


async def install_sae(key: str, body: bytes, state: ServerState) -> Any:
    """Install the SAE in ``body`` on the ranks unless they hold ``key`` already;
    ``{"key": key}``, or a refusal (400: not an SAE, or not the SAE of ``key``; 422: an SAE
    that does not fit the served model) the client raises as `InvalidRequest`. The key is
    the hash of what the ranks install, checked here: a client cannot put one SAE's
    features under another's key."""
    from vllm.v1.engine.exceptions import EngineDeadError

    from envoykit.analyses.sae import SAE
    from envoykit.errors import InvalidRequest

    try:
        sae = SAE.from_bytes(body)
    except InvalidRequest as error:
        return _refused(400, str(error))
    if sae.key != key:
        return _refused(400, f"the SAE sent is that of key {sae.key}, not {key}")
    try:
        await state.engine.install_sae(sae)
    except InvalidRequest as error:
        return _refused(422, str(error))
    except EngineDeadError:
        detail = "the engine's processes died while installing an SAE"
        return JSONResponse(status_code=503, content={"detail": detail, "engine_dead": True})
    logger.info("SAE %s installed on the ranks", key)
    return {"key": key}


def raise_cancel_flag(key: str, state: ServerState) -> Any:
    """Put up the cancel flag of lens ``key`` where the served engine's ranks look
    (`envoykit.ranks.cancel`), and take it down `_CANCEL_FLAG_SECONDS` later: a lens
    still queued by then is no longer waited for. 400 if ``key`` is not a cancel key."""
    from envoykit.ranks.cancel import lower_flag, raise_flag

    directory = state.engine.scratch
    try:
        raise_flag(directory, key)
    except ValueError as error:
        return _refused(400, str(error))
    asyncio.get_running_loop().call_later(_CANCEL_FLAG_SECONDS, lower_flag, directory, key)
    return {"key": key}


def _refused(status: int, detail: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"detail": detail, "invalid_request": True})


async def run_trace(body: bytes, headers: Any, state: ServerState) -> Any:
    """Build the trace in ``body`` against the served model, run one request per invoke,
    and answer nnsight's payload: ``{"saves": {name: value}, "error": deferred or None}``."""
    from nnsight.intervention.errors import capture_exception
    from nnsight.intervention.util import clear_shared_locals
    from nnsight.tracing.globals import SOURCES

    model = compat.served_model()
    # A trace may name the interleaver (a collection's does), which comes in as the served
    # model's own and must go on to the ranks as a reference too.
    compat.interleaver_by_reference(model)
    began = time.perf_counter()
    compress = headers.get("nnsight-compress", "False").lower() == "true"
    try:
        try:
            tracer = compat.build_served_tracer(body, compress)
        except Exception as error:
            detail = f"not a serialized nnsight trace: {type(error).__name__}: {error}"
            raise HTTPException(status_code=400, detail=detail[:500]) from error
        # The block's source now stands in linecache for its file; nnsight reads a file's
        # source once, so the invokes of a second block from the same file (two traces of
        # one module) would be looked up in the first block's text.
        SOURCES.pop(tracer.info.frame.f_code.co_filename, None)
        try:
            mediators, (prompts, params, loras), kwargs = tracer.prepare(tracer.info.code)
            compat.attach_mediators(model, params, **kwargs)
        except Exception as error:
            logger.info("trace refused while building: %s: %s", type(error).__name__, error)
            return compat.served_payload({}, capture_exception(error))
    finally:
        # The workers ride on the requests now (or the build failed): none may leak into the
        # next request's build. nnsight clears the per-frame stores its invokes share when a
        # trace executes; this one is only prepared, so without the clear every request's
        # frame, and through it the request's whole tracer, stayed in a thread-local.
        model.interleaver.cancel()
        clear_shared_locals()

    engine = model.vllm_entrypoint
    built = time.perf_counter()
    runs = [
        _run_invoke(engine, prompt, param, loras[i] if loras else None, state)
        for i, (prompt, param) in enumerate(zip(prompts, params))
    ]
    results = await asyncio.gather(*runs, return_exceptions=True)
    failures = [result for result in results if isinstance(result, BaseException)]
    answered = [result for result in results if not isinstance(result, BaseException)]
    if failures:
        return _failed(failures)
    ran = time.perf_counter()
    entries = [entry or {"saves": {}, "error": None, "sequences": {}} for entry in answered]
    raised = next((entry["error"] for entry in entries if entry.get("error")), None)
    answer = compat.served_payload({} if raised else merged_saves(mediators, entries), raised)
    logger.info(
        "trace of %d invoke(s): built in %.0f ms, ran in %.0f ms, answer (%d bytes) in %.0f ms",
        len(prompts),
        1000 * (built - began),
        1000 * (ran - built),
        len(answer.body),
        1000 * (time.perf_counter() - ran),
    )
    return answer


def _failed(failures: list[BaseException]) -> Any:
    """The answer to a trace an invoke of which raised: 503 if the engine's processes died,
    else nnsight's payload of the first failure."""
    from nnsight.intervention.errors import capture_exception
    from vllm.v1.engine.exceptions import EngineDeadError

    if any(isinstance(failure, EngineDeadError) for failure in failures):
        detail = "the engine's processes died while running this request"
        return JSONResponse(status_code=503, content={"detail": detail, "engine_dead": True})
    logger.info("generation failed: %r", failures[0])
    return compat.served_payload({}, capture_exception(failures[0]))


async def _run_invoke(engine: Any, prompt: Any, param: Any, lora: Any, state: ServerState) -> Any:
    """One invoke's vLLM request, to its end; its collected values (None if none).

    Cancelled (the client went away, the server stops), vLLM aborts the request and this
    frees its workers on the ranks; the free is shielded from the cancellation and kept
    referenced until it is done.
    """
    from nnsight.modeling.vllm.engines.engine import acollect

    request_id = uuid.uuid4().hex
    collected = False
    try:
        output = None
        async for step in engine.generate(prompt, param, request_id, lora_request=lora):
            output = step  # the last is the finished request, which the ranks' collect needs
        entry = await acollect(engine, request_id, output)
        collected = True
        return entry
    finally:
        if not collected:
            free = asyncio.ensure_future(acollect(engine, request_id))
            state.cleanups.add(free)
            free.add_done_callback(state.cleanups.discard)
            with contextlib.suppress(Exception):  # a dead engine has nothing left to free
                await asyncio.shield(free)


def merged_saves(mediators: list, entries: list[dict]) -> dict[str, Any]:
    """The trace's saved values, as nnsight's in-process collect hands them back.

    A name saved by one request is its value; a name several requests saved for themselves
    is a list, one value per request in submission order (one per sampled sequence within
    each); a container bound above the invokes is one object locally, and its per-request
    copies are merged into one (nnsight's ``merge_shared_saves``).
    """
    from nnsight.modeling.vllm.collect import merge_shared_saves

    per_request: list[dict] = []
    values: dict[str, list] = {}
    for entry in entries:
        sequences = entry.get("sequences") or {}
        runs = [sequences[index]["saves"] for index in sorted(sequences)] or [entry["saves"]]
        per_request.append(runs[0])
        for saves in runs:
            for name, value in saves.items():
                values.setdefault(name, []).append(value)
    merged = dict(merge_shared_saves(mediators, per_request))
    for name, found in values.items():
        if name not in merged:
            one = found[0]
            merged[name] = found if any(other is not one for other in found[1:]) else one
    return merged
