"""Activation patching and causal-tracing sweeps against plain transformers in float32.

Tolerances: a patched run's final distribution equals transformers with the same patch made
by a forward hook within 1e-4 (probabilities, entropy); TP=2 equals TP=1 within 1e-5; a
sweep cell equals the patched lens of that one cell within 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import patched_final_logits

import envoykit as ek

pytestmark = pytest.mark.engine

SOURCE = "The capital of France is"
TARGET = "The capital of Italy is"  # as many tokens as SOURCE on tiny
TOL = 1e-4


def final_distribution(res: ek.LensResult) -> tuple[np.ndarray, np.ndarray]:
    """Top-k probabilities and entropy of the last layer, every position."""
    last = res.select(layers=[int(res.layers[-1])])
    return last.top_probs[0], last.entropy[0]


class TestPatch:
    """A patched lens is the lens of the patched run."""

    @pytest.mark.parametrize("tp", [1, 2])
    @pytest.mark.parametrize(("layer", "site"), [(2, "resid"), (1, "mlp"), (2, "attn")])
    def test_matches_transformers(self, tiny_engines, tp, layer, site):
        engine = tiny_engines[tp]
        patch = ek.Patch(SOURCE, layer, source_position=-2, target_position=-2, site=site)
        res = engine.lens(TARGET, layers=[-1], top_k=5, patch=patch)
        logits = patched_final_logits(engine.info.path, SOURCE, TARGET, layer, -2, -2, site)
        logp = torch.log_softmax(logits.double(), -1)
        top = logp.topk(5, -1)
        np.testing.assert_array_equal(res.top_ids[0], top.indices.numpy())
        np.testing.assert_allclose(res.top_probs[0], top.values.exp().numpy(), atol=TOL)
        np.testing.assert_allclose(res.entropy[0], -(logp.exp() * logp).sum(-1), atol=TOL)
        assert res.meta["patches"][0]["layer"] == layer

    def test_patch_changes_only_what_follows(self, tiny2):
        plain = tiny2.lens(TARGET, top_k=3)
        patched = tiny2.lens(TARGET, top_k=3, patch=ek.Patch(SOURCE, 2, -2, -2))
        # Earlier layers and earlier positions are untouched; the patched cell changes.
        np.testing.assert_array_equal(
            patched.select(layers=[1]).top_probs, plain.select(layers=[1]).top_probs
        )
        np.testing.assert_array_equal(patched.top_probs[:, :-2], plain.top_probs[:, :-2])
        assert not np.allclose(patched.top_probs[1:, -2], plain.top_probs[1:, -2])

    def test_whole_final_stream_copies_the_prediction(self, tiny2):
        source = tiny2.lens(SOURCE, layers=[-1])
        patched = tiny2.lens(TARGET, layers=[-1], patch=ek.Patch(SOURCE, -1))
        np.testing.assert_array_equal(patched.top_ids[0, -1], source.top_ids[0, -1])
        np.testing.assert_allclose(patched.top_probs[0, -1], source.top_probs[0, -1], atol=1e-6)

    def test_several_patches_and_the_embedding(self, tiny2):
        """Two patches in one run: the embedding at position 3 and layer 1's attention write
        at position 4 (where the prompts' tokens differ); each takes effect."""
        embed = ek.Patch(SOURCE, "embed", 3, 3)
        attn = ek.Patch(SOURCE, 1, 4, 4, site="attn")
        both = tiny2.lens(TARGET, layers=["embed", 1], sites=["attn", "resid"], patch=[embed, attn])
        alone = tiny2.lens(TARGET, layers=["embed", 1], sites=["attn", "resid"], patch=embed)
        source = tiny2.lens(SOURCE, layers=[1], sites=["attn"])
        embedded = tiny2.lens(SOURCE, layers=["embed"])
        np.testing.assert_array_equal(both.top_ids[0, 3], embedded.top_ids[0, 3])
        # The attention row of layer 1 at position 4 is the source's write there ...
        row = both.select(layers=[1], sites=["attn"])
        np.testing.assert_allclose(row.top_probs[0, 4], source.top_probs[0, 4], atol=1e-6)
        # ... which the run with the embedding patch alone does not have.
        without = alone.select(layers=[1], sites=["attn"])
        assert not np.allclose(without.top_probs[0, 4], source.top_probs[0, 4], atol=1e-4)
        assert len(both.meta["patches"]) == 2

    def test_tp2_equals_tp1(self, tiny_engines):
        patch = ek.Patch(SOURCE, 3, -2, -1, site="resid_mid")
        one, two = (tiny_engines[tp].lens(TARGET, top_k=3, patch=patch) for tp in (1, 2))
        np.testing.assert_array_equal(one.top_ids, two.top_ids)
        np.testing.assert_allclose(one.top_probs, two.top_probs, atol=1e-5)

    @pytest.mark.parametrize(
        ("patch", "message"),
        [
            (ek.Patch(SOURCE, 2, source_position=40), "source position 40 is outside"),
            (ek.Patch(SOURCE, 2, target_position=-40), "target position -40 is outside"),
            (ek.Patch(SOURCE, 9), "layer 9 does not exist"),
            (ek.Patch(SOURCE, "embed", site="mlp"), "only the 'resid' site"),
            (ek.Patch(SOURCE, 1, site="ffn"), "unknown site"),
            ("not a patch", "takes ek.Patch"),
        ],
    )
    def test_bad_patch_is_refused_and_engine_answers(self, tiny2, patch, message):
        before = tiny2.lens(TARGET, layers=[1])
        with pytest.raises(ek.InvalidRequest, match=message):
            tiny2.lens(TARGET, layers=[1], patch=patch)
        np.testing.assert_array_equal(tiny2.lens(TARGET, layers=[1]).top_ids, before.top_ids)


class TestSweep:
    """Each sweep cell is the patched run of that one cell."""

    def test_cells_equal_single_patches(self, tiny2):
        token = int(tiny2.lens(SOURCE, layers=[-1], top_k=1).top_ids[0, -1, 0])
        res = tiny2.patch_sweep(
            SOURCE,
            TARGET,
            layers=[1, 3],
            positions=[-2, -1],
            target_token=token,
            batch=3,
            progress=False,
        )
        assert res.values.shape == (2, 2)
        for li, layer in enumerate(res.layers):
            for pi, position in enumerate(res.positions):
                patch = ek.Patch(SOURCE, int(layer), int(position), int(position))
                single = tiny2.lens(TARGET, layers=[-1], targets=[token], patch=patch)
                assert abs(res.values[li, pi] - single.target_probs[0, -1, 0]) < 1e-5
        plain = tiny2.lens(TARGET, layers=[-1], targets=[token])
        source = tiny2.lens(SOURCE, layers=[-1], targets=[token])
        assert abs(res.clean - plain.target_probs[0, -1, 0]) < 1e-5
        assert abs(res.source_value - source.target_probs[0, -1, 0]) < 1e-5

    def test_head_sweep_cells_equal_single_head_patches(self, tiny2):
        """A layers x heads map: each cell copies one head's output at every position, the
        same as a lens patched with one head patch per position."""
        token = int(tiny2.lens(SOURCE, layers=[-1], top_k=1).top_ids[0, -1, 0])
        res = tiny2.patch_sweep(
            SOURCE, TARGET, layers=[2, 4], site="head", target_token=token, batch=3, progress=False
        )
        n_heads = tiny2.info.n_heads
        assert res.values.shape == (2, n_heads) and res.heads.tolist() == list(range(n_heads))
        n_tokens = len(tiny2.tokenizer(TARGET)["input_ids"])
        for li, layer in enumerate(res.layers.tolist()):
            for head in (0, n_heads - 1):
                patches = [
                    ek.Patch(SOURCE, layer, p, p, site="head", head=head) for p in range(n_tokens)
                ]
                single = tiny2.lens(TARGET, layers=[-1], targets=[token], patch=patches)
                assert abs(res.values[li, head] - single.target_probs[0, -1, 0]) < 1e-5
        assert not np.allclose(res.values, res.clean, atol=1e-6)  # some head matters
        frame = res.to_pandas()
        assert len(frame) == 2 * n_heads and set(frame.columns) >= {"layer", "head", "effect"}
        assert ek.SweepResult.from_json(res.to_json()).heads.tolist() == res.heads.tolist()
        ek.plot.sweep(res)

    def test_logit_diff_export_and_round_trip(self, tiny2):
        res = tiny2.patch_sweep(
            SOURCE,
            TARGET,
            layers=[-1],
            metric="logit_diff",
            target_token=5,
            other_token=17,
            progress=False,
        )
        assert abs(res.values[0, -1] - res.source_value) < 1e-4  # the whole final stream
        assert len(res.to_pandas()) == res.values.size
        again = ek.SweepResult.from_json(res.to_json())
        np.testing.assert_array_equal(again.values, res.values)

    @pytest.mark.parametrize(
        ("kwargs", "message"),
        [
            ({"target": "The capital of the United Kingdom is"}, "as many tokens"),
            ({"layers": []}, "empty sweep"),
            ({"positions": []}, "empty sweep"),
            ({"positions": [40]}, "outside the prompt"),
            ({"metric": "logit_diff"}, "needs other_token"),
            ({"metric": "kl"}, "metric must be one of"),
        ],
    )
    def test_bad_sweep_is_refused(self, tiny2, kwargs, message):
        call = {"target": TARGET, "target_token": 5, "progress": False, **kwargs}
        with pytest.raises(ek.InvalidRequest, match=message):
            tiny2.patch_sweep(SOURCE, **call)
        assert tiny2.generate(TARGET, 2)


@pytest.mark.slow
def test_france_into_italy_flips_the_prediction_on_demo(demo3):
    """The issue's check on the demo model at its multi-rank TP: the last layer's stream at
    the last position, copied from France, makes the Italy prompt predict ' Paris'."""
    italy = "The capital of Italy is"
    plain = demo3.lens(italy, layers=[-1], targets=[" Paris"])
    patch = ek.Patch("The capital of France is", layer=-1, source_position=-1, target_position=-1)
    patched = demo3.lens(italy, layers=[-1], targets=[" Paris"], patch=patch)
    assert demo3.info.tp > 1
    assert plain.top1(-1)[0][1] != " Paris"
    assert patched.top1(-1)[0][1] == " Paris"
    assert patched.target(" Paris").rank[0, -1] == 0
