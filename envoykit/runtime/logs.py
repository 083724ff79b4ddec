"""vLLM's logging: errors on screen by default, the full log in a file.

A TP=2 load prints a few hundred INFO lines from the client, the engine core and every rank
into the notebook cell. vLLM reads a Python logging config file named by
``VLLM_LOGGING_CONFIG_PATH`` in every process it starts (they inherit the environment), so one
file routes every process's records: INFO and up to a log file, ``level`` and up to the screen.
The same file sends torch's one-line notice about Triton, printed by every process, to the log
file only.
"""

from __future__ import annotations

import json
import logging.config
import os
import re
import time
from pathlib import Path

from envoykit import _compat as compat

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def configure(directory: Path, level: str) -> tuple[Path, dict[str, str]]:
    """Write a logging config for this engine; return the log file and the variables to set.

    The client applies the same config itself, since vLLM configured its logger when it was
    first imported and will not read the file again in this process.
    """
    level = level.upper()
    if level not in LEVELS:
        from envoykit.errors import InvalidRequest

        raise InvalidRequest(f"unknown log level {level!r}: use one of {', '.join(LEVELS)}")
    directory.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_file = directory / f"vllm-{stamp}-{os.getpid()}.log"
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "plain": {"format": "%(levelname)s %(asctime)s [pid %(process)d] %(name)s: %(message)s"}
        },
        "handlers": {
            "file": {
                "class": "logging.FileHandler",
                "filename": str(log_file),
                "formatter": "plain",
                "level": "INFO",
            },
            "screen": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": "plain",
                "level": level,
            },
        },
        "loggers": {
            "vllm": {"handlers": ["file", "screen"], "level": "INFO", "propagate": False},
            # torch notes in every process that Triton is missing ("Triton not available,
            # find_triton_kernels = []") when vLLM registers its Triton ops; vLLM's CPU
            # backend never uses Triton. torch re-attaches its own handler to its top
            # logger whenever it is imported, but leaves this module's logger alone.
            compat.TORCH_TRITON_LOGGER: {
                "handlers": ["file"],
                "level": "WARNING",
                "propagate": False,
            },
        },
    }
    config_file = log_file.with_suffix(".logging.json")
    config_file.write_text(json.dumps(config))
    logging.config.dictConfig(config)
    env = {
        "VLLM_CONFIGURE_LOGGING": "1",
        "VLLM_LOGGING_CONFIG_PATH": str(config_file),
        "VLLM_LOGGING_LEVEL": level,
    }
    return log_file, env


def apply_engine_config() -> None:
    """Apply the config `configure` wrote, named in this process's environment.

    For a process that imported vLLM before its environment named this engine's config (the
    fork server and the engine cores it forks, `envoykit.runtime.forkserver`).
    """
    path = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    if path:
        logging.config.dictConfig(json.loads(Path(path).read_text()))


# The last line of a Python traceback: the exception's name and message.
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit)\b(?::.*)?$")
# vLLM's lines that wrap a process's failure and point at the traceback above them.
_WRAPPERS = ("See stack trace for root cause", "See root cause above", "initialization failed")


def root_cause(log_file: Path | str | None) -> str | None:
    """The first exception a traceback in ``log_file`` ends with, skipping vLLM's wrappers
    ("WorkerProc initialization failed ... See stack trace for root cause"): the line that
    says why an engine did not start, e.g. ``KeyError: 'layers.1.mlp.gate.weight'``.
    None when the log has no traceback (or no log)."""
    try:
        lines = Path(log_file).read_text(errors="replace").splitlines() if log_file else []
    except OSError:
        return None
    in_traceback = False
    for line in lines:
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and not line.startswith((" ", "\t")):
            in_traceback = False
            if _EXCEPTION_LINE.match(line) and not any(w in line for w in _WRAPPERS):
                return line.strip()
    return None
