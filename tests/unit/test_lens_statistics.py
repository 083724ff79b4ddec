"""The lens's reductions, on a toy norm and head, against a direct float64 computation.

What runs on every rank (`envoykit.ranks.lens.lens_statistics`) is plain torch once it is handed
a norm, a head and the per-layer streams: here the norm is a fused add-norm in miniature that
writes its sum into its input, as vLLM's may, and the head a bias-free linear layer. The
reference shares no code with envoykit: probabilities from ``softmax``, entropy and KL from
``torch.distributions``, top-k and ranks from a full sort. Split across ranks, the head's
vocabulary is cut into uneven slices, one per thread, and the threads exchange their
summaries through a barrier as the ranks' all-gather would.
"""

from __future__ import annotations

import copy
import itertools
import math
import shutil
import tempfile
import threading

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from envoykit.ranks import cancel, lens, messages, vocab_parallel
from envoykit.ranks import fused as fused_reductions

D_MODEL, VOCAB, N_POS, TOP_K = 16, 37, 6, 5
TARGETS = [3, 11, 36]
EPS = 1e-6


class ToyAddNorm(torch.nn.Module):
    """``norm(x)`` or ``norm(x, residual) -> (norm(x + residual), x + residual)``, the sum
    written into ``x`` in place as vLLM's fused kernel may do."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(D_MODEL, generator=seeded(1)) + 0.5)

    def forward(self, x, residual=None):
        if residual is not None:
            x.add_(residual)
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * self.weight
        return normed if residual is None else (normed, x)


class CountingHead(torch.nn.Linear):
    """The unembedding, counting its calls (each is one chunk of layers). Ranks are
    threads here, and ``calls += 1`` is a read then a write that two threads can interleave
    (one CI run counted 1 call of 2), so each call appends to a list: one atomic step."""

    def __init__(self) -> None:
        super().__init__(D_MODEL, VOCAB, bias=False)
        with torch.no_grad():
            self.weight.copy_(torch.randn(VOCAB, D_MODEL, generator=seeded(2)) * 2)
        self.shapes: list[torch.Size] = []

    @property
    def calls(self) -> int:
        return len(self.shapes)

    def forward(self, x):
        self.shapes.append(x.shape)
        return super().forward(x)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def toy_streams(n_layers: int = 4) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The embedding (a lone vector) then one ``(hidden, residual)`` pair per layer."""
    g = seeded(3)
    streams = [(torch.randn(N_POS, D_MODEL, generator=g), None)]
    for _ in range(n_layers):
        streams.append(
            (torch.randn(N_POS, D_MODEL, generator=g), torch.randn(N_POS, D_MODEL, generator=g))
        )
    return streams


def statistics(
    streams,
    positions=None,
    top_k=TOP_K,
    targets=TARGETS,
    dtype=torch.float32,
    budget=None,
    head=None,
    shard=None,
    cancel=None,
    fused=False,
):
    """The one call of `lens_statistics` every test goes through, as a rank makes it:
    ``(norm, shard, streams, positions, top_k, targets, dtype, budget=...)``; the shard is
    the whole of ``head`` unless given; ``budget=None`` leaves the default (no chunking at
    these sizes); ``fused``: the compiled reductions (`envoykit.ranks.fused`)."""
    head = head if head is not None else CountingHead()
    shard = shard if shard is not None else vocab_parallel.whole(head, VOCAB)
    kwargs = {} if budget is None else {"budget": budget}
    with torch.no_grad():
        return lens.lens_statistics(
            ToyAddNorm(),
            shard,
            streams,
            positions,
            top_k,
            targets,
            dtype,
            cancel=cancel,
            fused=fused,
            **kwargs,
        )


def on_ranks(n_ranks: int, head=None, **kwargs) -> list[dict[str, torch.Tensor]]:
    """`statistics` on ``n_ranks`` threads, each holding one uneven slice of the head's
    vocabulary; every thread's result."""
    results = outcomes_on_ranks(n_ranks, head, **kwargs)
    assert all(isinstance(result, dict) for result in results), f"a rank failed: {results}"
    return results


def slice_bounds(n_ranks: int) -> list[int]:
    """Where each rank's uneven slice of the vocabulary starts, then the vocabulary's end."""
    return [round(VOCAB * r / n_ranks) + (r > 0) for r in range(n_ranks)] + [VOCAB]


def outcomes_on_ranks(n_ranks: int, head=None, exchanges=None, work=None, **kwargs) -> list:
    """`on_ranks`, with each thread's error in place of its result where it raised;
    ``exchanges``: a list that gets each exchange's number of values, per rank; ``work``:
    what each rank runs with its ``shard=`` in place of `statistics`."""
    head = head if head is not None else CountingHead()
    bounds = slice_bounds(n_ranks)
    board: list = [None] * n_ranks
    barrier = threading.Barrier(n_ranks, timeout=30)

    def shard(rank: int) -> vocab_parallel.VocabShard:
        start, end = bounds[rank], bounds[rank + 1]

        def gather(value: torch.Tensor) -> torch.Tensor:
            if exchanges is not None and rank == 0:
                exchanges.append(value.numel())
            board[rank] = value
            barrier.wait()
            every = torch.stack(board)
            barrier.wait()  # all have read before anyone writes the next exchange
            return every

        largest = max(b - a for a, b in itertools.pairwise(bounds))
        return vocab_parallel.VocabShard(
            lambda x: head(x)[..., start:end], start, end - start, gather, largest
        )

    results: list = [None] * n_ranks

    def rank_main(rank: int) -> None:
        try:
            results[rank] = (work or statistics)(shard=shard(rank), **kwargs)
        except Exception as err:
            results[rank] = err

    threads = [
        threading.Thread(target=rank_main, args=(r,), name=f"rank-{r}") for r in range(n_ranks)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def reference(
    streams, positions=None, top_k=TOP_K, targets=TARGETS, head=None
) -> dict[str, torch.Tensor]:
    """The same statistics computed directly in float64 (with a copy of ``head`` if given)."""
    norm = ToyAddNorm().double()
    head = (copy.deepcopy(head) if head is not None else CountingHead()).double()
    logits = []
    with torch.no_grad():
        for hidden, residual in streams:
            x = hidden.double() if residual is None else hidden.double() + residual.double()
            x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * norm.weight
            logits.append(x @ head.weight.T)
    logits = torch.stack(logits)
    if positions is not None:
        logits = logits[:, positions]
    layer, final = Categorical(logits=logits), Categorical(logits=logits[-1].expand_as(logits))
    probs = torch.softmax(logits, -1)
    order = torch.argsort(logits, dim=-1, descending=True)
    ids = torch.tensor(targets, dtype=torch.long)
    # A target's rank: where it sits in the sorted vocabulary (no ties in random logits).
    ranks = (order.unsqueeze(-1) == ids).int().argmax(-2)
    return {
        "top_ids": order[..., :top_k],
        "top_probs": probs.gather(-1, order[..., :top_k]),
        "entropy": layer.entropy(),
        "kl": kl_divergence(final, layer),
        "target_probs": probs[..., ids],
        "target_ranks": ranks,
    }


def assert_matches(got: dict, want: dict, atol: float) -> None:
    assert set(got) == set(want)
    for key in ("top_ids", "target_ranks"):
        assert torch.equal(got[key].long(), want[key].long()), key
    for key in ("top_probs", "entropy", "kl", "target_probs"):
        assert got[key].shape == want[key].shape, key
        torch.testing.assert_close(got[key].double(), want[key], atol=atol, rtol=1e-6, msg=key)


# Each reduction both ways: torch's passes, and the loops compiled from them.
FUSED = pytest.mark.parametrize("fused", [False, True], ids=["passes", "compiled"])


class TestAgainstDirectComputation:
    @FUSED
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
    def test_every_statistic(self, dtype, fused):
        streams = toy_streams()
        assert_matches(statistics(streams, dtype=dtype, fused=fused), reference(streams), 2e-5)

    @FUSED
    def test_picked_positions(self, fused):
        streams, positions = toy_streams(), torch.tensor([1, 4, 5])
        got = statistics(streams, positions, fused=fused)
        assert got["entropy"].shape == (len(streams), 3)
        assert_matches(got, reference(streams, positions), 2e-5)

    @FUSED
    def test_final_layer_has_zero_kl(self, fused):
        assert torch.all(statistics(toy_streams(), fused=fused)["kl"][-1] == 0)

    @FUSED
    def test_no_targets(self, fused):
        got = statistics(toy_streams(), targets=[], fused=fused)
        assert got["target_probs"].shape == got["target_ranks"].shape == (5, N_POS, 0)
        assert_matches(got, reference(toy_streams(), targets=[]), 2e-5)

    @pytest.mark.skipif(not shutil.which("g++"), reason="no C++ compiler for torch's inductor")
    def test_the_reductions_compile_here(self):
        """Otherwise every ``compiled`` case above would run torch's passes and prove
        nothing about the compiled loops."""
        assert fused_reductions.compiled() is not None

    def test_streams_left_unchanged(self):
        """The fused add-norm writes into its input: the model's own tensors must not see it."""
        streams = toy_streams()
        before = [(h.clone(), None if r is None else r.clone()) for h, r in streams]
        statistics(streams)
        for (h, r), (h0, r0) in zip(streams, before):
            assert torch.equal(h, h0) and (r is None or torch.equal(r, r0))


class TestSplitVocabulary:
    """Ranks holding slices of the vocabulary agree on the whole vocabulary's statistics."""

    @FUSED
    @pytest.mark.parametrize("top_k", [1, TOP_K])
    @pytest.mark.parametrize("n_ranks", [2, 3])
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
    def test_every_rank_matches_the_reference(self, n_ranks, dtype, fused, top_k):
        streams, positions = toy_streams(), torch.tensor([0, 3, 5])
        want = reference(streams, positions, top_k=top_k)
        for got in on_ranks(
            n_ranks, streams=streams, positions=positions, dtype=dtype, fused=fused, top_k=top_k
        ):
            assert_matches(got, want, 2e-5)

    @FUSED
    def test_chunked_on_ranks(self, fused):
        streams = toy_streams(6)
        for got in on_ranks(3, streams=streams, budget=1, fused=fused):
            assert_matches(got, reference(streams), 2e-5)

    def test_uneven_slices_chunk_alike(self):
        """Slices of 13, 13 and 11 tokens and a budget of two layers of the smallest: sized by
        its own slice, the last rank would make fewer exchanges than the others and wait for
        them forever; every rank sizes its chunks by the largest slice."""
        streams = toy_streams()
        for got in on_ranks(3, streams=streams, budget=2 * N_POS * 11 * 4 * 3):
            assert_matches(got, reference(streams), 2e-5)

    def test_top_k_larger_than_a_slice(self):
        """Each rank holds 12-13 tokens; the top 20 come from every rank's candidates."""
        streams = toy_streams()
        for got in on_ranks(3, streams=streams, top_k=20):
            assert_matches(got, reference(streams, top_k=20), 2e-5)

    @FUSED
    def test_near_certain_tokens_stay_within_float32_rounding_of_one(self, fused):
        """Logits in the hundreds (a tuned lens's first layers): a log-sum-exp subtracted
        from a logit that large is off by 1.5e-5; normalised as log_softmax does, by 1e-7.
        The entropy of such near-certain cells (down to 1e-94 nats) holds as well."""
        head = CountingHead()
        with torch.no_grad():
            head.weight.mul_(20)  # logits in the hundreds
        streams = toy_streams()
        for got in on_ranks(3, streams=streams, head=head, fused=fused):
            assert got["top_probs"].sum(-1).max() <= 1 + 4e-7
            want = reference(streams, head=head)
            assert torch.equal(got["top_ids"].long(), want["top_ids"])
            for key in ("top_probs", "target_probs", "entropy"):
                torch.testing.assert_close(got[key].double(), want[key], atol=2e-6, rtol=0)
            # (No KL here: torch.distributions' own KL overflows to inf at these logits.)


class TestManyLensesInOneExchange:
    """`lens.lens_messages` of several lenses, exchanged at once and reduced by
    `lens.statistics_of` (the corpus lens's groups of documents): each lens's statistics,
    from one exchange in all."""

    LENGTHS = (N_POS, 3, 5)

    @staticmethod
    def streams_of(i: int, n: int) -> list:
        """Lens ``i``'s streams: ``n`` positions, scaled so no two lenses are alike."""
        return [(h[:n] * (1 + i), None if r is None else r[:n]) for h, r in toy_streams(5)]

    def lenses(self, shard, fused, budget):
        with torch.no_grad():
            messages = [
                lens.lens_messages(
                    ToyAddNorm(), shard, self.streams_of(i, n), 2, False, budget, fused
                )
                for i, n in enumerate(self.LENGTHS)
            ]
            return lens.statistics_of(shard.gather(torch.cat(messages, dim=1)), 2)

    @FUSED
    @pytest.mark.parametrize("budget", [lens.DEFAULT_MEMORY_BUDGET, 1], ids=["whole", "chunked"])
    def test_each_lens_as_alone(self, fused, budget):
        exchanges: list[int] = []
        got = on_ranks(3, work=self.lenses, exchanges=exchanges, fused=fused, budget=budget)
        assert len(exchanges) == 1
        start = 0
        for i, n in enumerate(self.LENGTHS):
            want = reference(self.streams_of(i, n), top_k=2, targets=[])
            for on_rank in got:
                part = {key: value[:, start : start + n] for key, value in on_rank.items()}
                assert_matches(part, want, 2e-5)
            start += n


class TestChunking:
    """Any memory budget gives the statistics of one unembedding call."""

    def test_one_call_by_default(self):
        head = CountingHead()
        statistics(toy_streams(), head=head)
        assert head.calls == 1

    # A block of positions holds one layer's logits beside the final layer's log-probs and
    # probabilities; a chunk of layers holds its logits beside those two (float32 bytes).
    POSITION_BYTES = VOCAB * 4 * 3
    LAYER_BYTES = N_POS * VOCAB * 4

    @pytest.mark.parametrize(
        ("budget", "calls"),
        [
            (1, 5 * N_POS),
            (2 * POSITION_BYTES, 5 * math.ceil(N_POS / 2)),
            (4 * LAYER_BYTES, 3),
            (5 * LAYER_BYTES, 2),
            (7 * LAYER_BYTES, 1),
        ],
        ids=["1-byte", "2-positions", "2-layers", "3-layers", "5-layers"],
    )
    def test_any_budget_gives_the_same_statistics(self, budget, calls):
        streams = toy_streams()
        whole = statistics(streams)
        head = CountingHead()
        chunked = statistics(streams, budget=budget, head=head)
        # Really chunked: 5 layers as 2+1+2, 3+2, ...; below one layer, blocks of positions
        # (a long prompt's single layer would otherwise outgrow the budget), each layer alone.
        assert head.calls == calls
        for key in ("top_ids", "target_ranks"):
            assert torch.equal(chunked[key], whole[key]), key
        # A GEMM over fewer rows may round differently: float32 noise (KL reaches ~30 nats).
        for key in ("top_probs", "entropy", "kl", "target_probs"):
            torch.testing.assert_close(chunked[key], whole[key], atol=1e-6, rtol=1e-6, msg=key)

    @pytest.mark.parametrize("rows", [1, 4], ids=["row-by-row", "uneven-blocks"])
    def test_blocks_of_rows_give_the_reference(self, monkeypatch, rows):
        """The reductions run over blocks of rows that fit the cache: any block size, even
        one that leaves a short last block of positions, gives the reference, on one rank
        and on three."""
        monkeypatch.setattr(messages, "BLOCK_BYTES", rows * VOCAB * 4)
        streams = toy_streams()
        want = reference(streams)
        assert_matches(statistics(streams), want, 2e-5)
        for got in on_ranks(3, streams=streams):
            assert_matches(got, want, 2e-5)

    @pytest.mark.parametrize(
        ("n_layers", "per_call", "sizes"),
        [(30, 27, [15, 15]), (5, 2, [2, 1, 2]), (4, 4, [4]), (3, 1, [1, 1, 1])],
    )
    def test_layers_split_evenly_last_first(self, n_layers, per_call, sizes):
        chunks = lens.even_chunks(n_layers, per_call)
        assert chunks[0].stop == n_layers
        assert [c.stop - c.start for c in reversed(chunks)] == sizes
        assert sorted(i for c in chunks for i in range(c.start, c.stop)) == list(range(n_layers))

    def test_chunked_with_positions_matches_reference(self):
        streams, positions = toy_streams(6), torch.tensor([0, 2, 5])
        got = statistics(streams, positions, budget=1)
        assert_matches(got, reference(streams, positions), 2e-5)


class TestCancel:
    """A lens's cancel flag travels in each chunk's summaries: no exchange of its own, and
    every rank stops at the same chunk even when one rank alone sees the flag."""

    KEY = "0123456789abcdef" * 2
    # Three ranks' 5 layers in chunks of 2 + 1 + 2: each chunk's logits are cut to the
    # largest slice's width (`TestChunking`'s "2-layers" budget on one rank).
    BUDGET = 4 * N_POS * max(b - a for a, b in itertools.pairwise(slice_bounds(3))) * 4

    def test_no_exchange_of_its_own(self):
        """Three chunks, each with its two exchanges (summaries, then sums) and no third,
        and the statistics of a lens that cannot be cancelled (no key)."""
        streams, exchanges = toy_streams(), []
        budget = self.BUDGET
        got = outcomes_on_ranks(
            3, streams=streams, budget=budget, cancel=self.KEY, exchanges=exchanges
        )
        assert len(exchanges) == 2 * 3
        want = on_ranks(3, streams=streams, budget=budget)
        for mine, theirs in zip(got, want, strict=True):
            for key in theirs:
                assert torch.equal(mine[key], theirs[key]), key

    def test_a_flag_one_rank_sees_stops_every_rank_at_that_chunk(self, monkeypatch):
        """Rank 1 sees the flag before the second chunk: every rank raises `LensCancelled`
        after that chunk's unembedding and summaries, before its sums or a third chunk."""
        looks = []

        def flag_seen(key):
            looks.append(key)
            return threading.current_thread().name == "rank-1" and len(looks) > 3

        monkeypatch.setattr(lens, "flag_seen", flag_seen)
        head, exchanges = CountingHead(), []
        got = outcomes_on_ranks(
            3,
            head=head,
            streams=toy_streams(),
            budget=self.BUDGET,
            cancel=self.KEY,
            exchanges=exchanges,
        )
        for outcome in got:
            assert isinstance(outcome, cancel.LensCancelled), outcome
            assert cancel.is_cancellation(outcome, self.KEY)
        assert head.calls == 3 * 2  # two chunks' unembedding on each of three ranks
        assert len(exchanges) == 3  # chunk 1: summaries and sums; chunk 2: summaries

    def test_a_real_flag_file_stops_the_first_chunk(self, tmp_path, monkeypatch):
        """The flag as the client raises it, a file in the ranks' scratch directory."""
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
        cancel.raise_flag(str(tmp_path), self.KEY)
        head = CountingHead()
        got = outcomes_on_ranks(2, head=head, streams=toy_streams(), cancel=self.KEY)
        assert all(isinstance(outcome, cancel.LensCancelled) for outcome in got), got
        assert head.calls == 2
        cancel.lower_flag(str(tmp_path), self.KEY)
        assert all(isinstance(r, dict) for r in outcomes_on_ranks(2, streams=toy_streams()))
