"""Regenerate the SAE test data in this directory with the real SAE libraries.

Every file here (except README.md and this script) is written by this script, using
SAELens (sae-lens==6.54.12) and EleutherAI's sparsify (eai-sparsify==1.3.3, imported as
``sparsify``) themselves: each SAE is built with the library's own constructor, its
parameters are overwritten with seeded random values under ``torch.no_grad()``, it is saved
with the library's own save method, and the library's own encode/decode of a fixed input is
stored next to it as the reference a reader must reproduce.

These libraries are NOT dependencies of the project. Run this in a throwaway virtualenv
that layers them on top of the project's venv, pinning everything the project venv has:

    python3 -m venv /tmp/saevenv
    echo /work/main/.venv/lib/python3.11/site-packages \
        > /tmp/saevenv/lib/python3.11/site-packages/projvenv.pth
    /work/main/.venv/bin/pip freeze | grep -vE '^(-e|#)' > /tmp/constraints.txt
    /tmp/saevenv/bin/pip install -c /tmp/constraints.txt sae-lens==6.54.12 eai-sparsify==1.3.3
    /tmp/saevenv/bin/python tests/data/sae/make.py          # from the repository root

(torch==2.13.0+cpu, transformers==5.19.0, numpy==2.3.5, safetensors==0.8.0 come from the
project venv.) The script is deterministic on CPU (fixed seed, float32); it rewrites the
whole tree, then reloads every SAE with the library's own loader and checks that the
reloaded SAE's encode/decode of ``inputs.safetensors`` equals the stored reference exactly.

Layout (d_in=128 = hidden size of the project's ``tiny`` model, d_sae=256):

    inputs.safetensors             x [16, 128] float32
    saelens_standard/              SAELens "standard", apply_b_dec_to_input=True, norm "none"
    saelens_jumprelu/              SAELens "jumprelu", random positive thresholds
    saelens_topk/                  SAELens "topk", k=8
    saelens_standard_norm/         SAELens "standard", normalize_activations="constant_norm_rescale"
    saelens_standard_layernorm/    SAELens "standard", normalize_activations="layer_norm"
    sparsify_topk/                 a sparsify run directory:
                                   config.json + layers.2/{cfg.json,sae.safetensors}
    gemma_scope/params.npz         Gemma Scope release layout (numpy), JumpReLU,
                                   apply_b_dec_to_input=False

Each SAE directory also holds ``expected.safetensors`` with ``acts`` [16, 256] (the
library's encode of x, dense) and ``recon`` [16, 128] (the library's decode of those acts).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import sae_lens
import sparsify
import torch
from sae_lens import SAE
from sae_lens.saes.jumprelu_sae import JumpReLUSAE, JumpReLUSAEConfig
from sae_lens.saes.sae import SAEMetadata
from sae_lens.saes.standard_sae import StandardSAE, StandardSAEConfig
from sae_lens.saes.topk_sae import TopKSAE, TopKSAEConfig
from safetensors.torch import load_file, save_file
from sparsify import SparseCoder, SparseCoderConfig

assert sae_lens.__version__ == "6.54.12", sae_lens.__version__
assert sparsify.__version__ == "1.3.3", sparsify.__version__

HERE = Path(__file__).resolve().parent
D_IN, D_SAE, N = 128, 256, 16
MODEL = "tiny"
SEED = 1234

torch.set_grad_enabled(False)
torch.manual_seed(SEED)
gen = torch.Generator().manual_seed(SEED)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32)


def rand(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=gen, dtype=torch.float32)


def unit_rows(w: torch.Tensor) -> torch.Tensor:
    return w / w.norm(dim=-1, keepdim=True)


# The input: randn * 3 plus a small per-dimension offset.
x = randn(N, D_IN) * 3.0 + 0.5 * randn(D_IN)


def random_weights(x_scale: float) -> dict[str, torch.Tensor]:
    """W_enc [d_in, d_sae] scaled so pre-activations are O(1) for inputs of per-dim std
    ~x_scale; W_dec [d_sae, d_in] with unit-norm rows; nonzero b_enc, b_dec."""
    return {
        "W_enc": randn(D_IN, D_SAE) / (x_scale * D_IN**0.5),
        "b_enc": 0.3 * randn(D_SAE) - 0.1,
        "W_dec": unit_rows(randn(D_SAE, D_IN)),
        "b_dec": 0.5 * randn(D_IN),
    }


def overwrite(module: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    sd = module.state_dict()
    for name, value in params.items():
        param = getattr(module, name) if "." not in name else module.get_parameter(name)
        assert param.shape == value.shape, (name, param.shape, value.shape)
        param.copy_(value)
    assert set(params) == set(sd), (sorted(params), sorted(sd))


def save_expected(d: Path, acts: torch.Tensor, recon: torch.Tensor) -> None:
    assert acts.shape == (N, D_SAE) and acts.dtype == torch.float32
    assert recon.shape == (N, D_IN) and recon.dtype == torch.float32
    save_file(
        {"acts": acts.contiguous(), "recon": recon.contiguous()},
        d / "expected.safetensors",
    )


def saelens_ref(sae: SAE, xin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # decode must directly follow encode for the normalizing modes: encode stores the
    # per-input norm coefficient / mean / std that decode uses (and deletes).
    acts = sae.encode(xin)
    recon = sae.decode(acts)
    return acts, recon


def firing_report(name: str, acts: torch.Tensor) -> None:
    l0 = (acts != 0).sum(-1).float()
    print(
        f"{name:28s} L0 per row: min {int(l0.min())} mean {l0.mean():.1f} max {int(l0.max())}"
        f"  (of {acts.shape[-1]}); features ever active {(acts != 0).any(0).sum().item()}"
    )


def main() -> None:
    # Start from a clean tree (keep the scripts, the README, and make_trained.py's output).
    for p in HERE.iterdir():
        if p.name in ("make.py", "make_trained.py", "README.md", "trained_topk"):
            continue
        shutil.rmtree(p) if p.is_dir() else p.unlink()

    save_file({"x": x.contiguous()}, HERE / "inputs.safetensors")
    expected: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    # ---------------------------------------------------------------- SAELens
    def saelens(name, cfg_cls, sae_cls, hook, extra_cfg=None, extra_params=None, x_scale=3.0):
        cfg = cfg_cls(
            d_in=D_IN,
            d_sae=D_SAE,
            dtype="float32",
            device="cpu",
            metadata=SAEMetadata(hook_name=hook, model_name=MODEL),
            **(extra_cfg or {}),
        )
        sae = sae_cls(cfg)
        params = random_weights(x_scale)
        params.update(extra_params or {})
        overwrite(sae, params)
        sae.eval()
        d = HERE / name
        sae.save_model(d)
        acts, recon = saelens_ref(sae, x)
        save_expected(d, acts, recon)
        expected[name] = (acts, recon)
        firing_report(name, acts)

    saelens(
        "saelens_standard",
        StandardSAEConfig,
        StandardSAE,
        "blocks.2.hook_resid_post",
        extra_cfg=dict(apply_b_dec_to_input=True, normalize_activations="none"),
    )
    saelens(
        "saelens_jumprelu",
        JumpReLUSAEConfig,
        JumpReLUSAE,
        "blocks.2.hook_resid_post",
        extra_cfg=dict(apply_b_dec_to_input=True, normalize_activations="none"),
        # Random positive thresholds: a pre-activation must exceed its threshold (> ,
        # strictly) to fire, so some features fire and some that ReLU would pass do not.
        extra_params={"threshold": 0.1 + 0.6 * rand(D_SAE)},
    )
    saelens(
        "saelens_topk",
        TopKSAEConfig,
        TopKSAE,
        "blocks.1.hook_mlp_out",
        extra_cfg=dict(
            k=8,
            rescale_acts_by_decoder_norm=False,
            apply_b_dec_to_input=True,
            normalize_activations="none",
        ),
    )
    # constant_norm_rescale: x is scaled to norm sqrt(d_in) (per-dim std ~1) before the
    # encoder, and the decoder output is scaled back by the same per-row factor.
    saelens(
        "saelens_standard_norm",
        StandardSAEConfig,
        StandardSAE,
        "blocks.2.hook_resid_pre",
        extra_cfg=dict(apply_b_dec_to_input=True, normalize_activations="constant_norm_rescale"),
        x_scale=1.0,
    )
    saelens(
        "saelens_standard_layernorm",
        StandardSAEConfig,
        StandardSAE,
        "blocks.2.hook_resid_pre",
        extra_cfg=dict(apply_b_dec_to_input=True, normalize_activations="layer_norm"),
        x_scale=1.0,
    )

    # ---------------------------------------------------------------- sparsify
    # What sparsify's Trainer writes for a run: <save_dir>/<run_name>/config.json (the run
    # config) and one <hookpoint>/ folder per hookpoint written by SparseCoder.save_to_disk
    # (cfg.json + sae.safetensors). Hookpoints are module names relative to
    # model.base_model, so for a Llama-style HF model layer 2's residual output is
    # "layers.2". (The Trainer also writes optimizer/scheduler/state .pt pickles there;
    # they are training state only and are not written here.)
    from sparsify.__main__ import RunConfig

    run_dir = HERE / "sparsify_topk"
    hookpoint = "layers.2"
    sp_cfg = SparseCoderConfig(
        activation="topk",
        num_latents=D_SAE,
        k=8,
        normalize_decoder=True,
        multi_topk=False,
        skip_connection=False,
        transcode=False,
    )
    sp = SparseCoder(D_IN, sp_cfg, device="cpu", dtype=torch.float32)
    w = random_weights(3.0)
    overwrite(
        sp,
        {
            "encoder.weight": w["W_enc"].T.contiguous(),  # nn.Linear weight: [d_sae, d_in]
            "encoder.bias": w["b_enc"],
            "W_dec": w["W_dec"],  # [d_sae, d_in], unit-norm rows (normalize_decoder=True)
            "b_dec": w["b_dec"],
        },
    )
    sp.eval()
    sp.save_to_disk(run_dir / hookpoint)
    RunConfig(
        sae=sp_cfg,
        model=MODEL,
        dataset="none",
        hookpoints=[hookpoint],
        data_preprocessing_num_proc=1,
        log_to_wandb=False,
        run_name="sparsify_topk",
    ).save_json(run_dir / "config.json")
    enc = sp.encode(x)
    dense = torch.zeros(N, D_SAE, dtype=torch.float32).scatter_(-1, enc.top_indices, enc.top_acts)
    out = sp(x)
    recon = out.sae_out
    assert torch.equal(recon, sp.decode(enc.top_acts, enc.top_indices))
    save_expected(run_dir, dense, recon)
    expected["sparsify_topk"] = (dense, recon)
    firing_report("sparsify_topk", dense)

    # ---------------------------------------------------------------- Gemma Scope
    # The release layout: <folder>/params.npz with W_enc [d_in,d_sae], W_dec [d_sae,d_in],
    # b_enc [d_sae], b_dec [d_in], threshold [d_sae] (float32). The reference is SAELens's
    # own Gemma Scope loader (gemma_2_sae_huggingface_loader, i.e. JumpReLU with
    # apply_b_dec_to_input=False) with the hub download pointed at this local file.
    gs_dir = HERE / "gemma_scope"
    gs_dir.mkdir()
    g = random_weights(3.0)
    g["threshold"] = 0.1 + 0.6 * rand(D_SAE)
    np.savez(gs_dir / "params.npz", **{k: v.numpy() for k, v in g.items()})
    gs_sae = load_gemma_scope_with_saelens(gs_dir)
    acts, recon = saelens_ref(gs_sae, x)
    save_expected(gs_dir, acts, recon)
    expected["gemma_scope"] = (acts, recon)
    firing_report("gemma_scope", acts)

    verify(expected)
    total = sum(p.stat().st_size for p in HERE.rglob("*") if p.is_file())
    print(f"total size {total / 1e6:.2f} MB")


def load_gemma_scope_with_saelens(folder: Path) -> SAE:
    """SAE.from_pretrained's body with SAELens's Gemma Scope loader, offline."""
    import sae_lens.loading.pretrained_sae_loaders as L

    def local_download(repo_id, filename, subfolder=None, force_download=False, **_):
        assert filename == "params.npz", filename
        return str(folder / filename)

    real = L.hf_hub_download
    L.hf_hub_download = local_download
    try:
        cfg_dict, state_dict, _ = L.gemma_2_sae_huggingface_loader(
            repo_id="google/gemma-scope-2b-pt-res",  # only used to pick hook/model defaults
            folder_name="layer_2/width_16k/average_l0_10",
            device="cpu",
            cfg_overrides={"d_in": D_IN, "d_sae": D_SAE, "model_name": MODEL},
        )
    finally:
        L.hf_hub_download = real
    assert cfg_dict["architecture"] == "jumprelu" and cfg_dict["apply_b_dec_to_input"] is False
    cfg_dict = L.handle_config_defaulting(cfg_dict)
    sae_cfg = SAE.get_sae_config_class_for_architecture(cfg_dict["architecture"]).from_dict(
        cfg_dict
    )
    sae = SAE.get_sae_class_for_architecture(sae_cfg.architecture())(sae_cfg)
    sae.load_state_dict(state_dict)
    return sae.eval()


def verify(expected: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    xin = load_file(HERE / "inputs.safetensors")["x"]
    for name, (acts0, recon0) in expected.items():
        d = HERE / name
        ref = load_file(d / "expected.safetensors")
        assert torch.equal(ref["acts"], acts0) and torch.equal(ref["recon"], recon0), name
        if name.startswith("saelens_"):
            sae = SAE.load_from_disk(d, device="cpu")
            acts, recon = saelens_ref(sae, xin)
        elif name == "sparsify_topk":
            assert SparseCoder.load_many(str(d), local=True).keys() == {"layers.2"}
            sp = SparseCoder.load_from_disk(d / "layers.2", device="cpu")
            enc = sp.encode(xin)
            acts = torch.zeros(N, D_SAE).scatter_(-1, enc.top_indices, enc.top_acts)
            recon = sp(xin).sae_out
        elif name == "gemma_scope":
            sae = load_gemma_scope_with_saelens(d)
            acts, recon = saelens_ref(sae, xin)
        else:
            raise AssertionError(name)
        ok = torch.equal(acts, ref["acts"]) and torch.equal(recon, ref["recon"])
        print(f"verify {name:28s} reload+encode/decode exact: {ok}")
        if not ok:
            sys.exit(f"verification failed for {name}")
    print("all verified")


if __name__ == "__main__":
    main()
