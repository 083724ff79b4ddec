"""The README's examples run as written, on a real engine, and show what they say.

The fenced blocks of a page run in order in one namespace, as a reader would type them into
one notebook: a ``python`` block is executed, a ``pycon`` block is a doctest whose shown
output must match (``ELLIPSIS``, ``NORMALIZE_WHITESPACE``). The page's ``ek.Engine(...)``
gets the suite's shared engine of the same model and TP size (starting one per page would
double the suite's engine starts); its ``close()`` leaves that engine to the suite. Files a
page writes land in a temporary directory.
"""

from __future__ import annotations

import doctest
import io
import re
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import pytest

import envoykit as ek

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(python|pycon)\n(.*?)^```", re.S | re.M)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def blocks(page: Path) -> list[tuple[str, str, int]]:
    """(kind, code, line) of each fenced ``python`` or ``pycon`` block of ``page``."""
    text = page.read_text()
    return [
        (m.group(1), m.group(2), text.count("\n", 0, m.start()) + 2) for m in FENCE.finditer(text)
    ]


def lend(engines: dict[tuple[str, int], ek.Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    """``ek.Engine(model, tensor_parallel_size=tp)`` gives the suite's engine of that model and
    TP size, and its ``close()`` does nothing; any other option is refused, so that a page
    cannot pass for having run with options the shared engine lacks."""

    def engine(model: str, *, tensor_parallel_size: int, **options: object) -> ek.Engine:
        assert not options, f"the shared engine has no options {sorted(options)}"
        return engines[(model, tensor_parallel_size)]

    monkeypatch.setattr(ek, "Engine", engine)
    for shared in engines.values():
        monkeypatch.setattr(shared, "close", lambda: None)


def run_page(page: Path, namespace: dict) -> None:
    parser = doctest.DocTestParser()
    for kind, code, line in blocks(page):
        where = f"{page.name}:{line}"
        if kind == "python":
            exec(compile(code, where, "exec"), namespace)
            continue
        test = parser.get_doctest(code, namespace, where, str(page), line)
        report = io.StringIO()
        runner = doctest.DocTestRunner(optionflags=FLAGS)
        runner.run(test, out=report.write, clear_globs=False)
        assert runner.failures == 0, report.getvalue()
        namespace.update(test.globs)  # a doctest runs in a copy of the namespace


@pytest.mark.engine
@pytest.mark.slow
def test_readme_examples_run_and_show_their_output(demo3, tmp_path, monkeypatch):
    lend({("demo", 3): demo3}, monkeypatch)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    try:
        run_page(ROOT / "README.md", namespace)
    finally:
        plt.close("all")
    assert (tmp_path / "lens.json").exists()
    assert ek.Activations.open(tmp_path / "acts").layers == [10]
