"""The server's parts that need no engine: token records, the request guard, the host and
token checks, and how a trace's per-invoke values are merged."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import subprocess
import sys
from types import SimpleNamespace

import psutil
import pytest

import envoykit as ek
from envoykit.serve import tokens
from envoykit.serve.app import Guard, ServerState, merged_saves
from envoykit.serve.server import is_loopback, read_token, serve


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ENVOYKIT_CACHE", str(tmp_path))
    return tmp_path


def test_record_is_private_and_found_by_url(cache):
    path = tokens.write_record("http://127.0.0.1:7001", "secret-token", "tiny")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert tokens.find("http://localhost:7001").token == "secret-token"
    assert tokens.find("127.0.0.1:7001/").token == "secret-token"
    assert tokens.find("http://127.0.0.1:7002") is None
    assert tokens.find(None).url == "http://127.0.0.1:7001"


def test_newest_live_record_wins_and_stale_ones_go(cache):
    tokens.write_record("http://127.0.0.1:7001", "mine", "tiny")
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                          capture_output=True).stdout.strip()  # fmt: skip
    stale = tokens.records_dir() / f"server-{gone}.json"
    record = {"url": "http://127.0.0.1:7009", "token": "t", "pid": int(gone), "model": "x"}
    stale.write_text(json.dumps({**record, "started": 1e12}))  # newer, but its process is gone
    assert tokens.find(None).token == "mine"
    assert not stale.exists()


def test_loopback_hosts():
    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.1.5", "example.org"]))


def test_a_chosen_token_must_be_private_and_long(tmp_path):
    path = tmp_path / "token"
    path.write_text("a-long-enough-token-value\n")
    path.chmod(0o644)
    with pytest.raises(ek.InvalidRequest, match="chmod 600"):
        read_token(path)
    path.chmod(0o600)
    assert read_token(path) == "a-long-enough-token-value"
    path.write_text("short")
    with pytest.raises(ek.InvalidRequest, match="at least 16"):
        read_token(path)


def test_other_hosts_are_refused_without_a_token_before_anything_starts():
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(ek.InvalidRequest, match="--token-file"):
        serve("tiny", host="0.0.0.0", port=0)
    assert set(psutil.Process().children(recursive=True)) == before


def test_cli_serve_refuses_a_busy_port(cache):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "envoykit.cli", "serve", "--model", "tiny", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "ENVOYKIT_CACHE": str(cache)},
        )
    assert out.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr


# -- the guard: an ASGI middleware, driven by hand -------------------------------------------


class Exchange:
    """One HTTP exchange: the request's body, then (optionally) the client going away."""

    def __init__(self, headers: dict[bytes, bytes], disconnect_after: float | None = None):
        path = "/v1/nnsight/generate"
        self.scope = {"type": "http", "path": path, "headers": list(headers.items())}
        self.disconnect_after = disconnect_after
        self.sent: list[dict] = []
        self.body_sent = False

    async def receive(self) -> dict:
        if not self.body_sent:
            self.body_sent = True
            return {"type": "http.request", "body": b"trace", "more_body": False}
        if self.disconnect_after is None:
            await asyncio.Event().wait()  # the client stays
        else:
            await asyncio.sleep(self.disconnect_after)
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.sent if m["type"] == "http.response.start"), None)


def app_taking(seconds: float, log: list, after: float = 0.0):
    """An app that reads the body, works ``seconds``, answers, then tidies up ``after``."""

    async def app(scope, receive, send):
        await receive()
        try:
            await asyncio.sleep(seconds)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"done"})
            await asyncio.sleep(after)
        except asyncio.CancelledError:
            log.append("cancelled")
            raise
        log.append("answered")

    return app


def run_guard(app, exchange: Exchange, state: ServerState | None = None) -> None:
    guard = Guard(app, "the-token", state or ServerState(engine=None))
    asyncio.run(asyncio.wait_for(guard(exchange.scope, exchange.receive, exchange.send), 10))


def test_guard_refuses_a_missing_or_wrong_token_without_running_anything():
    for headers in ({}, {b"ndif-api-key": b"wrong"}, {b"ndif-api-key": b"the-token!"}):
        log: list = []
        exchange = Exchange(headers)
        run_guard(app_taking(0, log), exchange)
        assert exchange.status == 401 and log == []


def test_guard_answers_503_saying_why_once_the_engine_is_dead():
    log: list = []
    exchange = Exchange({b"ndif-api-key": b"the-token"})
    state = ServerState(engine=None, unavailable="the ranks died", engine_dead=True)
    run_guard(app_taking(0, log), exchange, state)
    assert exchange.status == 503 and log == []
    assert json.loads(exchange.sent[1]["body"]) == {"detail": "the ranks died", "engine_dead": True}


def test_guard_cancels_the_request_of_a_client_that_went_away():
    log: list = []
    exchange = Exchange({b"ndif-api-key": b"the-token"}, disconnect_after=0.1)
    run_guard(app_taking(30, log), exchange)
    assert log == ["cancelled"] and exchange.sent == []


def test_guard_lets_a_request_finish_when_its_client_stays():
    log: list = []
    exchange = Exchange({b"ndif-api-key": b"the-token"})
    run_guard(app_taking(0.1, log), exchange)
    assert log == ["answered"] and exchange.status == 200


def test_guard_does_not_cancel_an_answered_request_as_it_winds_up():
    """uvicorn reports a disconnect once the response is complete: not a client gone."""
    log: list = []
    exchange = Exchange({b"ndif-api-key": b"the-token"}, disconnect_after=0.2)
    run_guard(app_taking(0.1, log, after=0.3), exchange)
    assert log == ["answered"] and exchange.status == 200


# -- per-invoke values come back as nnsight's in-process collect gives them -----------------


def entry(saves: dict) -> dict:
    return {"saves": saves, "error": None, "sequences": {}}


def test_each_invoke_keeps_its_own_values():
    mediators = [SimpleNamespace(presaved=set(), lcls={}) for _ in range(3)]
    entries = [
        entry({"steps": [0], "only_first": "x"}),
        entry({"steps": [1]}),
        entry({"steps": [2]}),
    ]
    assert merged_saves(mediators, entries) == {"steps": [[0], [1], [2]], "only_first": "x"}
    assert merged_saves(mediators[:1], entries[:1]) == {"steps": [0], "only_first": "x"}


def test_a_container_bound_above_the_invokes_is_merged():
    mediators = [SimpleNamespace(presaved={"rows"}, lcls={}) for _ in range(2)]
    entries = [entry({"rows": ["a", None]}), entry({"rows": [None, "b"]})]
    assert merged_saves(mediators, entries) == {"rows": ["a", "b"]}


# Run in a fresh interpreter, whose torch calls are not wrapped yet (they are wrapped once per
# process, and the wrapper then asks which thread calls).
_ACCELERATOR_CHECK = """
import threading
import torch
from envoykit.model.loader_calls import structure_only

def outcome(call):
    try:
        call()
        return "none"
    except RuntimeError:
        return "raises"

elsewhere = []
with structure_only():
    here = [outcome(torch.accelerator.empty_cache), outcome(torch.accelerator.synchronize)]
    sync = torch.accelerator.synchronize
    thread = threading.Thread(target=lambda: elsewhere.append(outcome(sync)))
    thread.start()
    thread.join()
print(here, elsewhere, outcome(torch.accelerator.empty_cache))
"""


@pytest.mark.skipif(
    __import__("torch").accelerator.is_available(), reason="the shim is for hosts without one"
)
def test_a_structure_only_build_skips_accelerator_calls_on_its_own_thread_only():
    """While an engine or a connection builds its structure-only model, vLLM's loader may
    empty the accelerator's cache on that thread and nothing happens; any other thread
    meanwhile, and the building thread afterwards, get torch's own answer (here: its error,
    as there is no accelerator)."""
    out = subprocess.run(
        [sys.executable, "-c", _ACCELERATOR_CHECK], capture_output=True, text=True, check=True
    )
    assert out.stdout.split("\n")[-2] == "['none', 'none'] ['raises'] raises", out.stdout
