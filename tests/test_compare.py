"""Two runs compared cell by cell on the ranks, against independent references.

Tolerances: JS divergence between two prompts equals a float64 transformers computation
within 1e-6 nats; a run against itself on another TP size differs by less than 1e-9 nats
(float32 rounding of the forward passes); identical rows (before a patch, or a run against
itself) by less than 1e-12 nats (float64 rounding of the mixture).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from reference import lens_logits

import envoykit as ek

pytestmark = pytest.mark.engine

A = "The capital of France is"
B = "The capital of Italy is"  # as many tokens as A on tiny


def js_reference(path: str) -> np.ndarray:
    """``[layers + 1, positions]`` JS divergence of A's and B's lens, float64 transformers."""
    pa, pb = (torch.log_softmax(lens_logits(path, p)[0].double(), -1) for p in (A, B))
    mixture = torch.logaddexp(pa, pb) - math.log(2)
    return (
        0.5 * ((pa.exp() * (pa - mixture)).sum(-1) + (pb.exp() * (pb - mixture)).sum(-1))
    ).numpy()


class TestCompare:
    @pytest.mark.parametrize("tp", [1, 2])
    def test_two_prompts_match_transformers(self, tiny_engines, tp):
        engine = tiny_engines[tp]
        res = engine.lens([A, B], compare=True, targets=[5])
        np.testing.assert_allclose(res.js, js_reference(engine.info.path), atol=1e-6)
        lens_a, lens_b = engine.lens([A, B], layers=["embed", "all"], targets=[5])
        np.testing.assert_array_equal(res.top_ids_a, lens_a.top_ids[..., 0])
        np.testing.assert_array_equal(res.top_ids_b, lens_b.top_ids[..., 0])
        np.testing.assert_allclose(
            res.delta(5), lens_b.target_probs[..., 0] - lens_a.target_probs[..., 0], atol=1e-6
        )

    def test_run_against_its_patched_run(self, tiny2):
        patch = ek.Patch(A, 2, source_position=-2, target_position=-2)
        res = ek.compare((tiny2, B), (tiny2, B, patch), layers="all")
        # Identical rows: zero up to float64 rounding of the mixture (~1e-17 nats).
        assert float(res.js[:1].max()) < 1e-12  # layer 1 comes before the patch
        assert float(res.js[:, :-2].max()) < 1e-12  # earlier positions too
        assert float(res.js[1, -2]) > 1e-6  # the patched cell itself
        patched = tiny2.lens(B, patch=patch)
        np.testing.assert_array_equal(res.top_ids_b, patched.top_ids[..., 0])

    def test_tp1_against_tp2_is_one_call(self, tiny_engines):
        res = ek.compare((tiny_engines[1], A), (tiny_engines[2], A))
        assert "tp=1" in res.a and "tp=2" in res.b
        assert float(res.js.max()) < 1e-9
        np.testing.assert_array_equal(res.top_ids_a, res.top_ids_b)
        assert len(res.to_pandas()) == res.js.size
        again = ek.CompareResult.from_json(res.to_json())
        np.testing.assert_array_equal(again.js, res.js)

    def test_float32_against_bfloat16(self, tiny2, tiny2_bf16):
        res = ek.compare((tiny2, A), (tiny2_bf16, A))
        same = ek.compare((tiny2, A), (tiny2, A))
        assert "bfloat16" in res.b
        assert float(same.js.max()) < 1e-12
        assert 1e-9 < float(res.js.max()) < math.log(2)

    @pytest.mark.parametrize(
        ("call", "message"),
        [
            (lambda e: ek.compare((e, A), (e, "The capital of Spain is")), "as many tokens"),
            (lambda e: ek.compare((e, A), (e, A), positions=[30]), "outside the prompt"),
            (lambda e: ek.compare((e, A), "not a run"), "compare takes"),
            (lambda e: e.lens([A], compare=True), "two prompts"),
        ],
    )
    def test_bad_comparison_is_refused(self, tiny2, call, message):
        with pytest.raises(ek.InvalidRequest, match=message):
            call(tiny2)
        assert tiny2.generate(A, 2)
