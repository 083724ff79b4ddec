"""``envoykit lab``: JupyterLab on the notebooks, reachable only from this machine."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def add_lab(commands: Any) -> None:
    lab = commands.add_parser("lab", help="JupyterLab on notebooks/, bound to 127.0.0.1")
    lab.add_argument("--port", type=int, default=8888)
    lab.add_argument("--dir", type=Path, default=Path("notebooks"))


def run_lab(args: argparse.Namespace) -> int:
    """JupyterLab on ``args.dir``, bound to 127.0.0.1, with a fresh token.

    The token goes to JupyterLab in its environment (``JUPYTER_TOKEN``), not on its command
    line, where every user of the machine could read it in ``ps``. SIGTERM and SIGINT reach
    JupyterLab as SIGTERM (a clean stop: a SIGINT alone would have it ask for confirmation)
    and are waited for, so stopping this command stops JupyterLab and its kernels rather than
    leaving them running as orphans.
    """
    import secrets
    import signal
    import subprocess

    token = secrets.token_hex(16)
    print(f"JupyterLab: http://127.0.0.1:{args.port}/lab?token={token}", flush=True)
    command = [
        sys.executable, "-m", "jupyter", "lab", f"--notebook-dir={args.dir}", "--ip=127.0.0.1",
        f"--port={args.port}", "--no-browser",
    ]  # fmt: skip
    if os.geteuid() == 0:  # containers often run as root; JupyterLab refuses without this
        command.append("--allow-root")
    lab = subprocess.Popen(command, env={**os.environ, "JUPYTER_TOKEN": token})

    def stop(_signum: int, _frame: Any) -> None:
        lab.terminate()

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return lab.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
