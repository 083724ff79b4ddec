"""Regenerate ``trained_topk/``: a TopK SAE trained by envoykit, and SAELens's own encode of it.

envoykit trains a small TopK SAE (d_in 64, d_sae 256, k 8) on synthetic activations with a
known sparse structure and saves it with ``SAE.save`` (SAELens's format); SAELens 6.54.12's
``SAE.load_from_disk`` then reads those files and encodes a fixed input, and its output is
stored beside them as the reference envoykit's reader must reproduce
(tests/unit/test_sae_training.py). For a quality comparison, sparsify 1.3.3's
``SparseCoder`` (its fused encoder, its FVU and AuxK losses, its decoder normalisation, the
steps of its ``Trainer.fit``) is trained on the same rows for the same tokens, and every
variance explained on the held-out rows is printed (nothing of sparsify is stored).

Run from the repository root in the throwaway venv that has the libraries (see make.py's
docstring; envoykit comes from the checkout):

    /work/main/.venv/bin/python -m venv /tmp/saevenv2
    /work/main/.venv/bin/pip freeze | grep -vE '^(-e|#)| @ ' > /tmp/constraints.txt
    /tmp/saevenv2/bin/pip install -c /tmp/constraints.txt torch==2.13.0+cpu \
        sae-lens==6.54.12 eai-sparsify==1.3.3
    PYTHONPATH=. /tmp/saevenv2/bin/python tests/data/sae/make_trained.py

Deterministic on CPU (fixed seeds, float32): a rerun writes the same bytes.

    trained_topk/cfg.json, sae_weights.safetensors   envoykit's SAE.save
    trained_topk/saelens_expected.safetensors        x [64, 64] (held-out rows), SAELens's
                                                     acts [64, 256] and recon [64, 64]
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import sae_lens
import sparsify
import torch
from safetensors.torch import save_file

import envoykit as ek

assert sae_lens.__version__ == "6.54.12", sae_lens.__version__
assert sparsify.__version__ == "1.3.3", sparsify.__version__

HERE = Path(__file__).resolve().parent
OUT = HERE / "trained_topk"
D_IN, ATOMS, ACTIVE, ROWS = 64, 256, 4, 40_000
D_SAE, K, BATCH, TOKENS = 256, 8, 1024, 400_000
SEED = 1234


def synthetic() -> torch.Tensor:
    """``[ROWS, D_IN]``: ``ACTIVE`` of ``ATOMS`` unit directions per row (values in [1, 5]),
    a constant offset and noise of 0.01 per dimension."""
    generator = torch.Generator().manual_seed(SEED)
    atoms = torch.nn.functional.normalize(torch.randn(ATOMS, D_IN, generator=generator), dim=-1)
    picked = torch.rand(ROWS, ATOMS, generator=generator).argsort(1)[:, :ACTIVE]
    values = torch.rand(ROWS, ACTIVE, generator=generator) * 4 + 1
    codes = torch.zeros(ROWS, ATOMS).scatter(1, picked, values)
    offset = 0.5 * torch.randn(D_IN, generator=generator)
    return codes @ atoms + offset + 0.01 * torch.randn(ROWS, D_IN, generator=generator)


def variance_explained(x: torch.Tensor, recon: torch.Tensor) -> float:
    return 1.0 - float((x - recon).pow(2).sum() / (x - x.mean(0)).pow(2).sum())


def sparsify_trained(
    x: torch.Tensor, optimizer: str, auxk_alpha: float, warmup: int, dead_tokens: int
) -> float:
    """A SparseCoder trained as sparsify's Trainer.fit trains one (b_dec the first batch's
    mean, decoder rows unit before each forward, the gradient along them removed before
    each step, dead latents counted in tokens), on shuffled passes over ``x``'s training
    rows; its held-out variance explained."""
    from schedulefree import ScheduleFreeWrapper
    from sparsify import SparseCoder, SparseCoderConfig
    from sparsify.sign_sgd import SignSGD
    from transformers import get_linear_schedule_with_warmup

    train, held = x[: -len(x) // 10], x[-len(x) // 10 :]
    torch.manual_seed(0)  # sparsify's Trainer seeds the global generator
    coder = SparseCoder(D_IN, SparseCoderConfig(num_latents=D_SAE, k=K), dtype=torch.float32)
    steps = TOKENS // BATCH
    if optimizer == "adam":
        lr = 2e-4 / (D_SAE / 2**14) ** 0.5
        opt = torch.optim.Adam(coder.parameters(), lr=lr)
        schedule = get_linear_schedule_with_warmup(opt, warmup, steps)
    else:
        lr = 5e-3 / (D_SAE / 2**14) ** 0.5
        opt = ScheduleFreeWrapper(
            SignSGD([{"params": coder.parameters(), "lr": lr}]), momentum=0.95
        )
        opt.train()
        schedule = None
    since_fired = torch.zeros(D_SAE, dtype=torch.long)
    generator = torch.Generator().manual_seed(0)
    order = torch.empty(0, dtype=torch.long)
    for step in range(steps):
        if len(order) < BATCH:
            order = torch.cat([order, torch.randperm(len(train), generator=generator)])
        batch, order = train[order[:BATCH]], order[BATCH:]
        if step == 0:
            coder.b_dec.data = batch.mean(0)
        coder.set_decoder_norm_to_unit_norm()
        dead = since_fired > dead_tokens if auxk_alpha > 0 else None
        out = coder(batch, dead_mask=dead)
        (out.fvu + auxk_alpha * out.auxk_loss).backward()
        coder.remove_gradient_parallel_to_decoder_directions()
        opt.step()
        opt.zero_grad()
        if schedule is not None:
            schedule.step()
        since_fired += len(batch)
        since_fired[out.latent_indices.flatten()] = 0
    if optimizer != "adam":
        opt.eval()
    coder.set_decoder_norm_to_unit_norm()
    with torch.no_grad():
        return variance_explained(held, coder(held).sae_out)


def main() -> None:
    x = synthetic()
    held = x[-min(4096, round(0.1 * len(x))) :]
    shutil.rmtree(OUT, ignore_errors=True)
    sae = ek.train_sae(
        x, layer=3, d_sae=D_SAE, k=K, batch_size=BATCH, max_tokens=TOKENS, progress=False
    )
    sae.save(OUT)
    ek_ve = variance_explained(held, sae.decode(sae.encode(held)))

    # SAELens reads the files envoykit wrote and encodes the first 64 held-out rows.
    loaded = sae_lens.SAE.load_from_disk(OUT, device="cpu")
    assert loaded.cfg.architecture() == "topk" and loaded.cfg.k == K, loaded.cfg
    probe = held[:64].contiguous()
    with torch.no_grad():
        acts = loaded.encode(probe)
        recon = loaded.decode(acts)
    save_file(
        {"x": probe, "acts": acts.contiguous(), "recon": recon.contiguous()},
        OUT / "saelens_expected.safetensors",
    )
    ours = sae.encode(probe)
    print(f"SAELens vs envoykit encode: max |diff| {float((acts - ours).abs().max()):.3g}")

    dead = min(10_000_000, max(TOKENS // 10, BATCH))  # envoykit's default dead window
    rows = [
        ("envoykit train_sae (Adam, AuxK 1/32)", ek_ve),
        (
            "sparsify defaults (signum, AuxK off)",
            sparsify_trained(x, "signum", 0.0, 0, 10_000_000),
        ),
        (
            "sparsify Adam, 1000 warmup steps, AuxK off",
            sparsify_trained(x, "adam", 0.0, 1000, 10_000_000),
        ),
        (
            "sparsify Adam, no warmup, AuxK 1/32",
            sparsify_trained(x, "adam", 1 / 32, 0, dead),
        ),
    ]
    print(f"held-out variance explained, {TOKENS} tokens, d_in {D_IN}, d_sae {D_SAE}, k {K}:")
    for name, value in rows:
        assert math.isfinite(value)
        print(f"  {name:45s} {value:.4f}")


if __name__ == "__main__":
    main()
