"""Server tokens: made at start, kept in a file only the user can read, found by clients.

A server runs whatever code its clients send, so every request but ``/health`` must carry its
token. Typing a 43-character secret into every notebook would push people to weaker ones, so
each running server leaves a record — its URL and token — in ``<cache>/servers/``, a
directory of mode 0700 holding files of mode 0600: a client of the same user on the same
machine finds the newest live server, or the one at a given URL, and its token, without
being told. The record goes when the server stops (or, if it is killed, when its janitor
sees it die); a record whose process is gone is ignored and removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from envoykit.runtime import models

# The header a token travels in: nnsight's serve client sends its ``api_key`` there.
TOKEN_HEADER = "ndif-api-key"
_DIR_MODE = 0o700
_FILE_MODE = 0o600


@dataclass(frozen=True)
class ServerRecord:
    """A running server as its record file describes it."""

    url: str
    token: str
    pid: int
    model: str
    started: float


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def records_dir() -> Path:
    """Where this user's servers leave their records, created private if missing."""
    directory = models.cache_dir() / "servers"
    directory.mkdir(mode=_DIR_MODE, parents=True, exist_ok=True)
    os.chmod(directory, _DIR_MODE)  # mkdir's mode is filtered by the umask, and may predate us
    return directory


def write_record(url: str, token: str, model: str) -> Path:
    """Record this process's server; the file is created with mode 0600, never wider.

    Written to a private temporary name and renamed into place, so a client never reads a
    half-written record.
    """
    record = ServerRecord(url=url, token=token, pid=os.getpid(), model=model, started=time.time())
    directory = records_dir()
    path = directory / f"server-{record.pid}.json"
    temporary = directory / f".server-{record.pid}.json.tmp"
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, _FILE_MODE)
    with os.fdopen(descriptor, "w") as file:
        json.dump(asdict(record), file)
    os.replace(temporary, path)
    return path


def live_records() -> list[ServerRecord]:
    """Records of servers whose process still runs, newest first; stale ones are removed."""
    found = []
    for path in records_dir().glob("server-*.json"):
        try:
            record = ServerRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        if _running(record.pid):
            found.append(record)
        else:
            with contextlib.suppress(OSError):
                path.unlink()
    return sorted(found, key=lambda record: record.started, reverse=True)


def find(url: str | None) -> ServerRecord | None:
    """The newest live local server, or the one at ``url`` (same host and port), if any."""
    records = live_records()
    if url is None:
        return records[0] if records else None
    wanted = _address(url)
    return next((record for record in records if _address(record.url) == wanted), None)


def _address(url: str) -> tuple[str, int | None]:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    host = parts.hostname or ""
    return ("127.0.0.1" if host == "localhost" else host), parts.port


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process now holds that pid
        return False
    return True
