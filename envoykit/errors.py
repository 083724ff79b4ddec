"""The errors envoykit raises, each saying what went wrong and what to do next.

Everything derives from `EnvoykitError`, so a notebook can catch the whole family; the
subclasses tell apart a request that was refused before reaching the ranks
(`InvalidRequest`), a value that would only be one rank's piece (`ShardedValue`), an
engine that can no longer answer (`EngineDead`), an engine server that cannot be reached
(`ServerUnavailable`) and a lens stopped by ``engine.cancel()`` (`Cancelled`).
"""

from __future__ import annotations


class EnvoykitError(Exception):
    """Base class of every error envoykit raises on purpose."""


class InvalidRequest(EnvoykitError, ValueError):
    """The request was refused before anything reached the ranks; the engine is unharmed."""


class ShardedValue(EnvoykitError):
    """A location holds one rank's piece of a tensor and nothing gathers it.

    Raised instead of handing back a silent piece: at TP>=2 such a value has the wrong shape
    and meaning, and feeding it onward gives garbage without an error.
    """


class EngineDead(EnvoykitError):
    """The engine's processes are gone (closed, crashed or killed); call ``engine.restart()``."""


class ServerUnavailable(EnvoykitError, ConnectionError):
    """No engine server answers at that address (not started, stopped, unreachable, still
    starting) or it refused this client's token; nothing ran on it."""


class Cancelled(EnvoykitError):
    """The lens was stopped by ``engine.cancel()`` before it finished; nothing came back,
    and the engine serves the next request as usual."""
