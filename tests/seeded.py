"""Objects built deterministically for tests, where training one would cost minutes."""

from __future__ import annotations

import torch

import envoykit as ek


def seeded_tuned_lens(engine: ek.Engine) -> ek.TunedLens:
    """Translators of ``engine``'s model with no training: small seeded A and b per layer."""
    generator = torch.Generator().manual_seed(0)
    n, d = engine.info.n_layers, engine.info.d_model
    weights = {
        layer: (
            0.05 * torch.randn(d, d, generator=generator),
            0.1 * torch.randn(d, generator=generator),
        )
        for layer in range(n)
    }
    return ek.TunedLens(weights, engine.fingerprint())
