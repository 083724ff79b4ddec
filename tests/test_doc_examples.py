"""The documentation's examples run as written, on real engines, and show what they say.

The README and every page of docs/ with code in it run as a reader would type each into one
notebook: the page's fenced blocks in order in one namespace (``__name__`` is
``"__main__"``, as in a notebook), a ``python`` block executed, a ``pycon`` block a doctest
whose shown output must match (``ELLIPSIS``, ``NORMALIZE_WHITESPACE``). So every page starts
the engine it uses and defines every name it uses. The page's ``ek.Engine(model,
tensor_parallel_size=tp)`` gets the suite's shared engine of that model and TP size
(starting one per page would double the suite's engine starts); its ``close()``, and its
``with`` block's exit, leave that engine to the suite. Each page runs in a temporary working
directory, where the files it writes land (a page may read what it wrote earlier); what it
reads from the repository (``REPOSITORY_FILES``) is linked there. Blocks that cannot run in
the suite are in ``NOT_RUN``, with the reason; ``tests/unit/test_readme.py`` still compiles
and ruff-checks them.
"""

from __future__ import annotations

import doctest
import io
import json
import linecache
import re
import time
from collections.abc import Callable
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import pytest

import envoykit as ek

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(python|pycon)\n(.*?)^```", re.S | re.M)
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
ENGINE = re.compile(r"""ek\.Engine\(\s*["'](\w[\w-]*)["'],\s*tensor_parallel_size=(\d+)""")

# The suite's shared engines (tests/conftest.py), by (model, TP size).
SHARED = {("tiny", 1): "tiny1", ("tiny", 2): "tiny2", ("demo", 3): "demo3"}
# Options a page may give `ek.Engine` that the shared engines were started with.
SHARED_OPTIONS = {"progress": False}

# Pages of docs/ whose blocks do not run here, and why.
NOT_RUN = {
    "serve.md": (
        "needs a running `envoykit serve`: the only server fixture (tests/test_server.py) is"
        " module-scoped there, and one more would be a whole engine start; the server's"
        " results are checked against in-process ones in tests/test_server.py"
    ),
}

# What a page reads from the repository, relative to its root (a reader runs the page from
# there): linked into the page's working directory.
REPOSITORY_FILES = ("tests/data",)


def blocks(page: Path) -> list[tuple[str, str, int]]:
    """(kind, code, line) of each fenced ``python`` or ``pycon`` block of ``page``."""
    text = page.read_text()
    return [
        (m.group(1), m.group(2), text.count("\n", 0, m.start()) + 2) for m in FENCE.finditer(text)
    ]


def engines_of(page: Path) -> list[tuple[str, int]]:
    """The (model, TP size) of every ``ek.Engine(...)`` the page's blocks start."""
    code = "\n".join(code for _, code, _ in blocks(page))
    return sorted({(model, int(tp)) for model, tp in ENGINE.findall(code)})


def lend(engines: dict[tuple[str, int], ek.Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    """``ek.Engine(model, tensor_parallel_size=tp)`` gives the suite's engine of that model and
    TP size, and its ``close()`` does nothing; any other option is refused (but those the
    shared engines were started with), so that a page cannot pass for having run with options
    the shared engine lacks."""

    def engine(model: str, *, tensor_parallel_size: int, **options: object) -> ek.Engine:
        other = sorted(k for k, v in options.items() if (k, v) not in SHARED_OPTIONS.items())
        assert not other, f"the shared engine has no options {other}"
        return engines[(model, tensor_parallel_size)]

    monkeypatch.setattr(ek, "Engine", engine)
    for shared in engines.values():
        monkeypatch.setattr(shared, "close", lambda: None)


def run_page(page: Path, namespace: dict) -> None:
    parser = doctest.DocTestParser()
    for kind, code, line in blocks(page):
        where = f"{page.name}:{line}"
        if kind == "python":
            # nnsight reads a trace's ``with`` body back from its source, as from a cell's
            linecache.cache[where] = (len(code), None, code.splitlines(True), where)
            exec(compile(code, where, "exec"), namespace)
            continue
        test = parser.get_doctest(code, namespace, where, str(page), line)
        report = io.StringIO()
        runner = doctest.DocTestRunner(optionflags=FLAGS)
        runner.run(test, out=report.write, clear_globs=False)
        assert runner.failures == 0, report.getvalue()
        namespace.update(test.globs)  # a doctest runs in a copy of the namespace


def run_in(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Run ``page`` in ``tmp_path``; its namespace afterwards."""
    for name in REPOSITORY_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    try:
        run_page(page, namespace)
    finally:
        plt.close("all")
    return namespace


@pytest.mark.engine
@pytest.mark.slow
def test_readme_examples_run_and_show_their_output(demo3, tmp_path, monkeypatch):
    lend({("demo", 3): demo3}, monkeypatch)
    run_in(ROOT / "README.md", tmp_path, monkeypatch)
    assert (tmp_path / "lens.json").exists()
    assert ek.Activations.open(tmp_path / "acts").layers == [10]


# What each page's run is checked for afterwards, beyond running: (working directory,
# namespace) -> None.
def _envoys(cwd: Path, ns: dict) -> None:
    assert ns["logits"].shape[-1] == ns["engine"].info.vocab  # whole, not one rank's slice


def _lens(cwd: Path, ns: dict) -> None:
    assert abs(ns["att"].values.sum(0) - ns["att"].logits).max() < 1e-3


def _tuned_lens(cwd: Path, ns: dict) -> None:
    assert ek.TunedLens.load(cwd / "tuned.safetensors", ns["engine"]).model == ns["tuned"].model
    assert ns["quality"].tokens > 0 and len(ns["quality"].layers) == ns["engine"].info.n_layers


def _causal(cwd: Path, ns: dict) -> None:
    # Copying the whole final stream at the last position is the France run itself.
    assert abs(ns["sweep"].effect()[-1, -1] - 1) < 1e-3


def _attention(cwd: Path, ns: dict) -> None:
    assert ns["heads"].values.shape == (4, len(ns["heads"].heads))


def _steering(cwd: Path, ns: dict) -> None:
    assert ek.SteeringVector.load(cwd / "sentiment.safetensors").layer == 10


def _features(cwd: Path, ns: dict) -> None:
    assert ek.SAE.load(cwd / "sae").d_sae == ns["sae"].d_sae
    assert ek.FeatureStats.open(cwd / "stats").n_tokens > 0


def _sae_training(cwd: Path, ns: dict) -> None:
    log = json.loads((cwd / "sae" / "training_log.json").read_text())
    assert log
    assert ek.SAE.load(cwd / "sae").d_sae == ns["sae"].d_sae


def _feature_stats(cwd: Path, ns: dict) -> None:
    assert ek.FeatureStats.open(cwd / "stats").n_tokens == ns["stats"].n_tokens


def _corpus(cwd: Path, ns: dict) -> None:
    assert (cwd / "lens.csv").exists() and (cwd / "lens.json").exists()
    assert ek.Activations.open(cwd / "acts").layers == ns["store"].layers


CHECKS: dict[str, Callable[[Path, dict], None]] = {
    "envoys.md": _envoys,
    "lens.md": _lens,
    "tuned_lens.md": _tuned_lens,
    "causal.md": _causal,
    "attention.md": _attention,
    "steering.md": _steering,
    "features.md": _features,
    "sae_training.md": _sae_training,
    "feature_stats.md": _feature_stats,
    "corpus.md": _corpus,
}

PAGES = [
    page
    for page in sorted((ROOT / "docs").glob("*.md"))
    if blocks(page) and page.name not in NOT_RUN
]


def _param(page: Path) -> object:
    marks = [pytest.mark.engine]
    if any(model == "demo" for model, _ in engines_of(page)):
        marks.append(pytest.mark.slow)
    return pytest.param(page, marks=marks, id=page.stem)


def test_every_page_starts_engines_the_suite_shares():
    """Checked without an engine: each page that runs starts an engine, one the suite has, and
    ``NOT_RUN`` names only pages with blocks."""
    for page in PAGES:
        found = engines_of(page)
        assert found, f"{page.name} starts no engine: its first block should"
        assert set(found) <= set(SHARED), f"{page.name}: no shared engine {found}"
    with_blocks = {page.name for page in (ROOT / "docs").glob("*.md") if blocks(page)}
    assert set(NOT_RUN) <= with_blocks


@pytest.mark.parametrize("page", [_param(page) for page in PAGES])
def test_page_examples_run_and_show_their_output(page, request, tmp_path, monkeypatch):
    lend(
        {key: request.getfixturevalue(SHARED[key]) for key in engines_of(page)},
        monkeypatch,
    )
    started = time.monotonic()
    namespace = run_in(page, tmp_path, monkeypatch)
    print(f"{page.name}: {time.monotonic() - started:.1f} s")
    check = CHECKS.get(page.name)
    if check is not None:
        check(tmp_path, namespace)
