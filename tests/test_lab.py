"""`envoykit lab`: JupyterLab on loopback with a token that stays off the command line, and
stopped with the command (SIGTERM or SIGINT), its processes gone."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def status(port: int, token: str | None) -> int:
    headers = {"Authorization": f"token {token}"} if token else {}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/status", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_lab_keeps_its_token_private_and_stops_with_the_command(tmp_path, stop):
    port = free_port()
    lab = subprocess.Popen(
        [sys.executable, "-m", "envoykit.cli", "lab", "--port", str(port), "--dir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,  # a signal to this test's group would reach JupyterLab too
    )
    tree: list[psutil.Process] = []
    try:
        line = lab.stdout.readline()
        assert line.startswith(f"JupyterLab: http://127.0.0.1:{port}/lab?token="), line
        token = line.rsplit("token=", 1)[1].strip()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if status(port, token) == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("JupyterLab did not answer with the printed token")
        assert status(port, None) == 403  # nothing without the token
        tree = [psutil.Process(lab.pid), *psutil.Process(lab.pid).children(recursive=True)]
        assert len(tree) >= 2
        for process in tree:
            assert token not in " ".join(process.cmdline()), process.cmdline()
        lab.send_signal(stop)
        lab.wait(timeout=60)
        _, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, f"outlived envoykit lab: {[p.cmdline() for p in alive]}"
        assert "Traceback" not in lab.stderr.read()
    finally:
        for process in tree:
            if process.is_running():
                process.kill()
        if lab.poll() is None:
            lab.kill()
