"""SAE files written by the real SAELens and sparsify (tests/data/sae, made by its make.py),
read by envoykit and encoded on the client: equal to those libraries' own encode and decode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import envoykit as ek
from envoykit.analyses.sae_hooks import site_of_hook
from envoykit.errors import InvalidRequest

DATA = Path(__file__).resolve().parents[1] / "data" / "sae"
X = load_file(DATA / "inputs.safetensors")["x"]

# (directory, load options, (layer, site) envoykit reads it at)
FILES = [
    ("saelens_standard", {}, (3, "resid")),
    ("saelens_jumprelu", {}, (3, "resid")),
    ("saelens_topk", {}, (2, "mlp")),
    ("saelens_standard_norm", {}, (2, "resid")),
    ("saelens_standard_layernorm", {}, (2, "resid")),
    ("sparsify_topk", {}, (3, "resid")),
    ("gemma_scope", {"layer": 3}, (3, "resid")),
]


@pytest.mark.parametrize(("name", "options", "where"), FILES, ids=[f[0] for f in FILES])
def test_reads_what_the_library_wrote(name, options, where):
    sae = ek.SAE.load(DATA / name, **options)
    expected = load_file(DATA / name / "expected.safetensors")
    assert (sae.layer, sae.site) == where
    acts = sae.encode(X)
    # The same features on; values within 1e-6 (absolute, on activations of order 1-10).
    assert torch.equal(acts > 0, expected["acts"] > 0)
    assert (acts - expected["acts"]).abs().max() <= 1e-6
    recon = sae.decode(acts, X)
    assert (recon - expected["recon"]).abs().max() <= 1e-6 * max(1.0, expected["recon"].abs().max())


def test_float64_reference_agrees():
    """The reference the engine tests use (float64, written here from the formulas) against
    SAELens's own JumpReLU output."""
    sae = ek.SAE.load(DATA / "saelens_jumprelu")
    expected = load_file(DATA / "saelens_jumprelu" / "expected.safetensors")["acts"]
    pre = (X.double() - sae.b_dec.double()) @ sae.W_enc.double() + sae.b_enc.double()
    acts = pre.relu() * (pre > sae.threshold.double())
    assert (acts - expected.double()).abs().max() <= 1e-5


def test_model_name_and_hook_are_read():
    sae = ek.SAE.load(DATA / "saelens_topk")
    assert (sae.architecture, sae.k, sae.model_name, sae.hook_name) == (
        "topk",
        8,
        "tiny",
        "blocks.1.hook_mlp_out",
    )
    assert ek.SAE.load(DATA / "sparsify_topk").model_name == "tiny"


def test_save_round_trip(tmp_path):
    for name in ("saelens_topk", "saelens_jumprelu", "saelens_standard_norm"):
        sae = ek.SAE.load(DATA / name)
        again = ek.SAE.load(sae.save(tmp_path / name))
        assert again.key == sae.key
        assert torch.equal(again.encode(X), sae.encode(X))
        cfg = json.loads((tmp_path / name / "cfg.json").read_text())
        assert cfg["metadata"]["hook_name"] == sae.hook_name


def test_rescale_by_decoder_norm_is_folded(tmp_path):
    """A TopK SAE with rescale_acts_by_decoder_norm encodes as SAELens defines it."""
    source = DATA / "saelens_topk"
    shutil.copytree(source, tmp_path / "sae")
    weights = load_file(source / "sae_weights.safetensors")
    weights["W_dec"] = weights["W_dec"] * torch.linspace(0.5, 2.0, 256).unsqueeze(-1)
    save_file(weights, tmp_path / "sae" / "sae_weights.safetensors")
    cfg = json.loads((source / "cfg.json").read_text())
    cfg["rescale_acts_by_decoder_norm"] = True
    (tmp_path / "sae" / "cfg.json").write_text(json.dumps(cfg))
    sae = ek.SAE.load(tmp_path / "sae")
    norms = weights["W_dec"].double().norm(dim=-1)
    pre = ((X.double() - weights["b_dec"]) @ weights["W_enc"].double() + weights["b_enc"]) * norms
    top = pre.topk(8, dim=-1)
    acts = torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())
    # The folded weights are float32: within float32 rounding of the activations (up to ~10).
    assert (sae.encode(X.double()) - acts).abs().max() <= 1e-5
    recon = (acts / norms) @ weights["W_dec"].double() + weights["b_dec"]
    assert (sae.decode(sae.encode(X.double())) - recon).abs().max() <= 1e-5


@pytest.mark.parametrize(
    ("hook", "where"),
    [
        ("blocks.0.hook_resid_pre", (0, "resid")),
        ("blocks.4.hook_resid_pre", (4, "resid")),
        ("blocks.4.hook_resid_post", (5, "resid")),
        ("blocks.4.hook_resid_mid", (5, "resid_mid")),
        ("blocks.4.hook_attn_out", (5, "attn")),
        ("blocks.4.hook_mlp_out", (5, "mlp")),
        ("model.layers.4", (5, "resid")),
        ("layers.4.mlp", (5, "mlp")),
        ("model.layers.4.self_attn", (5, "attn")),
        ("model.embed_tokens", (0, "resid")),
    ],
)
def test_hook_names(hook, where):
    assert site_of_hook(hook) == where


def test_unknown_hook_names_the_known_ones():
    with pytest.raises(InvalidRequest, match=r"give site= and layer=.*hook_resid_post"):
        site_of_hook("blocks.3.attn.hook_z")


def test_site_and_layer_override_the_hook():
    sae = ek.SAE.load(DATA / "saelens_standard", layer=1, site="resid_mid")
    assert (sae.layer, sae.site) == (1, "resid_mid")


def _copy(tmp_path: Path, name: str) -> Path:
    return Path(shutil.copytree(DATA / name, tmp_path / name))


def test_refusals(tmp_path):
    gated = _copy(tmp_path, "saelens_standard")
    cfg = json.loads((gated / "cfg.json").read_text())
    (gated / "cfg.json").write_text(json.dumps({**cfg, "architecture": "gated"}))
    with pytest.raises(InvalidRequest, match=r"'gated' is not supported.*jumprelu"):
        ek.SAE.load(gated)

    truncated = _copy(tmp_path, "saelens_jumprelu")
    blob = (truncated / "sae_weights.safetensors").read_bytes()
    (truncated / "sae_weights.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(InvalidRequest, match="not a readable safetensors file"):
        ek.SAE.load(truncated)

    corrupt = _copy(tmp_path, "saelens_topk")
    (corrupt / "sae_weights.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(InvalidRequest, match="not a readable safetensors file"):
        ek.SAE.load(corrupt)

    nan = _copy(tmp_path, "saelens_standard_norm")
    weights = load_file(nan / "sae_weights.safetensors")
    weights["W_dec"][3, 5] = float("nan")
    save_file(weights, nan / "sae_weights.safetensors")
    with pytest.raises(InvalidRequest, match="W_dec holds NaN"):
        ek.SAE.load(nan)

    with pytest.raises(InvalidRequest, match="give layer="):
        ek.SAE.load(DATA / "gemma_scope")
    with pytest.raises(InvalidRequest, match="holds no SAE"):
        ek.SAE.load(tmp_path)


def test_checks_against_an_engine():
    info = SimpleNamespace(name="tiny", path="/x/tiny", d_model=128, n_layers=4)
    sae = ek.SAE.load(DATA / "saelens_standard")
    sae.check_engine(info)
    with pytest.raises(InvalidRequest, match="d_model=576"):
        sae.check_engine(SimpleNamespace(**{**vars(info), "d_model": 576}))
    other = SimpleNamespace(**{**vars(info), "name": "demo", "path": "/x/demo"})
    with pytest.raises(InvalidRequest, match=r"trained on 'tiny'.*model_check=False"):
        sae.check_engine(other)
    ek.SAE.load(DATA / "saelens_standard", model_check=False).check_engine(other)
    with pytest.raises(InvalidRequest, match="past tiny's 2 layers"):
        sae.check_engine(SimpleNamespace(**{**vars(info), "n_layers": 2}))


def test_features_and_clamps_are_checked():
    sae = ek.SAE.load(DATA / "saelens_topk")
    assert sae.check_feature(np.int64(7)) == 7
    with pytest.raises(InvalidRequest, match=r"out of range.*256"):
        sae.check_feature(256)
    with pytest.raises(InvalidRequest, match="integer id"):
        sae.check_feature("3")
    with pytest.raises(InvalidRequest, match="2 features but 3 values"):
        ek.Clamp(sae, [1, 2], [0.0, 1.0, 2.0]).pairs()
    with pytest.raises(InvalidRequest, match="finite"):
        ek.Clamp(sae, 1, float("inf")).pairs()
    steer = ek.Steer.from_feature(sae, 3, 2.0)
    assert (steer.layer, steer.site) == (2, "resid")  # an MLP write goes into the stream after it
    assert torch.equal(steer.vector, sae.W_dec[3])
