"""The rank-side pattern (`envoykit.ranks.heads.local_patterns`) against a softmax written out
one query at a time, on random queries and keys: grouped-query sharing, the causal mask, a
sliding window, a soft-cap and sinks each change the result the way the model's kernel does,
so a pattern that ignored any of them would fail here before it met a model."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from envoykit.ranks.heads import local_patterns, query_key
from envoykit.results.attention import AttentionResult

TOKENS, HEADS, KV_HEADS, SIZE = 6, 4, 2, 8


def kernel(scale=0.3, cap=0.0, window=None, sinks=None):
    impl = SimpleNamespace(scale=scale, logits_soft_cap=cap, sinks=sinks)
    return SimpleNamespace(head_size=SIZE, sliding_window=window, impl=impl)


def written_out(q, k, scale, cap=0.0, window=None, sinks=None):
    """Weights ``[heads, T, T]``, one query and one head at a time."""
    q = q.reshape(TOKENS, HEADS, SIZE).double()
    k = k.reshape(TOKENS, KV_HEADS, SIZE).double()
    out = torch.zeros(HEADS, TOKENS, TOKENS, dtype=torch.float64)
    for h in range(HEADS):
        kv = h // (HEADS // KV_HEADS)
        for i in range(TOKENS):
            seen = [j for j in range(i + 1) if window is None or i - j < window]
            logits = []
            for j in seen:
                s = float(q[i, h] @ k[j, kv]) * scale
                logits.append(cap * math.tanh(s / cap) if cap else s)
            extra = [] if sinks is None else [float(sinks[h])]
            top = max(logits + extra)
            norm = sum(math.exp(x - top) for x in logits + extra)
            for j, x in zip(seen, logits):
                out[h, i, j] = math.exp(x - top) / norm
    return out.float()


@pytest.fixture
def qk():
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(TOKENS, HEADS * SIZE, generator=generator) * 2
    k = torch.randn(TOKENS, KV_HEADS * SIZE, generator=generator) * 2
    return q, k


ALL = torch.arange(TOKENS)


@pytest.mark.parametrize(
    "options",
    [{}, {"window": 3}, {"cap": 1.5}, {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])}],
    ids=["causal", "window", "soft-cap", "sinks"],
)
def test_patterns_equal_the_softmax_written_out(qk, options):
    q, k = qk
    got = local_patterns(kernel(**options), q, k, ALL)
    torch.testing.assert_close(got, written_out(q, k, 0.3, **options), atol=1e-6, rtol=0)
    plain = local_patterns(kernel(), q, k, ALL)
    if options:  # each option matters: leaving it out gives another pattern
        assert (got - plain).abs().max() > 1e-3


def test_rows_sum_to_one_and_less_with_sinks(qk):
    q, k = qk
    sums = local_patterns(kernel(), q, k, ALL).sum(-1)
    torch.testing.assert_close(sums, torch.ones_like(sums))
    sunk = local_patterns(kernel(sinks=torch.full((HEADS,), 3.0)), q, k, ALL).sum(-1)
    assert (sunk < 0.99).all()


def test_picked_queries_are_rows_of_the_whole_pattern(qk):
    q, k = qk
    whole = local_patterns(kernel(window=4), q, k, ALL)
    picked = torch.tensor([1, 5])
    torch.testing.assert_close(local_patterns(kernel(window=4), q, k, picked), whole[:, picked])


def test_query_and_key_come_from_arguments_or_keywords():
    q, k, v = torch.zeros(2), torch.ones(2), torch.full((2,), 2.0)
    assert query_key((q, k, v), {})[1] is k
    assert query_key((), {"query": q, "key": k, "value": v})[0] is q


def test_attention_result_checks_and_exports():
    res = AttentionResult.example()
    frame = res.to_pandas()
    assert len(frame) == 4 and frame["weight"].sum() == pytest.approx(2.0)
    assert AttentionResult.from_json(res.to_json()).weights.tolist() == res.weights.tolist()
    with pytest.raises(ValueError, match="sums to more than one"):
        AttentionResult(**{**res.to_dict(), "weights": [[[[1.0, 0.0], [0.5, 0.75]]]]})
    with pytest.raises(KeyError, match="head 3 is not in this result"):
        res.pattern(1, 3)
    assert not res.weights.flags.writeable
    assert np.array_equal(res.pattern(1, 0), res.weights[0, 0])


def test_plot_draws_the_pattern_and_the_grid():
    import matplotlib

    matplotlib.use("Agg")
    from envoykit import plot

    res = AttentionResult.example()
    figure = plot.attention(res, 1, 0)
    image = figure.axes[0].get_images()[0]
    np.testing.assert_array_equal(image.get_array(), res.pattern(1, 0))
    assert [t.get_text() for t in figure.axes[0].get_xticklabels()] == ["a", "␣b"]
    grid = plot.attention(res)
    assert grid.axes[0].get_title() == "head 0"


def test_a_request_that_would_bring_back_too_much_is_refused_with_advice():
    from envoykit.analyses.attention import build_request
    from envoykit.errors import InvalidRequest
    from envoykit.model.heads import HeadLayout

    def tokenizer(text):
        return {"input_ids": list(range(len(text.split())))}

    layout = HeadLayout("attn", "o_proj", 64, 8, 128, (None,) * 80)
    long_prompt = "word " * 1000
    with pytest.raises(InvalidRequest, match=r"would bring back .* MiB: pass top_k="):
        build_request(tokenizer, layout, 80, 4096, long_prompt)
    req = build_request(tokenizer, layout, 80, 4096, long_prompt, queries=range(-64, 0), top_k=8)
    assert req.top_k == 8 and req.queries == tuple(range(936, 1000)) and len(req.heads) == 64


def test_each_rank_sends_its_picked_heads_and_the_gather_puts_them_back_in_order():
    from envoykit.ranks.heads import picked_on_ranks

    heads, n_heads, ranks = [1, 4, 5, 8], 9, 3  # rank 0 holds 0-2, rank 1 3-5, rank 2 6-8
    mine, places = picked_on_ranks(heads, n_heads, ranks)
    assert mine == [[1, 0], [1, 2], [2, 0]]  # two wide: rank 1 holds two of them
    sent = [[r * 3 + i for i in m] for r, m in enumerate(mine)]  # the whole-model heads sent
    flat = [h for rank in sent for h in rank]
    assert [flat[i] for i in places] == heads
    assert picked_on_ranks([0], 4, 1) == ([[0]], [0])
