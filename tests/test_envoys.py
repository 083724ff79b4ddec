"""Ad-hoc calls on sharded modules take and return whole tensors; shards are refused.

Every property is checked at TP=1 and TP=2 on ``tiny``; the unembedding also on a model with
tied embeddings and one with a logit soft-cap. Tolerances: the last layer's unembedding
equals the model's own logits exactly (float32); an intermediate layer equals plain
transformers to 1e-4 relative; TP=2 equals TP=1 to 1e-5 relative. The checkpoint-order
arithmetic and the fragment rules each worker installs are also checked without an engine
(`tests/unit/test_checkpoint_order.py`).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import rank_processes, start
from reference import attribution, lens_logits, sublayer_logits

import envoykit as ek
from envoykit.model.readout import at
from envoykit.runtime import platform

pytestmark = pytest.mark.engine

PROMPT = "The capital of France is"


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def unembed_layer(engine: ek.Engine, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``unembed(norm(hidden, residual))`` after decoder layer ``layer`` (1-based); logits."""
    readout = engine.readout
    layers = at(engine.model, readout.layers)
    norm = at(engine.model, readout.final_norm)
    head = at(engine.model, readout.unembedding)
    with engine.trace(PROMPT):
        hidden, residual = layers[layer - 1].output
        lens = head(norm(hidden.clone(), residual.clone())[0]).save()
        logits = engine.model.logits.save()
    return lens, logits


# The plain model at both TP sizes; the variants (tied embeddings, Gemma 2's soft-cap and
# norms) at TP=2 only, where sharding can go wrong: each compares with transformers, so TP=1
# adds an engine start and no check TP=2 does not make.
VARIANTS = [("tiny", 1), ("tiny", 2), ("tiny-tied", 2), ("tiny-softcap", 2)]


@pytest.fixture(scope="module", params=VARIANTS, ids=[f"{m}-{tp}" for m, tp in VARIANTS])
def variant_engine(request, tiny_engines):
    """One engine per (variant, TP); the plain tiny ones are the session's."""
    model, tp = request.param
    if model == "tiny":
        yield tiny_engines[tp]
        return
    with start(model, tp) as engine:
        yield engine


class TestUnembedding:
    """``lm_head`` on whole hidden states gives whole logits on every rank, as the model does."""

    def test_last_layer_equals_model_logits_exactly(self, variant_engine):
        engine = variant_engine
        lens, logits = unembed_layer(engine, engine.info.n_layers)
        assert lens.shape == (len(engine.tokenizer(PROMPT)["input_ids"]), engine.info.vocab)
        assert torch.equal(lens[-1], logits[-1])

    def test_intermediate_layer_matches_transformers(self, variant_engine):
        engine = variant_engine
        lens, _ = unembed_layer(engine, 2)
        reference, _ = lens_logits(engine.info.path, PROMPT)
        assert relative(lens, reference[2]) <= 1e-4

    def test_tp2_equals_tp1(self, tiny_engines):
        lens1, _ = unembed_layer(tiny_engines[1], 3)
        lens2, _ = unembed_layer(tiny_engines[2], 3)
        assert relative(lens2, lens1) <= 1e-5

    def test_lm_head_refuses_token_ids(self, tiny2):
        with pytest.raises(ek.InvalidRequest, match="takes hidden states"):
            with tiny2.trace(PROMPT):
                tiny2.model.lm_head(torch.tensor([1, 2, 3])).save()
        assert tiny2.generate(PROMPT, 2)  # still usable


def read_locations(engine: ek.Engine) -> dict[str, torch.Tensor]:
    """Whole-valued reads and ad-hoc calls at one decoder layer."""
    layer = engine.model.model.layers[1]
    ids = torch.tensor(engine.tokenizer(PROMPT)["input_ids"])
    with engine.trace(PROMPT):
        embedded = engine.model.model.embed_tokens(ids).save()
        qkv = layer.self_attn.qkv_proj.output[0].clone().save()
        o_proj = layer.self_attn.o_proj.output[0].clone().save()
        gate_up_in = layer.mlp.gate_up_proj.input.clone()
        gate_up = layer.mlp.gate_up_proj.output[0].clone().save()
        gate_up_adhoc = layer.mlp.gate_up_proj(gate_up_in)[0].save()
        down_in = layer.mlp.down_proj.input.clone()
        down = layer.mlp.down_proj.output[0].clone().save()
        down_adhoc = layer.mlp.down_proj(down_in)[0].save()
    return {
        "embedding": embedded,
        "qkv_proj": qkv,
        "o_proj": o_proj,
        "gate_up_proj": gate_up,
        "gate_up_proj ad hoc": gate_up_adhoc,
        "down_proj": down,
        "down_proj ad hoc": down_adhoc,
    }


class TestWholeAcrossRanks:
    """Reads and ad-hoc calls at TP=2 equal TP=1, in checkpoint order."""

    def test_tp2_equals_tp1(self, tiny_engines):
        one, two = read_locations(tiny_engines[1]), read_locations(tiny_engines[2])
        for name in one:
            assert two[name].shape == one[name].shape, name
            assert relative(two[name], one[name]) <= 1e-5, name

    def test_ad_hoc_call_equals_model_output(self, tiny2):
        reads = read_locations(tiny2)
        assert relative(reads["gate_up_proj ad hoc"], reads["gate_up_proj"]) <= 1e-5
        assert relative(reads["down_proj ad hoc"], reads["down_proj"]) <= 1e-5

    def test_embedding_matches_checkpoint(self, tiny2):
        from reference import load

        model, tokenizer = load(tiny2.info.path)
        ids = tokenizer(PROMPT)["input_ids"]
        embedded = read_locations(tiny2)["embedding"]
        assert torch.equal(embedded, model.model.embed_tokens.weight[ids])

    def test_ranks_run_the_embedding_uncompiled(self, tiny2):
        # vLLM compiles the vocabulary-shard mask to C++ in every rank at the first forward
        # (10-12 s of demo's first lens at TP=3). Compiled, its function would hold an entry
        # in dynamo's cache. (The ranks do compile the corpus lens's own reductions, so
        # inductor's libraries loaded in a rank do not tell.) The embedding above is exact
        # either way.
        import nnsight

        read_locations(tiny2)
        with tiny2.trace(PROMPT):
            import inspect

            from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
            from vllm.model_executor.layers import vocab_parallel_embedding

            mask = inspect.unwrap(vocab_parallel_embedding.get_masked_input_and_mask)
            compiled = nnsight.save(len(_debug_get_cache_entry_list(mask.__code__)))
        assert compiled == 0

    def test_forked_ranks_run_on_the_cores_vllm_gave_them(self, tiny2):
        # A forked rank inherits the engine core's unbound OpenMP runtime and binds itself;
        # unbound, three ranks on two cores ran a forward 40x slower.
        binding = platform.core_binding(platform.usable_cpus(), 2).split("|")
        assert [rank.cpu_affinity() for rank in rank_processes(tiny2)] == [
            [int(cpu) for cpu in cores.split(",")] for cores in binding
        ]


def logits_with_up_zeroed(engine: ek.Engine) -> tuple[torch.Tensor, torch.Tensor]:
    from reference import load

    width = load(engine.info.path)[0].config.intermediate_size  # [gate | up], each this wide
    with engine.trace(PROMPT):
        clean = engine.model.logits.save()
    with engine.trace(PROMPT):
        engine.model.model.layers[1].mlp.gate_up_proj.output[0][:, width:] = 0
        edited = engine.model.logits.save()
    return clean, edited


class TestCheckpointOrderEdits:
    """An edit written in checkpoint order lands in the same place on every rank."""

    def test_zeroing_up_half_is_identical_at_tp1_and_tp2(self, tiny_engines):
        clean1, edited1 = logits_with_up_zeroed(tiny_engines[1])
        _, edited2 = logits_with_up_zeroed(tiny_engines[2])
        assert relative(edited1, clean1) > 1e-3  # the edit did something
        assert relative(edited2, edited1) <= 1e-5


class TestShardGuard:
    """A location holding one rank's piece is refused at TP>=2 and served at TP=1."""

    def test_act_fn_refused_at_tp2(self, tiny2):
        with pytest.raises(ek.ShardedValue, match=r"mlp\.act_fn\.output.*gate_up_proj\.output"):
            with tiny2.trace(PROMPT):
                tiny2.model.model.layers[0].mlp.act_fn.output.save()
        assert tiny2.generate(PROMPT, 2)  # the engine answers the next request

    def test_act_fn_write_refused_at_tp2(self, tiny2):
        with pytest.raises(ek.ShardedValue, match=r"act_fn\.output"), tiny2.trace(PROMPT):
            tiny2.model.model.layers[0].mlp.act_fn.output = torch.zeros(7, 256)

    def test_act_fn_served_at_tp1(self, tiny1):
        with tiny1.trace(PROMPT):
            value = tiny1.model.model.layers[0].mlp.act_fn.output.save()
        assert value.shape == (len(tiny1.tokenizer(PROMPT)["input_ids"]), 256)

    def test_attention_kernel_refused_at_tp2(self, tiny2):
        with pytest.raises(ek.ShardedValue, match=r"self_attn\.attn"), tiny2.trace(PROMPT):
            tiny2.model.model.layers[0].self_attn.attn.output.save()


class TestLocations:
    """The helper lists whole-valued locations, never a shard."""

    def test_kinds(self, tiny2):
        locations = tiny2.locations()
        kinds = {loc.kind for loc in locations}
        assert kinds == {"embed", "layer", "proj", "attn", "mlp", "norm", "lm_head"}
        assert [loc.layer for loc in locations if loc.kind == "layer"] == [0, 1, 2, 3]
        paths = {loc.path for loc in locations}
        assert "model.layers.0.mlp.act_fn" not in paths
        assert "model.layers.0.self_attn.attn" not in paths


class TestSublayerReadoutOnVariants:
    """Sub-layer sites and attribution read the right places on every architecture: tied
    embeddings (the head is the embedding), Gemma 2 (its own MLP pre-norm, ``1 + weight``
    norms, a logit soft-cap)."""

    TARGETS = (5, 17, 101)

    def test_resid_mid_matches_transformers(self, variant_engine):
        engine = variant_engine
        res = engine.lens(PROMPT, sites=["resid_mid"], top_k=1, targets=list(self.TARGETS))
        reference = torch.softmax(sublayer_logits(engine.info.path, PROMPT, "resid_mid"), -1)
        np.testing.assert_allclose(
            res.target_probs, reference[..., list(self.TARGETS)].numpy(), atol=1e-4
        )

    def test_attribution_sums_to_the_pre_cap_logit(self, variant_engine):
        engine = variant_engine
        att = engine.attribute(PROMPT, list(self.TARGETS))
        values, logits = attribution(engine.info.path, PROMPT, list(self.TARGETS))
        scale = float(logits.abs().max())
        np.testing.assert_allclose(att.values.sum(0), att.logits, atol=1e-4 * scale)
        np.testing.assert_allclose(att.values, values.numpy(), atol=1e-4 * scale)
        cap = att.meta["soft_cap"]
        capped = cap * np.tanh(att.logits / cap) if cap else att.logits
        np.testing.assert_allclose(att.model_logits, capped, atol=1e-5 * scale)
        final = lens_logits(engine.info.path, PROMPT)[0][-1][:, list(self.TARGETS)]
        np.testing.assert_allclose(att.model_logits, final.numpy(), atol=1e-4 * scale)
