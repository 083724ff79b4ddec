"""The notebooks (run by nbval, each in a kernel of its own) share one ``envoykit serve
--model demo --tp 3``, started before the first of them and stopped after the last: with
``ENVOYKIT_SERVER`` set, a notebook connects to it (`ek.connect()`) instead of starting the
same engine again (half a minute each on two cores). A ``ENVOYKIT_SERVER`` already set (a
server of the user's own) is left alone. Notebooks that are about engines in the kernel
(03, and the TP=1 engine of 07) still start them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest

_server: dict = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before the first notebook's kernel starts: it inherits this environment."""
    if item.path.suffix != ".ipynb" or "ENVOYKIT_SERVER" in os.environ:
        return
    command = [sys.executable, "-m", "envoykit.cli", "serve", "--model", "demo", "--tp", "3"]
    with tempfile.NamedTemporaryFile(prefix="notebook-server-", suffix=".log", delete=False) as log:
        process = subprocess.Popen(
            [*command, "--port", "0"], stdout=subprocess.PIPE, stderr=log, text=True
        )
    ready = re.search(r" at (http://\S+) ", process.stdout.readline())  # "" if it failed
    if ready is None:
        process.kill()
        raise RuntimeError(f"envoykit serve for the notebooks did not start; see {log.name}")
    _server.update(process=process, log=log.name)
    os.environ["ENVOYKIT_SERVER"] = ready[1]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last notebook: the tests that follow start engines of their own, and on two
    cores a server left idle beside them still holds four processes' memory."""
    if item.path.suffix == ".ipynb" and (nextitem is None or nextitem.path.suffix != ".ipynb"):
        _stop_server()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _stop_server()  # a session that stopped among the notebooks


def _stop_server() -> None:
    process = _server.pop("process", None)
    if process is not None:
        process.terminate()  # the server stops its engine and removes its token record
        process.wait(120)
        os.environ.pop("ENVOYKIT_SERVER", None)
        os.unlink(_server.pop("log"))
