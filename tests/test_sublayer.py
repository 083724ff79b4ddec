"""Sub-layer lens sites and direct logit attribution against plain transformers in float32.

Tolerances: sub-layer lens statistics as for the residual lens (1e-4, see test_lens.py);
attribution contributions within 1e-4 relative to the largest |logit| (float32 sums of
products over d_model); ``values.sum(0)`` equals the logits within 1e-4 relative, at TP=1 and
TP=2, and TP=2 equals TP=1 within 1e-5 relative.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import attribution, lens_logits, sublayer_logits

import envoykit as ek

pytestmark = pytest.mark.engine

PROMPT = "The capital of France is"
TOL = 1e-4


def statistics(logits: torch.Tensor, final: torch.Tensor, top_k: int) -> dict[str, np.ndarray]:
    """The lens statistics of ``[rows, positions, vocab]`` logits, in float64."""
    logp = torch.log_softmax(logits.double(), -1)
    final_logp = torch.log_softmax(final.double(), -1)
    top = logp.topk(top_k, -1)
    return {
        "top_ids": top.indices.numpy(),
        "top_probs": top.values.exp().numpy(),
        "entropy": -(logp.exp() * logp).sum(-1).numpy(),
        "kl": (final_logp.exp() * (final_logp - logp)).sum(-1).numpy(),
    }


class TestSublayerSites:
    """Each site's rows equal a transformers lens read at the same place."""

    @pytest.mark.parametrize("tp", [1, 2])
    @pytest.mark.parametrize("site", ["resid_mid", "attn", "mlp"])
    def test_site_matches_transformers(self, tiny_engines, tp, site):
        engine = tiny_engines[tp]
        res = engine.lens(PROMPT, sites=[site], top_k=5)
        reference = sublayer_logits(engine.info.path, PROMPT, site)
        final = lens_logits(engine.info.path, PROMPT)[0][-1]  # the last layer's, every position
        ref = statistics(reference, final, 5)
        assert res.sites == (site,) * engine.info.n_layers
        np.testing.assert_array_equal(res.top_ids[..., 0], ref["top_ids"][..., 0])
        np.testing.assert_allclose(res.top_probs, ref["top_probs"], atol=TOL)
        np.testing.assert_allclose(res.entropy, ref["entropy"], atol=TOL)
        np.testing.assert_allclose(res.kl, ref["kl"], atol=TOL, rtol=TOL)

    def test_rows_are_labelled_and_ordered_as_computed(self, tiny2):
        res = tiny2.lens(PROMPT, layers=["embed", 1, 2], sites=["resid", "mlp", "attn"])
        assert res.layer_labels == ["embed", "1.attn", "1.mlp", "1", "2.attn", "2.mlp", "2"]
        assert res.select(sites=["mlp"]).layer_labels == ["1.mlp", "2.mlp"]
        frame = res.to_pandas()
        assert set(frame["site"]) == {"resid", "attn", "mlp"}
        again = ek.LensResult.from_json(res.to_json())
        assert again.sites == res.sites
        np.testing.assert_array_equal(again.top_probs, res.top_probs)

    def test_resid_mid_of_layer_plus_mlp_is_the_layer(self, tiny2):
        """At every layer, the stream between the blocks plus the MLP's write is the stream
        after the layer, and the stream before it plus the attention's write is the stream
        between (read whole at TP=2, as every analysis reads them)."""
        import nnsight

        from envoykit.model.readout import at, walk

        n, readout, model = tiny2.info.n_layers, tiny2.readout, tiny2.model
        reads = {0: {"resid"}} | {k: {"attn", "resid_mid", "mlp", "resid"} for k in range(1, n + 1)}
        with tiny2.trace(PROMPT):
            rows = walk(readout, at(model, readout.layers), reads, {})
            values = nnsight.save([(v if r is None else v + r).cpu() for v, r in rows])
        before = values[0]
        for k in range(n):
            attn, mid, mlp, after = values[1 + 4 * k : 5 + 4 * k]
            torch.testing.assert_close(mid + mlp, after, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(before + attn, mid, atol=1e-5, rtol=1e-5)
            assert not torch.allclose(mid, after)  # the MLP wrote something
            before = after

    def test_last_layer_beside_sublayer_rows_is_the_models_distribution(self, tiny2):
        """The last layer's ``resid`` row, with sub-layer rows beside it, is the model's own
        next-token distribution (its logits from the same engine, softmaxed here)."""
        import nnsight

        res = tiny2.lens(PROMPT, layers=[-1], sites=["resid_mid", "resid"], top_k=5)
        with tiny2.trace(PROMPT):
            logits = nnsight.save(tiny2.model.logits.cpu())
        probs = torch.softmax(logits.double().reshape(-1, logits.shape[-1])[-1], -1).numpy()
        last = res.select(sites=["resid"])
        np.testing.assert_allclose(
            last.top_probs[0, -1], probs[last.top_ids[0, -1]], atol=1e-6, rtol=0
        )

    def test_unknown_site_is_refused_and_engine_answers(self, tiny2):
        with pytest.raises(ek.InvalidRequest, match="unknown site"):
            tiny2.lens(PROMPT, sites=["resid", "ffn"])
        with pytest.raises(ek.InvalidRequest, match="only the 'resid' site"):
            tiny2.lens(PROMPT, layers=["embed"], sites=["attn"])
        assert tiny2.lens(PROMPT, layers=[1]).layers.tolist() == [1]


class TestAttribution:
    """Contributions sum to the logit and equal a transformers computation."""

    TARGETS = (5, 17, 101)

    @pytest.mark.parametrize("tp", [1, 2])
    def test_sums_to_logits_and_matches_transformers(self, tiny_engines, tp):
        engine = tiny_engines[tp]
        res = engine.attribute(PROMPT, self.TARGETS)
        values, logits = attribution(engine.info.path, PROMPT, list(self.TARGETS))
        scale = float(logits.abs().max())
        assert res.components[:3] == ("embed", "attn 1", "mlp 1")
        assert res.values.shape == (1 + 2 * engine.info.n_layers, len(res.positions), 3)
        np.testing.assert_allclose(res.values.sum(0), res.logits, atol=TOL * scale)
        np.testing.assert_allclose(res.values, values.numpy(), atol=TOL * scale)
        np.testing.assert_allclose(res.logits, logits.numpy(), atol=TOL * scale)
        np.testing.assert_allclose(res.model_logits, res.logits, atol=TOL * scale)

    def test_tp2_equals_tp1(self, tiny_engines):
        one = tiny_engines[1].attribute(PROMPT, self.TARGETS, positions=[-1])
        two = tiny_engines[2].attribute(PROMPT, self.TARGETS, positions=[-1])
        scale = float(np.abs(one.values).max())
        np.testing.assert_allclose(two.values, one.values, atol=1e-5 * scale)

    def test_diff_export_and_round_trip(self, tiny2):
        res = tiny2.attribute(PROMPT, list(self.TARGETS[:2]), positions=[-2, -1])
        n_tokens = len(tiny2.tokenizer(PROMPT)["input_ids"])
        assert res.positions.tolist() == [n_tokens - 2, n_tokens - 1]
        diff = res.diff(self.TARGETS[0], self.TARGETS[1])
        np.testing.assert_allclose(diff.sum(0), res.logits[:, 0] - res.logits[:, 1], atol=1e-4)
        frame = res.to_pandas()
        assert len(frame) == res.values.size
        again = ek.AttributionResult.from_json(res.to_json())
        np.testing.assert_array_equal(again.values, res.values)

    def test_multi_token_target_is_refused_with_its_tokens(self, tiny2):
        with pytest.raises(ek.InvalidRequest, match="tokens"):
            tiny2.attribute(PROMPT, ["the capital of France"])
        with pytest.raises(ek.InvalidRequest, match="at least one target"):
            tiny2.attribute(PROMPT, [])
        assert tiny2.attribute(PROMPT, [5]).values.shape[-1] == 1
