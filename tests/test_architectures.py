"""The architecture matrix: every family envoykit reads, at TP=1 and TP=2, against transformers.

Each architecture is a tiny random-weight checkpoint built locally (`envoykit.runtime.
architectures`, ``tiny-<name>``) and started once per TP size, shared by that architecture's
tests. The reference is plain transformers in float32 with forward hooks on that model's own
modules (`tests/arch_reference.py`): its own final norm, head, logit scaling and soft-cap.

Tolerances (float32 on both sides, probabilities): 1e-4 absolute for the lens at every layer
and site, 1e-5 between the lens's last layer and the engine's own logits; logits 1e-3
absolute (scaled by the model's logit scale). Top-1 must agree wherever the top two
reference probabilities are more than 1e-4 apart.
"""

from __future__ import annotations

import arch_reference as ref
import numpy as np
import pytest
import torch

import envoykit as ek
from envoykit.analyses.tuned import offline_texts
from envoykit.model.families import family_of
from envoykit.runtime import architectures

pytestmark = [pytest.mark.engine, pytest.mark.architectures]

PROMPT = "The capital of France is"
OTHER = "The capital of Italy is"  # as many tokens as PROMPT in the shipped tokenizer
TARGETS = [261, 271]  # " the", " is": single tokens of the shipped tokenizer


def _family(arch: architectures.Architecture):
    return family_of(arch.model_class, dict(arch.overrides))


READ = [name for name, arch in architectures.ARCHITECTURES.items() if _family(arch)]
REFUSED = [name for name, arch in architectures.ARCHITECTURES.items() if not _family(arch)]


def _parallel(name: str, tp: int = 1) -> bool:
    """Whether ``name``'s layers run attention and MLP side by side (any TP size)."""
    return _family(architectures.ARCHITECTURES[name]).parallel


class Case:
    """One engine of the matrix: the architecture's name, its engine and the transformers
    reference of its checkpoint."""

    def __init__(self, name: str, engine: ek.Engine) -> None:
        self.name, self.engine = name, engine
        self.parallel = _parallel(name)
        self.ref = ref.reference(engine.info.path, PROMPT, OTHER, self.parallel)


@pytest.fixture(
    scope="module",
    params=[(n, tp) for n in READ for tp in (1, 2)],
    ids=lambda p: f"{p[0]}-tp{p[1]}",
)
def case(request):
    name, tp = request.param
    with ek.Engine(f"tiny-{name}", tensor_parallel_size=tp, progress=False) as engine:
        yield Case(name, engine)


def test_last_layer_is_the_models_own_distribution(case):
    import nnsight

    engine = case.engine
    res = engine.lens(PROMPT, layers=[-1], top_k=5)
    with engine.trace(PROMPT):
        logits = nnsight.save(engine.model.logits.cpu())
    probs = ref.probs(logits.reshape(-1, logits.shape[-1])[-1:])
    want = np.take_along_axis(probs, res.top_ids[0, -1:], -1)
    np.testing.assert_allclose(res.top_probs[0, -1:], want, atol=1e-5, rtol=0)


def test_lens_at_every_layer_matches_transformers(case):
    res = case.engine.lens(PROMPT, layers=("embed", "all"), top_k=5)
    ref.assert_lens_matches(res, case.ref["lens"])


def test_each_sublayer_site_matches_transformers(case):
    sites = ("attn", "mlp") if case.parallel else ("attn", "resid_mid", "mlp")
    res = case.engine.lens(PROMPT, sites=sites, top_k=5)
    for site in sites:
        ref.assert_lens_matches(res.select(sites=site), case.ref["sites"][site])


@pytest.mark.applies(to=_parallel)  # a sequential layer has the site
def test_parallel_blocks_have_no_stream_between_them(case):
    with pytest.raises(ek.InvalidRequest, match="no stream between them"):
        case.engine.lens(PROMPT, sites=("resid_mid",))


def test_attribution_sums_to_the_models_logit(case):
    att = case.engine.attribute(PROMPT, TARGETS)
    want = case.ref["lens"][-1][:, TARGETS].numpy()
    cap = case.ref["soft_cap"]
    np.testing.assert_allclose(att.model_logits, want, atol=1e-3, rtol=1e-4)
    if not cap:
        np.testing.assert_allclose(att.logits, want, atol=1e-3, rtol=1e-4)
    # The rows add up to the logit they split, as exactly as float32 sums allow.
    np.testing.assert_allclose(att.values.sum(0), att.logits, atol=1e-5, rtol=1e-5)


def test_a_mid_layer_patch_equals_a_hook_patch(case):
    res = case.engine.lens(
        OTHER,
        layers=[-1],
        top_k=5,
        patch=ek.Patch(PROMPT, layer=2, source_position=-1, target_position=-1),
    )
    ref.assert_lens_matches(res, case.ref["patched"][None])


@pytest.mark.parametrize("norm_match", [False, True])
def test_a_steer_equals_a_hook_addition(case, norm_match):
    vector = ref.steering_vector(case.engine.info.d_model)
    steer = ek.Steer(vector, 2, norm_match=norm_match)
    res = case.engine.lens(PROMPT, layers=[-1], top_k=5, steer=steer)
    ref.assert_lens_matches(res, case.ref["steered_norm" if norm_match else "steered"][None])
    plain = case.engine.lens(PROMPT, layers=[-1], top_k=5)
    assert not np.allclose(plain.top_probs, res.top_probs, atol=1e-6)  # the steer took effect


def test_attention_patterns_equal_transformers_eager(case):
    engine = case.engine
    if isinstance(engine.readout.heads, str):  # multi-head latent attention (DeepSeek)
        with pytest.raises(ek.InvalidRequest, match="no standard attention kernel"):
            engine.attention(PROMPT)
        return
    want = case.ref["attentions"].numpy()
    res = engine.attention(PROMPT)
    assert res.weights.shape == want.shape
    # The first layer's queries and keys come from the embedding, the same on both sides:
    # there the pattern is exact to float32 rounding. Deeper, vLLM's and transformers'
    # streams drift apart by float32 rounding too, amplified in the tiny models' sharp
    # attention (measured at most 2.4e-5, GPT-OSS's fourth layer).
    np.testing.assert_allclose(res.weights[0], want[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(res.weights, want, atol=5e-5, rtol=0)
    sums = res.weights.astype(np.float64).sum(-1)
    if case.name == "gpt_oss":  # its sinks take a share of every row
        assert (sums < 1 - 1e-3).any() and (sums <= 1 + 1e-5).all()
    else:
        np.testing.assert_allclose(sums, 1.0, atol=1e-5)
    top = engine.attention(PROMPT, layers=[-1], heads=[0, -1], queries=[-1], top_k=2)
    last = want[-1][[0, -1]][:, -1:]  # [heads, 1, T]
    np.testing.assert_allclose(top.weights[0], -np.sort(-last, -1)[..., :2], atol=5e-5)
    full = res.weights[-1][[0, -1]][:, -1:]
    np.testing.assert_array_equal(top.keys[0], np.argsort(-full, -1, kind="stable")[..., :2])


@pytest.mark.applies(to=lambda name, tp: tp == 1)  # at TP > 1 the kernel's output is a piece
def test_attention_patterns_reproduce_the_kernels_own_output(case):
    """At TP=1 the kernel's output is whole: the pattern times the kernel's values must be
    it (float32 rounding, relative to the output), at every layer, with no drift between
    two implementations in the way."""
    import nnsight

    from envoykit.model.readout import at, rank_inputs
    from envoykit.ranks.heads import local_patterns, query_key

    engine = case.engine
    if isinstance(engine.readout.heads, str):
        pytest.skip(f"no attention kernel to read: {engine.readout.heads}")
    layout, model, path = engine.readout.heads, engine.model, engine.readout.layers
    with engine.trace(PROMPT):
        layers = at(model, path)
        gaps = nnsight.save([])
        for layer in layers:
            kernel = at(layer, layout.attention)
            args, kwargs = rank_inputs(kernel)
            query, key = query_key(args, kwargs)
            value = args[2] if len(args) > 2 else kwargs["value"]
            weights = local_patterns(kernel._module, query, key, torch.arange(key.shape[0]))
            size = value.shape[-1] // layout.n_kv_heads
            v = value.float().unflatten(-1, (-1, size))
            v = v.repeat_interleave(layout.n_heads // layout.n_kv_heads, dim=1)
            mixed = torch.einsum("hqk,khd->qhd", weights, v).flatten(1)
            out = kernel.output
            out = (out[0] if isinstance(out, tuple) else out).float().reshape(mixed.shape)
            gaps.append(float((mixed - out).abs().max() / out.abs().max()))
    assert max(gaps) < 1e-5, gaps  # relative to the output's largest value


def test_head_patching_and_ablation_equal_hook_edits(case):
    engine = case.engine
    patch = ek.Patch(PROMPT, layer=2, site="head", head=1)
    if isinstance(engine.readout.heads, str):
        with pytest.raises(ek.InvalidRequest, match="head patching"):
            engine.lens(OTHER, layers=[-1], patch=patch)
        return
    res = engine.lens(OTHER, layers=[-1], top_k=5, patch=patch)
    ref.assert_lens_matches(res, case.ref["head_patched"][None])
    for kind in ("zero", "mean"):
        res = engine.lens(PROMPT, layers=[-1], top_k=5, patch=ek.Ablate(2, 1, kind=kind))
        ref.assert_lens_matches(res, case.ref[f"head_{kind}"][None])
    clean = engine.lens(PROMPT, layers=[-1], top_k=5)
    assert not np.allclose(clean.top_probs, res.top_probs, atol=1e-6)  # the edit took effect


def test_head_attribution_adds_up_to_each_layers_attention(case):
    engine = case.engine
    if isinstance(engine.readout.heads, str):
        with pytest.raises(ek.InvalidRequest, match="per-head attributions"):
            engine.attribute(PROMPT, TARGETS, heads=True)
        return
    family = _family(architectures.ARCHITECTURES[case.name])
    if family.name in ("gemma2", "hf-post-norm"):  # a norm follows the attention
        with pytest.raises(ek.InvalidRequest, match="not its heads' writes summed"):
            engine.attribute(PROMPT, TARGETS, heads=True)
        return
    att = engine.attribute(PROMPT, TARGETS, heads=True)  # its constructor checks the sum
    n_positions = len(att.positions)
    assert att.head_values.shape == (engine.info.n_layers, engine.info.n_heads, n_positions, 2)
    plain = engine.attribute(PROMPT, TARGETS)
    np.testing.assert_allclose(att.values, plain.values, atol=1e-5)
    assert np.abs(att.head_values).max() > 0


def test_compare_sweep_generation_and_tuned_lens_run(case):
    engine = case.engine
    diff = ek.compare((engine, PROMPT), (engine, OTHER), targets=TARGETS[:1])
    assert np.isfinite(diff.js).all() and diff.js.max() > 0
    same = ek.compare((engine, PROMPT), (engine, PROMPT))
    np.testing.assert_allclose(same.js, 0.0, atol=1e-9)
    sweep = engine.patch_sweep(
        PROMPT, OTHER, layers=[1, 2], positions=[-1], target_token=TARGETS[0], progress=False
    )
    # Layer 2's cell is the hook-patched transformers run; each cell is the patched lens.
    hooked = ref.probs(case.ref["patched"])[-1, TARGETS[0]]
    np.testing.assert_allclose(sweep.values[1, 0], hooked, atol=ref.PROB_TOL, rtol=0)
    for row, layer in enumerate([1, 2]):
        patch = ek.Patch(PROMPT, layer=layer, source_position=-1, target_position=-1)
        patched = engine.lens(OTHER, layers=[-1], targets=TARGETS[:1], patch=patch)
        np.testing.assert_allclose(
            sweep.values[row, 0], patched.target_probs[0, -1, 0], atol=1e-6, rtol=0
        )
    generated = engine.lens(PROMPT, generate=2, top_k=3)
    assert generated.n_generated == 2
    # The tuned lens against its translators applied to transformers' streams in float64
    # (at TP=2, the split case; the reference's own process costs seconds per engine).
    if engine.info.tp > 1:
        tuned = ek.TunedLens.train(engine, offline_texts()[0], steps=2, progress=False)
        lensed = engine.lens(PROMPT, layers=("embed", "all"), top_k=5, translator=tuned)
        path, parallel = engine.info.path, case.parallel
        ref.assert_lens_matches(lensed, ref.tuned_logits(path, PROMPT, parallel, tuned.to_bytes()))


def test_collect_and_lens_corpus_equal_transformers_and_the_per_prompt_lens(case, tmp_path):
    """The corpus work reads through the same walker as the lens: the store holds
    transformers' streams (1e-4 of the largest value of each row), and the corpus lens's
    per-layer means are those of the per-prompt lens."""
    engine, texts, rows = case.engine, [PROMPT, OTHER], ["embed", "all"]
    store = engine.collect(
        texts, out=tmp_path / "acts", layers=rows, dtype="float32", progress=False
    )
    assert store.complete and store.layers == list(range(engine.info.n_layers + 1))
    for layer in store.layers:
        got, want = store.document(0, layer), case.ref["streams"][layer]
        scale = max(float(want.abs().max()), 1.0)
        assert float((got - want).abs().max()) <= 1e-4 * scale, (layer, scale)
    res = engine.lens_corpus(texts, layers=rows, top_k=1, progress=False)
    lensed = engine.lens(texts, layers=rows, top_k=1)
    for name in ("kl", "entropy"):
        per_token = np.concatenate([getattr(r, name) for r in lensed], axis=1)
        # Both are float32 means over the same values, summed in another order: a few ulps
        # apart (deepseek_v3's KL of 7.5 differed by 2.3e-6, 5 ulps).
        np.testing.assert_allclose(getattr(res, name), per_token.mean(1), rtol=1e-6, atol=1e-6)
    agree = np.concatenate([r.top_ids[:, :, 0] == r.top_ids[-1:, :, 0] for r in lensed], axis=1)
    np.testing.assert_array_equal(res.agreement, agree.mean(1))


def test_sae_features_equal_float64_on_transformers_streams(case):
    """A random TopK SAE and a random JumpReLU SAE (d_sae = 4 * d_model), on the stream after
    layer 2 and on layer 2's MLP write, read in one trace: activations within 1e-5 of the
    largest, the same top features, equal L0, against the SAE in float64 on transformers'
    own streams."""
    d = case.engine.info.d_model
    generator = torch.Generator().manual_seed(1)
    W_dec = torch.nn.functional.normalize(torch.randn(4 * d, d, generator=generator), dim=-1)
    b_enc = torch.randn(4 * d, generator=generator) * 0.1
    threshold = torch.rand(4 * d, generator=generator) * 0.2
    saes = [
        ek.SAE("topk", W_dec.T.clone(), b_enc, W_dec, torch.zeros(d), layer=2, k=8),
        ek.SAE(
            "jumprelu",
            W_dec.T.clone(),
            b_enc,
            W_dec,
            b_enc[:d],
            layer=2,
            site="mlp",
            threshold=threshold,
        ),
    ]
    for sae, res in zip(saes, case.engine.features(PROMPT, saes, top_k=8)):
        x = case.ref["site_streams"][sae.site][sae.layer - 1].double()
        pre = (x - sae.b_dec.double()) @ sae.W_enc.double() + sae.b_enc.double()
        if sae.architecture == "topk":
            top = pre.topk(sae.k, dim=-1)
            acts = torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())
        else:
            acts = pre.relu() * (pre > sae.threshold.double())
        best = acts.topk(8, dim=-1)
        fired = (best.values > 0).numpy()
        np.testing.assert_array_equal(res.top_ids[fired], best.indices.numpy()[fired])
        np.testing.assert_allclose(
            res.top_acts, best.values.numpy(), atol=1e-5 * float(acts.max()), rtol=0
        )
        np.testing.assert_array_equal(res.l0, (acts > 0).sum(-1).numpy())


@pytest.mark.parametrize("name", REFUSED)
def test_refused_architectures_say_what_still_works(name):
    with ek.Engine(f"tiny-{name}", tensor_parallel_size=1, progress=False) as engine:
        assert not engine.info.validated
        with pytest.raises(ek.InvalidRequest, match="Plain traces still work"):
            engine.lens(PROMPT)
        with engine.trace(PROMPT):
            out = engine.model.logits.save()
        assert out.shape[-1] == engine.info.vocab
