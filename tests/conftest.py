"""Engines are expensive (tens of seconds each), so they are shared fixtures.

``tiny`` at TP=1 and TP=2 and ``demo`` at TP=3 live for the whole session (each started by
the first test that needs it), and so does ``tiny`` at TP=2 in bfloat16, which two modules
use; the other variants (tied embeddings, logit soft-cap) are started by the module that needs
them.
"""

from __future__ import annotations

import os
import subprocess

import psutil
import pytest

import envoykit as ek

# Test data, among it the script that wrote the SAE files with SAELens and sparsify, which
# are not installed here: nothing under data/ is a test.
collect_ignore = ["data"]

# The engine's processes (the engine core forked from the fork server, its ranks from the
# core) must not inherit pytest's capture.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def start(model: str, tp: int, **kwargs) -> ek.Engine:
    return ek.Engine(model, tensor_parallel_size=tp, progress=False, **kwargs)


def rank_processes(engine: ek.Engine) -> list[psutil.Process]:
    """The engine's rank processes (``psutil.Process``), rank 0 first."""
    return sorted((p for p in engine.processes if "Worker_TP" in p.name()), key=lambda p: p.name())


@pytest.fixture(scope="session")
def tiny1():
    with start("tiny", 1) as engine:
        yield engine


@pytest.fixture(scope="session")
def tiny2():
    with start("tiny", 2) as engine:
        yield engine


@pytest.fixture(scope="session")
def tiny2_bf16():
    with start("tiny", 2, dtype="bfloat16") as engine:
        yield engine


@pytest.fixture(scope="session")
def tiny_engines(tiny1, tiny2):
    return {1: tiny1, 2: tiny2}


@pytest.fixture(scope="session")
def demo3():
    with start("demo", 3) as engine:
        yield engine


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a real full disk (ENOSPC from the kernel). Needs root."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Matrix cases that an ``applies`` marker rules out are deselected, not skipped: a test
    that cannot apply to an architecture is not generated for it, so that every skip left in
    the report is a case that could have run and did not."""
    keep, drop = [], []
    for item in items:
        mark = item.get_closest_marker("applies")
        callspec = getattr(item, "callspec", None)
        if mark and callspec and "case" in callspec.params:
            (keep if mark.kwargs["to"](*callspec.params["case"]) else drop).append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
