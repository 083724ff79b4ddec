"""SAE features on the ranks against an independent reference: plain transformers in float32
(forward hooks), with the SAE applied in float64 by formulas written here, not by envoykit.

The SAEs are the files the real SAELens and sparsify wrote (tests/data/sae), which fit
``tiny`` (d_model 128, model name "tiny"). Tolerances: feature activations within 1e-5 of
the largest activation (relative), the same top features and L0; squared errors within 1e-4
relative; a spliced or clamped run's final distribution within 1e-4 in probability of the
transformers hook that makes the same edit, and its greedy tokens identical.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from reference import load, residual_streams, sublayer_streams

import envoykit as ek
from envoykit.errors import InvalidRequest

pytestmark = pytest.mark.engine

DATA = Path(__file__).resolve().parent / "data" / "sae"
PROMPT = "The capital of France is Paris, and the capital of Italy is"
NAMES = [
    "saelens_standard",
    "saelens_jumprelu",
    "saelens_topk",
    "saelens_standard_norm",
    "saelens_standard_layernorm",
    "sparsify_topk",
    "gemma_scope",
]


def load_sae(name: str) -> ek.SAE:
    return ek.SAE.load(DATA / name, **({"layer": 3} if name == "gemma_scope" else {}))


def reference_acts(sae: ek.SAE, x: torch.Tensor) -> torch.Tensor:
    """Activations in float64, from the SAE's tensors, as SAELens defines them."""
    x = x.double()
    scale, shift = (
        torch.ones(x.shape[0], 1, dtype=x.dtype),
        torch.zeros(x.shape[0], 1, dtype=x.dtype),
    )
    if sae.normalize_activations == "constant_norm_rescale":
        scale = x.norm(dim=-1, keepdim=True) / x.shape[-1] ** 0.5
        x = x / scale
    elif sae.normalize_activations == "layer_norm":
        shift = x.mean(-1, keepdim=True)
        scale = (x - shift).std(-1, keepdim=True)
        x = (x - shift) / (scale + 1e-5)
    if sae.apply_b_dec_to_input:
        x = x - sae.b_dec.double()
    pre = x @ sae.W_enc.double() + sae.b_enc.double()
    if sae.architecture == "topk":
        top = pre.topk(sae.k, dim=-1)
        acts = torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())
    elif sae.architecture == "jumprelu":
        acts = pre.relu() * (pre > sae.threshold.double())
    else:
        acts = pre.relu()
    return acts, scale, shift


def reference_recon(sae: ek.SAE, x: torch.Tensor) -> torch.Tensor:
    acts, scale, shift = reference_acts(sae, x)
    return (acts @ sae.W_dec.double() + sae.b_dec.double()) * scale + shift


def stream_at(path: str, prompt: str, layer: int, site: str) -> torch.Tensor:
    """transformers' stream (or block write) at envoykit's (layer, site)."""
    if site == "resid":
        _, tokenizer = load(path)
        return residual_streams(path, tokenizer(prompt)["input_ids"])[layer]
    return sublayer_streams(path, prompt)[site][layer - 1]


def edited_logits(path: str, ids: list[int], layer: int, edit) -> torch.Tensor:
    """Final logits ``[positions, vocab]`` with ``edit`` (float64 stream -> float64 stream)
    applied to the stream after decoder layer ``layer`` at every position: a forward hook on
    plain transformers."""
    model, _ = load(path)

    def hook(module, args, out):
        stream = out[0] if isinstance(out, tuple) else out
        stream[0] = edit(stream[0].double()).to(stream.dtype)
        return out

    handle = model.model.layers[layer - 1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float()
    finally:
        handle.remove()


def edited_greedy(path: str, prompt: str, layer: int, edit, tokens: int) -> list[int]:
    _, tokenizer = load(path)
    ids = list(tokenizer(prompt)["input_ids"])
    start = len(ids)
    for _ in range(tokens):
        ids.append(int(edited_logits(path, ids, layer, edit)[-1].argmax()))
    return ids[start:]


def assert_final_matches(res: ek.LensResult, logits: torch.Tensor) -> None:
    """The last lens row (the model's output) against reference logits: the same top ids,
    probabilities within 1e-4."""
    probs = torch.softmax(logits.double(), dim=-1)
    k = res.top_ids.shape[-1]
    top = probs.topk(k, dim=-1)
    assert (res.top_ids[-1] == top.indices.numpy()).mean() == 1.0
    np.testing.assert_allclose(res.top_probs[-1], top.values.numpy(), atol=1e-4)


@pytest.mark.parametrize("tp", [1, 2])
def test_features_equal_the_float64_reference(tiny_engines, tp):
    """Seven SAEs of four sites read in one trace; each equals the reference."""
    engine = tiny_engines[tp]
    saes = [load_sae(name) for name in NAMES]
    tracked = [0, 17, 255]
    results = engine.features(PROMPT, saes, top_k=8)
    assert len(results) == len(saes)
    for sae, res in zip(saes, results):
        x = stream_at(engine.info.path, PROMPT, sae.layer, sae.site)
        acts, _, _ = reference_acts(sae, x)
        top = acts.topk(8, dim=-1)
        scale = float(acts.abs().max())
        fired = top.values > 0
        assert res.top_ids[fired.numpy()].tolist() == top.indices[fired].tolist(), sae.source
        assert (res.top_ids[~fired.numpy()] == -1).all()
        np.testing.assert_allclose(res.top_acts, top.values.numpy(), atol=1e-5 * scale)
        np.testing.assert_array_equal(res.l0, (acts > 0).sum(-1).numpy())
        err = (x.double() - reference_recon(sae, x)).square().sum(-1)
        np.testing.assert_allclose(res.sq_error, err.numpy(), rtol=1e-4, atol=1e-6)
        centered = (x.double() - x.double().mean(0)).square().sum(-1)
        np.testing.assert_allclose(res.sq_centered, centered.numpy(), rtol=1e-5)
        assert res.meta["sae"]["key"] == sae.key and res.meta["tp"] == tp
    one = engine.features(PROMPT, saes[2], features=tracked)
    x = stream_at(engine.info.path, PROMPT, saes[2].layer, saes[2].site)
    acts, _, _ = reference_acts(saes[2], x)
    np.testing.assert_allclose(
        one.tracked_acts, acts[:, tracked].T.numpy(), atol=1e-5 * float(acts.max())
    )
    np.testing.assert_allclose(
        one.activation(17), acts[:, 17].numpy(), atol=1e-5 * float(acts.max())
    )


def test_tp2_equals_tp1(tiny_engines):
    saes = [load_sae(name) for name in NAMES]
    one, two = (tiny_engines[tp].features([PROMPT, "Hello"], saes, top_k=5) for tp in (1, 2))
    for a_prompt, b_prompt in zip(one, two):
        for a, b in zip(a_prompt, b_prompt):
            np.testing.assert_array_equal(a.top_ids, b.top_ids)
            np.testing.assert_allclose(a.top_acts, b.top_acts, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["saelens_standard", "sparsify_topk", "saelens_standard_norm"])
def test_splice_equals_the_hook_reference(tiny_engines, tp, name):
    engine = tiny_engines[tp]
    sae = load_sae(name)
    res = engine.lens(PROMPT, layers=[sae.layer, -1], top_k=5, splice=sae)
    ids = engine.tokenizer(PROMPT)["input_ids"]
    spliced = edited_logits(engine.info.path, ids, sae.layer, lambda x: reference_recon(sae, x))
    assert_final_matches(res, spliced)
    plain = engine.lens(PROMPT, layers=[-1], top_k=5)
    assert not np.allclose(plain.top_probs, res.top_probs[-1:], atol=1e-3)  # the splice matters
    assert res.meta["splice"]["key"] == sae.key
    # Its distance from the plain model, per position, against transformers' two runs.
    plain_logp = torch.log_softmax(
        edited_logits(engine.info.path, ids, 1, lambda x: x).double(), -1
    )
    spliced_logp = torch.log_softmax(spliced.double(), -1)
    kl = (plain_logp.exp() * (plain_logp - spliced_logp)).sum(-1)
    np.testing.assert_allclose(res.meta["splice"]["kl"], kl.numpy(), rtol=1e-3, atol=1e-4)
    rows = torch.arange(len(ids) - 1)
    ce_plain = -plain_logp[rows, ids[1:]]
    ce_spliced = -spliced_logp[rows, ids[1:]]
    np.testing.assert_allclose(
        res.meta["splice"]["ce_spliced"][:-1], ce_spliced.numpy(), rtol=1e-4, atol=1e-4
    )
    np.testing.assert_allclose(
        res.meta["splice"]["ce_plain"][:-1], ce_plain.numpy(), rtol=1e-4, atol=1e-4
    )
    assert res.meta["splice"]["ce_spliced"][-1] is None
    increase = float((ce_spliced - ce_plain).mean())
    assert abs(res.meta["splice"]["ce_increase"] - increase) <= 1e-4 * max(1.0, abs(increase))


@pytest.mark.parametrize("tp", [1, 2])
def test_clamp_equals_the_hook_reference(tiny_engines, tp):
    engine = tiny_engines[tp]
    sae = load_sae("saelens_jumprelu")
    x = stream_at(engine.info.path, PROMPT, sae.layer, sae.site)
    acts, _, _ = reference_acts(sae, x)
    strongest = int(acts[-1].argmax())
    clamps = [(strongest, 0.0), (7, 40.0)]

    def edit(stream: torch.Tensor) -> torch.Tensor:
        found, _, _ = reference_acts(sae, stream)
        for feature, value in clamps:
            stream = (
                stream + (value - found[:, feature : feature + 1]) * sae.W_dec[feature].double()
            )
        return stream

    clamp = ek.Clamp(sae, [f for f, _ in clamps], [v for _, v in clamps])
    res = engine.lens(PROMPT, layers=[-1], top_k=5, patch=clamp)
    ids = engine.tokenizer(PROMPT)["input_ids"]
    assert_final_matches(res, edited_logits(engine.info.path, ids, sae.layer, edit))
    generated = engine.generate(PROMPT, 8, steer=clamp)
    reference = edited_greedy(engine.info.path, PROMPT, sae.layer, edit, 8)
    assert list(generated.token_ids) == reference[: len(generated.token_ids)]
    assert list(generated.token_ids) != list(engine.generate(PROMPT, 8).token_ids)
    assert res.meta["steer"][0]["clamp"] == ((strongest, 0.0), (7, 40.0))


def test_steer_from_feature_adds_the_decoder_row(tiny2):
    sae = load_sae("saelens_standard")
    steer = ek.Steer.from_feature(sae, 11, 30.0)
    generated = tiny2.generate(PROMPT, 8, steer=steer)
    row = sae.W_dec[11].double()
    reference = edited_greedy(tiny2.info.path, PROMPT, sae.layer, lambda x: x + 30.0 * row, 8)
    assert list(generated.token_ids) == reference[: len(generated.token_ids)]


def test_each_rank_holds_its_slice(tiny2):
    sae = load_sae("saelens_standard")
    held = tiny2.sae_bytes(sae)
    whole = sum(t.numel() * 4 for t in (sae.W_enc, sae.b_enc, sae.W_dec))
    shared = sae.b_dec.numel() * 4  # b_dec is on every rank
    assert held == [whole // 2 + shared] * 2


def test_bad_requests_leave_the_engine_usable(tiny2):
    sae = load_sae("saelens_standard")
    wide = ek.SAE(
        "relu", torch.zeros(576, 8), torch.zeros(8), torch.zeros(8, 576), torch.zeros(576), layer=1
    )
    with pytest.raises(InvalidRequest, match="d_model=128"):
        tiny2.features(PROMPT, wide)
    other = ek.SAE(**{**_fields(sae), "model_name": "SmolLM2-135M-Instruct"})
    with pytest.raises(InvalidRequest, match="model_check=False"):
        tiny2.features(PROMPT, other)
    with pytest.raises(InvalidRequest, match="out of range"):
        tiny2.lens(PROMPT, patch=ek.Clamp(sae, 256, 1.0))
    with pytest.raises(InvalidRequest, match="reads 'mlp'"):
        tiny2.lens(PROMPT, splice=load_sae("saelens_topk"))
    with pytest.raises(InvalidRequest, match="top_k must be"):
        tiny2.features(PROMPT, sae, top_k=0)
    with pytest.raises(InvalidRequest, match=r"an ek.SAE"):
        tiny2.features(PROMPT, "sae/")
    with pytest.raises(InvalidRequest, match="splice"):
        tiny2.lens([PROMPT, "Hello"], compare=True, splice=sae)
    assert tiny2.features(PROMPT, sae, top_k=np.int64(3)).top_ids.shape[1] == 3


def _fields(sae: ek.SAE) -> dict:
    return {name: getattr(sae, name) for name in sae.__dataclass_fields__ if name != "key"}


@pytest.mark.slow
def test_demo_tp3_equals_the_float64_reference(demo3):
    """A 16x TopK SAE on demo's layer 10, sharded over three ranks."""
    d = demo3.info.d_model
    generator = torch.Generator().manual_seed(0)
    W_dec = torch.nn.functional.normalize(torch.randn(16 * d, d, generator=generator), dim=-1)
    sae = ek.SAE(
        "topk",
        W_dec.T.clone(),
        torch.randn(16 * d, generator=generator) * 0.1,
        W_dec,
        torch.zeros(d),
        layer=10,
        k=32,
    )
    res = demo3.features(PROMPT, sae, top_k=16)
    x = stream_at(demo3.info.path, PROMPT, 10, "resid")
    acts, _, _ = reference_acts(sae, x)
    top = acts.topk(16, dim=-1)
    assert (res.top_ids == top.indices.numpy()).all()
    np.testing.assert_allclose(res.top_acts, top.values.numpy(), atol=1e-5 * float(acts.max()))
    assert (res.l0 == 32).all()
    held = demo3.sae_bytes(sae)
    assert max(held) <= 1.05 * (
        sum(t.numel() * 4 for t in (sae.W_enc, sae.b_enc, sae.W_dec)) / 3 + d * 4
    )


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["saelens_jumprelu", "saelens_topk", "saelens_standard_norm"])
def test_feature_attribution_equals_the_reference(tiny_engines, tp, name):
    """Each feature's effect against transformers: the final norm's scale frozen on
    transformers' final stream, the SAE's activations in float64."""
    engine = tiny_engines[tp]
    sae = load_sae(name)
    targets = ["e", 5]  # one token each on tiny
    res = engine.attribute_features(PROMPT, sae, targets, top_k=6)
    model, tokenizer = load(engine.info.path)
    ids = tokenizer(PROMPT)["input_ids"]
    final = residual_streams(engine.info.path, ids)[-1].double()
    norm = model.model.norm
    frozen = torch.rsqrt(final.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    rows = model.lm_head.weight[[int(t) for t in res.target_ids]].detach().double()
    gain = norm.weight.detach().double()
    directions = (frozen * gain)[:, None, :] * rows[None]  # [P, targets, d]
    x = stream_at(engine.info.path, PROMPT, sae.layer, sae.site).double()
    acts, scale, _ = reference_acts(sae, x)
    effects = torch.einsum("pf,fd,pnd->pnf", acts * scale, sae.W_dec.double(), directions)
    top = effects.abs().topk(6, dim=-1).indices
    largest = float(effects.abs().max())
    np.testing.assert_array_equal(res.feature_ids, top.numpy())
    np.testing.assert_allclose(res.effects, effects.gather(-1, top).numpy(), atol=1e-5 * largest)
    np.testing.assert_allclose(res.features, effects.sum(-1).numpy(), atol=1e-5 * largest)
    site = torch.einsum("pd,pnd->pn", x, directions)
    np.testing.assert_allclose(res.site, site.numpy(), atol=1e-4 * float(site.abs().max()))
    total = res.features.astype(np.float64) + res.error + res.bias
    np.testing.assert_allclose(total, res.site, atol=1e-5 * float(np.abs(res.site).max()))


@pytest.mark.parametrize("tp", [1, 2])
def test_logit_effects_equal_the_reference(tiny_engines, tp):
    """A feature's direction alone through transformers' final norm and head."""
    engine = tiny_engines[tp]
    sae = load_sae("saelens_topk")
    res = engine.feature_logits(sae, [3, 200], k=5)
    model, _ = load(engine.info.path)
    with torch.no_grad():
        logits = model.lm_head(model.model.norm(sae.W_dec[[3, 200]])).double()
    for side, values in (("top", logits), ("bottom", -logits)):
        best = values.topk(5, dim=-1)
        np.testing.assert_array_equal(getattr(res, f"{side}_ids"), best.indices.numpy())
        sign = 1.0 if side == "top" else -1.0
        np.testing.assert_allclose(
            getattr(res, f"{side}_logits"), sign * best.values.numpy(), atol=1e-4
        )
    assert res.of(200)["up"][0][0] == engine.tokenizer.decode([int(res.top_ids[1, 0])])
    single = engine.feature_logits(sae, np.int64(200), k=5)  # a numpy integer: one feature
    np.testing.assert_array_equal(single.top_ids, res.top_ids[1:])


def test_splice_lens_with_generation(tiny2):
    """A spliced generation may stop early (at an end-of-sequence token): the lens covers
    the tokens fed back, and the splice's distance covers the prompt's positions."""
    sae = load_sae("saelens_standard")
    res = tiny2.lens("The capital of France is", generate=3, splice=sae, top_k=2)
    n_prompt = len(tiny2.tokenizer("The capital of France is")["input_ids"])
    assert len(res.positions) == n_prompt + res.n_generated <= n_prompt + 3
    assert len(res.meta["splice"]["kl"]) == n_prompt
