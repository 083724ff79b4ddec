"""The Python examples of the README and of docs/ are Python that ruff accepts: each fenced
``python`` block compiles and passes ``ruff check`` (the pages' own layout of aligned comments
is kept, so ruff's formatter is not applied to them). ``tests/test_doc_examples.py`` runs them
on engines; this checks every block with none, those it leaves out (its ``NOT_RUN``) too."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# What a fragment of a longer session may do: use names an earlier block defined, and show
# a value by naming it.
IGNORED = "F821,B018"


def blocks() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for i, match in enumerate(FENCE.finditer(doc.read_text())):
            found.append((f"{doc.name}[{i}]", match.group(1)))
    return found


@pytest.mark.parametrize(("where", "code"), blocks(), ids=[w for w, _ in blocks()])
def test_block_compiles_and_passes_ruff(where, code):
    compile(code, where, "exec")
    done = subprocess.run(
        [
            Path(sys.executable).with_name("ruff"),
            "check",
            "--ignore",
            IGNORED,
            "--stdin-filename",
            f"{where}.py",
            "-",
        ],
        input=code,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout
