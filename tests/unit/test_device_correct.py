"""Rank code makes every tensor on the device of the values it meets: checked without a GPU.

On the ``meta`` device a tensor has a shape and no data, and combining it with a CPU tensor
raises (a CPU tensor written from a meta one, or concatenated with one), as it would on
CUDA; so does asking a meta tensor for a number. The functions that run on the ranks — the
lens statistics, the vocabulary-parallel exchange, direct logit attribution, the tuned-lens
translators, the unembedding's row lookup, the heads' patterns and writes, a steer and an
SAE's features — are handed a norm, a head and streams on that device; the exchange itself
checks that what it is asked to send is there too (gloo and NCCL send only tensors on their
own device).
"""

from __future__ import annotations

import pytest
import torch

from envoykit.analyses import attribution
from envoykit.analyses.sae import SAE
from envoykit.model.readout import Addition, Cell
from envoykit.model.vocab_shard import VocabShard
from envoykit.ranks import heads, lens, sae, translators, vocab_parallel

D, VOCAB, T = 8, 20, 3
DEVICE = torch.device("meta")


class FusedNorm(torch.nn.Module):
    """A fused add-norm in miniature, as vLLM's RMSNorm: ``norm(x[, residual])``."""

    variance_epsilon = 1e-6

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(D, device=DEVICE))

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (normed * self.weight, x) if residual is not None else normed * self.weight


class Head(torch.nn.Module):
    """The unembedding: logits from hidden states, whole rows by id (as `UnembedEnvoy`)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(VOCAB, D, device=DEVICE))

    def forward(self, x):
        return x @ self.weight.T

    def rows(self, ids):
        return torch.nn.functional.embedding(ids.to(self.weight.device), self.weight)

    def bias_of(self, ids):
        return torch.zeros(ids.shape, device=self.weight.device)


def exchange(t: torch.Tensor, ranks: int = 2) -> torch.Tensor:
    """Two ranks' all-gather: refuses what is not on the device, as a process group does."""
    assert t.device == DEVICE, f"sent a tensor on {t.device} to a {DEVICE} process group"
    return torch.stack([t] * ranks)


def shards(head: Head) -> list[VocabShard]:
    half = VOCAB // 2
    return [
        VocabShard(head, start=0, size=VOCAB, gather=lambda t: exchange(t, 1), largest=VOCAB),
        VocabShard(
            lambda x: head(x)[:, :half], start=half, size=half, gather=exchange, largest=half
        ),
    ]


def streams() -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    return [(torch.ones(T, D, device=DEVICE), None)] + [
        (torch.ones(T, D, device=DEVICE), torch.ones(T, D, device=DEVICE)) for _ in range(3)
    ]


@pytest.fixture(autouse=True)
def no_grad():
    """As on the ranks, which run the model under inference mode."""
    with torch.inference_mode():
        yield


class TestOnAnotherDevice:
    def test_the_check_catches_a_cpu_tensor(self):
        on_device = torch.ones(T, D, device=DEVICE)
        with pytest.raises((RuntimeError, NotImplementedError)):
            torch.zeros(T, D)[..., 0] = on_device[..., 0]
        with pytest.raises(RuntimeError):
            torch.cat([on_device, torch.zeros(T, D)])

    @pytest.mark.parametrize("which", ["whole", "split"])
    def test_lens_statistics(self, which):
        head = Head()
        shard = shards(head)[0 if which == "whole" else 1]
        out = lens.lens_statistics(
            FusedNorm(), shard, streams(), torch.tensor([0, 2]), top_k=3, targets=[1, 15]
        )
        assert out["top_ids"].shape == (4, 2, 3)
        assert all(value.device == DEVICE for value in out.values())

    def test_exchange_of_targets_held_by_another_rank(self):
        head = Head()
        shard = shards(head)[1]
        logits = shard.logits(torch.ones(T, D, device=DEVICE))
        vocab_parallel.summaries(shard, logits, 3, [1, 15])

    def test_attribution_statistics(self):
        parts = [torch.ones(T, D, device=DEVICE) for _ in range(3)]
        final = (torch.ones(T, D, device=DEVICE), torch.ones(T, D, device=DEVICE))
        out = attribution.attribution_statistics(
            FusedNorm(), Head(), parts, final, torch.tensor([1]), [2, 5], 1.0
        )
        assert out["values"].shape == (3, 1, 2)

    def test_attention_patterns(self):
        from types import SimpleNamespace

        sinks = torch.zeros(4, device=DEVICE)
        impl = SimpleNamespace(scale=0.5, logits_soft_cap=2.0, sinks=sinks)
        kernel = SimpleNamespace(head_size=2, sliding_window=2, impl=impl)
        q, k = torch.ones(T, 8, device=DEVICE), torch.ones(T, 4, device=DEVICE)
        out = heads.local_patterns(kernel, q, k, torch.tensor([0, 2]))  # queries from the CPU
        assert out.device == DEVICE and out.shape == (4, 2, T)

    def test_head_writes(self):
        from types import SimpleNamespace

        weight = torch.ones(D, 4, device=DEVICE)  # rank 1's slice: two heads of two
        method = SimpleNamespace(apply=lambda layer, x, bias=None: x @ layer.weight.T)
        projection = SimpleNamespace(
            weight=weight, quant_method=method, input_size_per_partition=4, tp_rank=1
        )
        out = heads.head_writes(projection, torch.ones(T, 8, device=DEVICE), 2)  # whole input
        assert out.device == DEVICE and out.shape == (2, T, D)

    def test_translators(self):
        key = "device-test"
        translators.INSTALLED[key] = {1: (torch.zeros(D, D), torch.zeros(D))}  # as unpacked
        try:
            out = translators.translate(key, 1, torch.ones(T, D, device=DEVICE))
        finally:
            del translators.INSTALLED[key]
        assert out.device == DEVICE

    @pytest.mark.parametrize("architecture", ["topk", "jumprelu", "relu"])
    def test_sae_features(self, architecture):
        """One rank's slice of an SAE, unpacked on the CPU as installed: its features, top
        features, chosen features' activations, decoder rows and reconstruction all stay
        on the stream's device (a TopK SAE's global top-k included: no boolean index)."""
        d_sae = 16
        wire = SAE(
            architecture,
            torch.ones(D, d_sae),
            torch.zeros(d_sae),
            torch.ones(d_sae, D),
            torch.zeros(D),
            layer=1,
            threshold=torch.zeros(d_sae) if architecture == "jumprelu" else None,
            k=4 if architecture == "topk" else None,
            normalize_activations="layer_norm",
        ).to_wire()
        key = "device-test"
        sae.INSTALLED[key] = sae.unpack(*wire, 1, 2)
        try:
            encoded = sae.encode(key, torch.ones(T, D, device=DEVICE), exchange)
            ids, acts, l0 = sae.top_features(key, encoded, 3, exchange)
            chosen = torch.tensor([0, 9])
            out = [
                encoded.acts,
                ids,
                acts,
                l0,
                sae.decode(key, encoded, exchange),
                sae.activations_of(key, encoded, chosen, exchange),
                sae.decoder_rows(key, chosen, DEVICE, exchange),
            ]
        finally:
            del sae.INSTALLED[key]
        assert [t.device for t in out] == [DEVICE] * len(out)

    def test_a_steer_moves_its_vector_to_the_device_once(self):
        """A steer arrives from the client on the CPU; on the ranks it is added at every
        generated step, from one copy on the stream's device."""
        add = Addition(Cell(1, "resid", None), torch.ones(D))
        for _ in range(3):
            stream = torch.ones(T, D, device=DEVICE)
            add.apply(stream, None)
        assert list(add.on) == [DEVICE] and add.on[DEVICE].device == DEVICE
