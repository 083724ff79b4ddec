"""The compiled reductions (`envoykit.ranks.fused`) against torch's own operations in
float64, where they differ from a plain expression: the first index of the largest value, and
sums over a whole vocabulary's row; and the fallback where nothing compiles.
(`tests/unit/test_lens_statistics.py` checks every statistic computed through them.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from envoykit.ranks import fused


@pytest.fixture(scope="module")
def reductions() -> fused.Reductions:
    if not shutil.which("g++"):
        pytest.skip("no C++ compiler for torch's inductor")
    found = fused.compiled()
    assert found is not None, "the reductions did not compile (see the warning logged)"
    return found


def test_first_index_of_the_largest_value_as_torch_max(reductions):
    """Ties go to the first index, as ``torch.max`` documents; the largest value may be the
    first or the last of a row."""
    rows = torch.randn(6, 49152, generator=torch.Generator().manual_seed(0))
    rows[1, [7, 300, 40000]] = 50.0
    rows[2, 0] = rows[3, -1] = 60.0
    rows[4] = 1.0  # every token tied
    largest, first, *_ = reductions.final_sums(rows)
    assert torch.equal(first.long(), rows.max(-1).indices)
    assert torch.equal(largest[:, 0], rows.max(-1).values)
    _, first, *_ = reductions.layer_sums(rows.view(2, 3, -1), torch.rand(3, rows.shape[1]))
    assert torch.equal(first.flatten().long(), rows.max(-1).indices)


def test_a_row_with_no_largest_value_still_names_a_token(reductions):
    rows = torch.zeros(3, 11)
    rows[1, 4] = torch.nan
    _, first, *_ = reductions.final_sums(rows)
    assert 0 <= int(first[1]) < rows.shape[1]


def test_sums_over_a_whole_vocabulary_keep_float64_accuracy(reductions):
    """Inductor's float32 sums over 49k terms were 4e-6 off relative; accumulated in float64
    the compiled loop stays within float32's own rounding of a float64 reference."""
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(2, 16, 49152, generator=generator) * 4
    final = torch.randn(16, 49152, generator=generator) * 4
    largest, _, exp_sum, weighted, final_exp = reductions.final_sums(final)
    d = final.double() - largest.double()
    # The loop's exp is vectorised: within 2 float32 ulps, or 1e-9 where exp(d) is tiny.
    torch.testing.assert_close(final_exp, d.exp().float(), rtol=2.5e-7, atol=1e-9)
    torch.testing.assert_close(exp_sum, d.exp().sum(-1), rtol=2e-7, atol=0)
    torch.testing.assert_close(weighted, (d.exp() * d).sum(-1), rtol=2e-7, atol=0)
    largest, _, exp_sum, weighted, final_weighted = reductions.layer_sums(rows, final_exp)
    d = rows.double() - largest.double()
    torch.testing.assert_close(exp_sum, d.exp().sum(-1), rtol=2e-7, atol=0)
    torch.testing.assert_close(weighted, (d.exp() * d).sum(-1), rtol=2e-7, atol=0)
    torch.testing.assert_close(final_weighted, (final_exp.double() * d).sum(-1), rtol=2e-7, atol=0)


FALLBACK = """
import logging, sys
import torch
import torch._inductor.config
from envoykit.ranks import fused, lens, vocab_parallel

logging.basicConfig(level=logging.WARNING)
torch._inductor.config.cpp.cxx = (None, "no-such-compiler")
assert fused.compiled() is None
head = torch.nn.Linear(8, 50, bias=False)
streams = [(torch.randn(4, 8), None) for _ in range(3)]
with torch.no_grad():
    got = lens.lens_statistics(
        torch.nn.LayerNorm(8), vocab_parallel.whole(head, 50), streams, None, 1, (), fused=True
    )
    want = lens.lens_statistics(
        torch.nn.LayerNorm(8), vocab_parallel.whole(head, 50), streams, None, 1, ()
    )
assert all(torch.equal(got[key], want[key]) for key in want)
"""


def test_without_a_compiler_the_reductions_fall_back_with_a_warning(tmp_path):
    """A fresh process (nothing compiled or cached) whose inductor names a compiler that is
    not there: one warning, and the statistics of torch's own passes."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", FALLBACK], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("the lens's reductions run uncompiled") == 1, done.stderr[-2000:]
