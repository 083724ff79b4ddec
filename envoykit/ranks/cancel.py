"""Stop a lens in flight on the ranks, between two chunks of its reductions.

A lens of a long prompt is one forward step, and its time goes mostly into the reductions
on the ranks, chunk by chunk (`envoykit.analyses.lens`). vLLM aborts a request only between
two steps, so a Cancel would wait for the whole step. Instead each lens carries a key, and
a cancel is a flag file named after it in the engine's scratch directory, which is every
rank's ``TMPDIR``: the client writes it (`flag_path`), or the server does for a client
(``POST /v1/envoykit/cancel/{key}``). Before each chunk every rank looks for the flag, and
the ranks agree on what they saw in an exchange, so every rank stops at the same chunk and
none is left waiting in another: the lens sends the flag with the chunk's summaries (one
number more in an exchange it makes anyway, so it stops before the chunk's sums), a
generation with one all-gather of one number a step (`stop_if_cancelled`). They raise
`LensCancelled`; the request ends with that error and the engine serves the next one.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile

import torch

from envoykit.model.vocab_shard import VocabShard

_PREFIX = "envoykit-cancel-"
_KEY = re.compile(r"[0-9a-f]{32}")


class LensCancelled(RuntimeError):
    """Raised on every rank when the lens's cancel flag is up (the client raises
    `envoykit.errors.Cancelled` in its place, `is_cancellation`)."""


def check_key(key: str) -> str:
    """``key`` if it is a lens's cancel key (32 hex digits), else ValueError: it names a
    file, so nothing else may reach a path."""
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(f"not a cancel key: {key!r}")
    return key


def flag_path(directory: str, key: str) -> str:
    """Where the cancel flag of lens ``key`` lives in the engine's scratch ``directory``."""
    return os.path.join(directory, _PREFIX + check_key(key))


def raise_flag(directory: str, key: str) -> str:
    """Put up the cancel flag of lens ``key`` in the engine's scratch ``directory``; its path."""
    path = flag_path(directory, key)
    with open(path, "w"):
        pass
    return path


def lower_flag(directory: str, key: str) -> None:
    """Take the flag of lens ``key`` down, if it is up."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(flag_path(directory, key))


def is_cancellation(error: BaseException, key: str) -> bool:
    """Whether ``error``, raised by the trace of lens ``key``, is its ranks' `LensCancelled`.
    The trace hands a rank's error back as a ``RuntimeError`` carrying its text (so
    measured, in process and through a server), hence the text is what is matched."""
    return cancel_message(key) in str(error)


def cancel_message(key: str) -> str:
    """What the error of a cancelled lens ``key`` says, wherever it was raised."""
    return f"lens {key} cancelled"


def flag_seen(key: str) -> bool:
    """On a rank: whether it sees the flag of ``key``. The ranks must still agree on it in
    an exchange: `stop_if_cancelled`, or the flag sent with a chunk's summaries
    (`envoykit.ranks.vocab_parallel.lens_summaries`)."""
    return os.path.exists(flag_path(tempfile.gettempdir(), key))


def stop_if_cancelled(shard: VocabShard, key: str | None, device: torch.device) -> None:
    """On a rank, inside the trace: raise `LensCancelled` on every rank once any rank sees
    the flag of ``key`` (None: this lens cannot be cancelled; nothing is exchanged)."""
    if key is None:
        return
    flags = shard.gather(torch.tensor([float(flag_seen(key))], device=device))
    if bool(flags.max() > 0):
        raise LensCancelled(cancel_message(key))
