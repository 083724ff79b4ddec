"""The logit lens against an independent reference: plain transformers in float32.

Tolerances: top-1 per layer x position identical, top-k sets equal (up to ties within the
tolerance at the k-th place), probabilities and entropy within 1e-4 absolute, KL within 1e-4
absolute or relative (early layers sit ~100 nats from the final distribution on the demo
model, where float32 sums over 49k logits differ by ~3e-5 relative); the last layer is the
model's own next-token distribution: the same top-k tokens, probabilities to float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference import lens_logits

import envoykit as ek

pytestmark = pytest.mark.engine

PROMPT = "The capital of France is"
TOL = 1e-4


def reference_statistics(path: str, prompt: str, top_k: int, targets: list[int]) -> dict:
    logits, ids = lens_logits(path, prompt)
    logp = torch.log_softmax(logits.double(), dim=-1)
    final = logp[-1]
    top = logp.topk(top_k, dim=-1)
    return {
        "ids": ids,
        "top_ids": top.indices.numpy(),
        "top_probs": top.values.exp().numpy(),
        "entropy": -(logp.exp() * logp).sum(-1).numpy(),
        "kl": (final.exp() * (final - logp)).sum(-1).numpy(),
        "target_probs": logp[..., targets].exp().numpy(),
        "target_ranks": np.stack(
            [(logp > logp[..., t : t + 1]).sum(-1).numpy() for t in targets], -1
        ),
    }


def assert_matches_reference(res: ek.LensResult, ref: dict) -> None:
    assert res.token_ids.tolist() == ref["ids"]
    rows = res.layers  # layer 0 is the embedding, row 0 of the reference too
    # The top-1 token must agree; deeper ranks may swap where probabilities tie within tolerance.
    np.testing.assert_array_equal(res.top_ids[..., 0], ref["top_ids"][rows, :, 0])
    for li, layer in enumerate(rows):
        for pi in range(len(res.positions)):
            ours, theirs = set(res.top_ids[li, pi]), set(ref["top_ids"][layer, pi])
            if ours != theirs:  # only a tie at the k-th place may differ
                edge = ref["top_probs"][layer, pi, -1]
                assert np.all(np.abs(res.top_probs[li, pi, -2:] - edge) <= TOL)
    np.testing.assert_allclose(res.top_probs, ref["top_probs"][rows], atol=TOL)
    np.testing.assert_allclose(res.entropy, ref["entropy"][rows], atol=TOL)
    np.testing.assert_allclose(res.kl, ref["kl"][rows], atol=TOL, rtol=TOL)
    np.testing.assert_allclose(res.target_probs, ref["target_probs"][rows], atol=TOL)
    np.testing.assert_array_equal(res.target_ranks, ref["target_ranks"][rows])


class TestAgainstTransformers:
    """Every statistic equals an independent float32 transformers lens."""

    @pytest.mark.parametrize("tp", [1, 2])
    def test_tiny(self, tiny_engines, tp):
        engine = tiny_engines[tp]
        res = engine.lens(PROMPT, layers=["embed", "all"], top_k=5, targets=[" Paris", 7])
        targets = [int(t) for t in res.target_ids]
        assert_matches_reference(res, reference_statistics(engine.info.path, PROMPT, 5, targets))

    def test_tp2_equals_tp1(self, tiny_engines):
        one, two = (tiny_engines[tp].lens(PROMPT, layers="all", top_k=5) for tp in (1, 2))
        np.testing.assert_array_equal(one.top_ids, two.top_ids)
        np.testing.assert_allclose(one.top_probs, two.top_probs, atol=1e-5)

    def test_float64_reductions_across_ranks(self, tiny2):
        """The ranks exchange their summaries in the reduction's dtype, float64 included."""
        res = tiny2.lens(
            PROMPT, layers=["embed", "all"], top_k=5, targets=[" Paris"], reduce_dtype="float64"
        )
        targets = [int(t) for t in res.target_ids]
        assert_matches_reference(res, reference_statistics(tiny2.info.path, PROMPT, 5, targets))

    @pytest.mark.slow
    def test_demo_tp3(self, demo3):
        res = demo3.lens(PROMPT, layers=["embed", "all"], top_k=5, targets=[" Paris"])
        targets = [int(t) for t in res.target_ids]
        assert_matches_reference(res, reference_statistics(demo3.info.path, PROMPT, 5, targets))
        assert res.top1(-1)[-1][1] == " Paris"


class TestLastLayerIsTheModel:
    """The last layer's lens is the model's own next-token distribution: the same top-k
    tokens, and probabilities to float32 rounding (each rank normalises its slice of the
    vocabulary and the ranks combine their normalisers, where ``log_softmax`` of the whole
    logits rounds once)."""

    @staticmethod
    def model_distribution(engine: ek.Engine) -> torch.Tensor:
        with engine.trace(PROMPT):
            logits = engine.model.logits.save()
        return torch.log_softmax(logits[-1].float(), dim=-1)

    def check(self, engine: ek.Engine) -> None:
        res = engine.lens(PROMPT, layers=[-1], top_k=5)
        top = self.model_distribution(engine).topk(5)
        assert res.top_ids[0, -1].tolist() == top.indices.tolist()
        np.testing.assert_allclose(res.top_probs[0, -1], top.values.exp().numpy(), rtol=1e-6)
        assert res.kl[0, -1] == 0.0

    @pytest.mark.parametrize("tp", [1, 2])
    def test_float32(self, tiny_engines, tp):
        self.check(tiny_engines[tp])

    def test_bfloat16(self, tiny2_bf16):
        self.check(tiny2_bf16)


class TestRequestShapes:
    """Layers, positions, several prompts and generation give the shapes asked for."""

    def test_layer_and_position_selection(self, tiny2):
        res = tiny2.lens(PROMPT, layers=[3, 1, -1, 1], positions=[-1, 0], top_k=3)
        assert res.layers.tolist() == [1, 3, 4]
        assert res.positions.tolist() == [0, len(tiny2.tokenizer(PROMPT)["input_ids"]) - 1]
        assert res.top_ids.shape == (3, 2, 3)
        full = tiny2.lens(PROMPT, layers="all", top_k=3)
        np.testing.assert_allclose(
            res.top_probs, full.select([1, 3, 4], res.positions.tolist()).top_probs, atol=1e-6
        )

    def test_several_prompts_one_result_each(self, tiny2):
        prompts = ["The cat sat", "One two three four five"]
        results = tiny2.lens(prompts, top_k=2)
        assert [r.prompt for r in results] == prompts
        for prompt, res in zip(prompts, results):
            alone = tiny2.lens(prompt, top_k=2)
            np.testing.assert_array_equal(res.top_ids, alone.top_ids)

    def test_generation_lenses_generated_tokens(self, tiny2):
        res = tiny2.lens(PROMPT, generate=3, top_k=2)
        n_prompt = len(tiny2.tokenizer(PROMPT)["input_ids"])
        assert res.n_generated == 3 and len(res.positions) == n_prompt + 3
        generated = tiny2.generate_ids(PROMPT, 3)
        assert res.token_ids[n_prompt:].tolist() == generated
        # greedy: each position's final-layer top-1 is the next input token
        assert res.top_ids[-1, n_prompt - 1 : -1, 0].tolist() == generated

    def test_chunked_lens_equals_one_call(self, tiny2):
        from envoykit.analyses import lens_run, request

        info = tiny2.info
        req = request.build_request(tiny2.tokenizer, info.n_layers, info.vocab, 256, PROMPT)
        args = (tiny2.model, tiny2.readout, req, tiny2._result_meta(), tiny2.exclusive)
        whole = lens_run.run(*args)[0]
        one_layer_per_call = lens_run.run(*args, budget=1)[0]
        np.testing.assert_array_equal(whole.top_ids, one_layer_per_call.top_ids)
        np.testing.assert_allclose(whole.kl, one_layer_per_call.kl, atol=1e-6)
