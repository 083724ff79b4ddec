"""Attention patterns of the real `demo` checkpoint at TP=3 (three ranks, three heads each)
against transformers' eager attention in float32: within 1e-5 at every layer, every head and
every query (measured: at most 4e-6)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PROMPT = "The capital of France is Paris, and the capital of Italy is Rome. The capital of Spain is"


def test_demo_patterns_at_tp3_equal_transformers_eager(demo3):
    from transformers import AutoModelForCausalLM

    res = demo3.attention(PROMPT)
    model = AutoModelForCausalLM.from_pretrained(
        demo3.info.path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        ids = torch.tensor([demo3.tokenizer(PROMPT)["input_ids"]])
        eager = torch.stack(model(ids, output_attentions=True).attentions)[:, 0].numpy()
    assert res.weights.shape == eager.shape == (30, 9, ids.shape[1], ids.shape[1])
    np.testing.assert_allclose(res.weights, eager, atol=1e-5, rtol=0)
    np.testing.assert_allclose(res.weights.sum(-1), 1.0, atol=1e-5)
    # Heads picked across the ranks come back sorted, each computed on its own rank.
    picked = demo3.attention(PROMPT, layers=[7], heads=[8, 0, 4], queries=[-1])
    np.testing.assert_allclose(picked.weights[0, :, 0], eager[6, [0, 4, 8], -1], atol=1e-5)
