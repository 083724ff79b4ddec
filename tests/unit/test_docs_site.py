"""The documentation site builds in strict mode, and its API reference names every public
name: each of ``envoykit.__all__``, and each public method and property of `Engine` and of
the served `Connection` (their members are listed in docs/api.md by hand, since the analyses
are attached as aliases, which the renderer does not show unasked)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import envoykit as ek
from envoykit.serve.client import Connection

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def api_ids(tmp_path_factory) -> set[str]:
    site = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [Path(sys.executable).with_name("mkdocs"), "build", "--strict", "-q", "-d", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stderr
    return set(re.findall(r'id="(envoykit[\w.]+)"', (site / "api" / "index.html").read_text()))


def public(cls: type) -> set[str]:
    """Names a user reaches on ``cls``; nnsight gives every object a ``save``, not ours."""
    return {name for name in set(dir(cls)) - set(dir(object)) if not name.startswith("_")}


@pytest.mark.parametrize(
    ("cls", "path"),
    [(ek.Engine, "envoykit.engine.Engine"), (Connection, "envoykit.serve.client.Connection")],
)
def test_every_public_member_of_an_engine_is_documented(api_ids, cls, path):
    missing = sorted(name for name in public(cls) if f"{path}.{name}" not in api_ids)
    assert not missing, f"docs/api.md does not list {missing} for {path}"


def test_every_top_level_name_is_documented(api_ids):
    documented = {name.rsplit(".", 1)[-1] for name in api_ids}
    missing = sorted(name for name in ek.__all__ if name not in documented)
    assert not missing, f"docs/api.md renders no {missing}"


def test_readme_links_reach_files_and_headings():
    """The README is not part of the site, so its links are checked here: each relative link
    names a file, and a ``#fragment`` one of that page's headings."""
    text = (ROOT / "README.md").read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if "://" in target:
            continue
        path, _, fragment = target.partition("#")
        page = ROOT / path if path else ROOT / "README.md"
        if not page.exists() or (fragment and fragment not in anchors(page.read_text())):
            broken.append(target)
    assert not broken, f"README links to nothing at {broken}"


def anchors(markdown: str) -> set[str]:
    """The ids mkdocs (and GitHub) give the headings of a page, for plain-word headings."""
    headings = re.findall(r"^#+ (.+)$", markdown, re.M)
    return {re.sub(r"[^\w\- ]", "", h).strip().lower().replace(" ", "-") for h in headings}
