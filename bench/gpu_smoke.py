"""The rank-side functions on a GPU, in pure torch (no vLLM): the same numbers as on the CPU.

    python bench/gpu_smoke.py            # cuda if there is one, else says so and exits 2
    python bench/gpu_smoke.py --device cpu   # the same run on the CPU (a dry run of the script)

Runs the lens statistics (one rank and a vocabulary split across two simulated ranks, whose
exchange refuses a tensor that is not on the device, as NCCL does), direct logit attribution,
a tuned-lens translator with a toy fused add-norm and head, a norm-matched steer, and a TopK
SAE's features, top features and reconstruction, all on the device, and prints the largest
difference from the same computation on the CPU. It exits non-zero on a difference above
1e-4 or on any error, so it can be run as a check on a machine with a GPU.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import torch
from features import random_sae
from safetensors.torch import save as save_tensors

from envoykit.analyses import attribution
from envoykit.model.readout import Addition, Cell
from envoykit.model.vocab_shard import VocabShard
from envoykit.ranks import lens, sae, translators

D, VOCAB, T, LAYERS = 64, 1000, 12, 6
TOLERANCE = 1e-4


class FusedNorm(torch.nn.Module):
    variance_epsilon = 1e-6

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)

    def forward(self, x, residual=None):
        if residual is not None:
            x = x + residual
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (normed * self.weight, x) if residual is not None else normed * self.weight


class Head(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight)

    def forward(self, x):
        return x @ self.weight.T

    def rows(self, ids):
        return torch.nn.functional.embedding(ids.to(self.weight.device), self.weight)

    def bias_of(self, ids):
        return torch.zeros(ids.shape, device=self.weight.device)


def checked_gather(device: torch.device):
    """One rank's exchange, refusing a tensor that is not on the device (as NCCL does)."""

    def gather(t: torch.Tensor) -> torch.Tensor:
        if t.device != device:
            raise RuntimeError(f"a tensor on {t.device} was sent to the {device} exchange")
        return t.unsqueeze(0)

    return gather


def run(device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    norm = FusedNorm((torch.rand(D, generator=g) + 0.5).to(device))
    head = Head((torch.randn(VOCAB, D, generator=g) * 0.5).to(device))
    streams = [(torch.randn(T, D, generator=g).to(device), None)] + [
        (torch.randn(T, D, generator=g).to(device), torch.randn(T, D, generator=g).to(device))
        for _ in range(LAYERS)
    ]
    shard = VocabShard(head, 0, VOCAB, checked_gather(device), VOCAB)
    out = {}
    with torch.inference_mode():
        stats = lens.lens_statistics(
            norm, shard, streams, torch.tensor([0, 5, 11]), 10, [3, 500, 999], budget=2**16
        )
        out.update({f"lens.{k}": v.cpu() for k, v in stats.items()})
        parts = [s[0] for s in streams]
        final = (sum(parts[1:]), parts[0])
        att = attribution.attribution_statistics(
            norm, head, parts, final, torch.tensor([2, 7]), [3, 500], 1.0
        )
        out.update({f"attribution.{k}": v.cpu() for k, v in att.items()})
        # Installed as an engine installs them: the rank's own device, once.
        key, rank = "gpu-smoke", SimpleNamespace(device=device)
        blob = save_tensors({"A.1": torch.randn(D, D, generator=g) * 0.01, "b.1": torch.zeros(D)})
        translators.TranslatorStore.envoykit_install_translators(rank, key, blob)
        weight, _ = translators.INSTALLED[key][1]
        if weight.device.type != device.type:
            raise RuntimeError(f"translators installed on {weight.device}, not on {device}")
        out["translate"] = translators.translate(key, 1, streams[1][0]).cpu()
        del translators.INSTALLED[key]
        # A steer as the ranks get it: its vector on the CPU, added on the device.
        steer = Addition(Cell(2, "resid", None), torch.randn(D, generator=g), norm_match=True)
        steered = streams[2][0].clone()
        steer.apply(steered, None)
        out["steer"] = steered.cpu()
        out.update(sae_features(device, streams[3][0]))
    return out


def sae_features(device: torch.device, stream: torch.Tensor) -> dict:
    """A TopK SAE's slice on the device (`bench/features.random_sae`), as
    `SAEStore.envoykit_install_sae` unpacks it (one rank holding every feature): its
    features of ``stream``, its top features and its reconstruction, with the exchange
    refusing a tensor left on the CPU."""
    key = "gpu-smoke"
    sae.INSTALLED[key] = sae.unpack(*random_sae(D, 1, expansion=4, k=8).to_wire(), 0, 1)
    try:
        gather = checked_gather(device)
        encoded = sae.encode(key, stream, gather)
        ids, acts, l0 = sae.top_features(key, encoded, 5, gather)
        if int(l0.max()) > 8:
            raise RuntimeError(f"a TopK SAE with k=8 had {int(l0.max())} features on")
        return {
            "sae.acts": encoded.acts.cpu(),
            "sae.top_ids": ids.float().cpu(),
            "sae.top_acts": acts.cpu(),
            "sae.reconstruction": sae.decode(key, encoded, gather).cpu(),
        }
    finally:
        del sae.INSTALLED[key]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: nothing run")
        return 2
    reference, got = run(torch.device("cpu")), run(device)
    worst = 0.0
    for name, want in reference.items():
        diff = (got[name].double() - want.double()).abs().max().item()
        worst = max(worst, diff)
        print(f"{name:28s} {tuple(want.shape)!s:16s} max |{device.type} - cpu| = {diff:.3g}")
    print(f"{'PASS' if worst <= TOLERANCE else 'FAIL'}: largest difference {worst:.3g}")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
