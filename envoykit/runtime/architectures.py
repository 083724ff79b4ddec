"""Tiny random-weight checkpoints of many architectures, built locally like the ``tiny`` model.

Each entry of :data:`ARCHITECTURES` names a transformers config and model class and the config
values that shrink it: 4 attention heads of width 32 (64 where the architecture needs it), 2 KV
heads where the architecture has them (TP=2 splits them, TP=4 replicates them), MLP and expert
widths divisible by 4, 4 experts of which 2 are routed to, 4 layers. :func:`build` writes the
shared byte-level BPE tokenizer, the config and float32 safetensors; the weights come from seed 0
with the same wide init spread (0.25) as ``tiny``, after which every 1-D tensor (norm weights,
biases, attention sinks, router biases) and every bias gets a fixed-seed random shift, so a
runtime that drops or misplaces one of them gives different outputs.

Every entry builds in transformers, runs in vLLM's CPU backend at TP=1 and TP=2, and vLLM's
prompt log-probs match transformers' float32 ones to about 1e-5; the comments say which values
had to change to get there. Gemma 2 and 3 (tied embeddings scaled by sqrt(hidden)) predict the
current token at every position, so for those only log-prob differences say much, not top-1.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envoykit.runtime.tokenizer import build_tokenizer


@dataclass(frozen=True)
class Architecture:
    """One tiny checkpoint: transformers' config and model class names and the config values."""

    name: str
    config_class: str
    model_class: str
    overrides: Mapping[str, Any] = field(default_factory=dict, hash=False)
    moe: bool = False
    # Keys added to the saved config.json that the config class does not write itself.
    extra_config: Mapping[str, Any] = field(default_factory=dict, hash=False)


# Llama-style config keys, shared by most decoders.
_DECODER: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
)
_MOE: dict[str, Any] = dict(num_experts_per_tok=2)
# A window narrower than a short prompt, so that the sliding layers see less than the full ones.
_WINDOW = 4


def _deepseek_yarn(mscale: float) -> dict[str, Any]:
    """DeepSeek's YaRN: factor 40 over 4096 positions, softmax scale corrected by ``mscale``."""
    return dict(
        max_position_embeddings=4096 * 40,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=mscale,
            mscale_all_dim=mscale,
        ),
    )


_TABLE: list[Architecture] = [
    Architecture("llama", "LlamaConfig", "LlamaForCausalLM", {**_DECODER}),
    Architecture(
        "mistral", "MistralConfig", "MistralForCausalLM", {**_DECODER, "sliding_window": None}
    ),
    Architecture("qwen2", "Qwen2Config", "Qwen2ForCausalLM", {**_DECODER}),
    Architecture("qwen3", "Qwen3Config", "Qwen3ForCausalLM", {**_DECODER}),
    Architecture("gemma", "GemmaConfig", "GemmaForCausalLM", {**_DECODER}),
    # transformers' SDPA attention (its default) silently drops the attention-logit soft-cap;
    # the checkpoint asks for eager attention so that a plain from_pretrained applies it.
    Architecture(
        "gemma2",
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            **_DECODER,
            "query_pre_attn_scalar": 32,
            "sliding_window": _WINDOW,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            # Applied by vLLM and by transformers' eager attention (agreeing to 7e-6);
            # transformers' default SDPA attention drops it without a word, hence the
            # saved config's attn_implementation.
            "attn_logit_softcapping": 10.0,
            "final_logit_softcapping": 30.0,
        },
        extra_config={"attn_implementation": "eager"},
    ),
    Architecture(
        "gemma3",
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            **_DECODER,
            "query_pre_attn_scalar": 32,
            "sliding_window": _WINDOW,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        },
    ),
    Architecture(
        "phi3",
        "Phi3Config",
        "Phi3ForCausalLM",
        {**_DECODER, "original_max_position_embeddings": 256},
    ),
    Architecture(
        "granite",
        "GraniteConfig",
        "GraniteForCausalLM",
        {
            **_DECODER,
            "embedding_multiplier": 4.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 1 / 32,
            "logits_scaling": 2.0,
        },
    ),
    # Cohere's default logit scale (1/16) would flatten the next-token distribution.
    Architecture("cohere", "CohereConfig", "CohereForCausalLM", {**_DECODER, "logit_scale": 0.5}),
    # vLLM's StableLM has no q/k layer norms, so qk_layernorm stays off.
    Architecture(
        "stablelm", "StableLmConfig", "StableLmForCausalLM", {**_DECODER, "use_qkv_bias": True}
    ),
    Architecture("olmo", "OlmoConfig", "OlmoForCausalLM", {**_DECODER, "clip_qkv": 4.0}),
    Architecture("olmo2", "Olmo2Config", "Olmo2ForCausalLM", {**_DECODER}),
    Architecture(
        "gpt_neox",
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            max_position_embeddings=256,
        ),
    ),
    Architecture(
        "gpt2",
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_embd=128, n_inner=256, n_layer=4, n_head=4, n_positions=256),
    ),
    Architecture(
        "gptj",
        "GPTJConfig",
        "GPTJForCausalLM",
        dict(n_embd=128, n_inner=256, n_layer=4, n_head=4, n_positions=256, rotary_dim=16),
    ),
    # Falcon-40B's layout (grouped KV heads, two parallel norms). vLLM's Falcon MLP is always
    # 4 * hidden_size wide, whatever ffn_hidden_size says.
    Architecture(
        "falcon",
        "FalconConfig",
        "FalconForCausalLM",
        dict(
            hidden_size=128,
            ffn_hidden_size=512,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_kv_heads=2,
            new_decoder_architecture=True,
            num_ln_in_parallel_attn=2,
            parallel_attn=True,
            max_position_embeddings=256,
        ),
    ),
    Architecture(
        "mixtral",
        "MixtralConfig",
        "MixtralForCausalLM",
        {**_DECODER, **_MOE, "intermediate_size": 128, "num_local_experts": 4},
        moe=True,
    ),
    Architecture(
        "qwen2_moe",
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            **_DECODER,
            **_MOE,
            "num_experts": 4,
            "moe_intermediate_size": 128,
            "shared_expert_intermediate_size": 256,
        },
        moe=True,
    ),
    Architecture(
        "qwen3_moe",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            **_DECODER,
            **_MOE,
            "num_experts": 4,
            "moe_intermediate_size": 128,
            "norm_topk_prob": True,
        },
        moe=True,
    ),
    Architecture(
        "olmoe",
        "OlmoeConfig",
        "OlmoeForCausalLM",
        {**_DECODER, **_MOE, "intermediate_size": 128, "num_experts": 4},
        moe=True,
    ),
    # Multi-head latent attention: vLLM's CPU MLA takes a latent of kv_lora_rank 512 plus a rope
    # part of 64 (narrower latents are refused). V2-Lite style: no query compression, one dense
    # layer first, greedy routing, YaRN. The YaRN rope is needed on CPU, not only realistic: with
    # plain rope vLLM runs its C++ rotary kernel, which rotates MLA's [tokens, heads, 64] query
    # view wrongly, and the outputs differ from the second token on; YaRN uses PyTorch code.
    Architecture(
        "deepseek_v2",
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        {
            **_DECODER,
            **_MOE,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "q_lora_rank": None,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "moe_intermediate_size": 128,
            "first_k_dense_replace": 1,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            **_deepseek_yarn(0.707),
        },
        moe=True,
    ),
    # V3 style: compressed queries, sigmoid routing with a correction bias over 2 expert groups.
    # transformers' V3 always routes so; vLLM reads topk_method and scoring_func (without them it
    # finds no parameter for the checkpoint's e_score_correction_bias).
    Architecture(
        "deepseek_v3",
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            **_DECODER,
            **_MOE,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "q_lora_rank": 64,
            "kv_lora_rank": 512,
            "qk_rope_head_dim": 64,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "moe_intermediate_size": 128,
            "first_k_dense_replace": 1,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 2.5,
            "num_nextn_predict_layers": 0,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            **_deepseek_yarn(1.0),
        },
        moe=True,
    ),
    # Attention sinks, biased experts, alternating sliding and full layers, YaRN.
    Architecture(
        "gpt_oss",
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            **_DECODER,
            **_MOE,
            "head_dim": 64,
            "intermediate_size": 128,
            "num_local_experts": 4,
            "sliding_window": _WINDOW,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "max_position_embeddings": 131072,  # YaRN's factor 32 over 4096 positions
        },
        moe=True,
    ),
    # Outside envoykit's readout contract (vLLM serves it through its Transformers backend):
    # the matrix checks that an architecture without a family is refused, saying what works.
    Architecture("starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", {**_DECODER}),
]

ARCHITECTURES: dict[str, Architecture] = {arch.name: arch for arch in _TABLE}

_PERTURB_SEED = 1
_PERTURB_STD = 0.2


def build(name: str, out: Path) -> None:
    """Write the tiny ``name`` checkpoint (tokenizer, config, float32 weights) into ``out``."""
    import torch
    import transformers

    arch = ARCHITECTURES[name]
    out = Path(out)
    vocab_size = build_tokenizer(out)
    config = getattr(transformers, arch.config_class)(
        vocab_size=vocab_size,
        initializer_range=0.25,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
        dtype="float32",
        **arch.overrides,
    )
    torch.manual_seed(0)
    model = getattr(transformers, arch.model_class)(config)
    _perturb(model)
    model.save_pretrained(out, safe_serialization=True)
    if arch.extra_config:
        config_file = out / "config.json"
        saved = json.loads(config_file.read_text())
        config_file.write_text(
            json.dumps({**saved, **arch.extra_config}, indent=2, sort_keys=True) + "\n"
        )


def _perturb(model) -> None:
    """Shift norm weights, biases and other 1-D tensors off their init (ones or zeros)."""
    import torch

    generator = torch.Generator().manual_seed(_PERTURB_SEED)
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if not tensor.is_floating_point():
                continue
            if tensor.ndim == 1 or key.endswith("bias"):
                noise = torch.randn(tensor.shape, generator=generator) * _PERTURB_STD
                tensor.add_(noise.to(tensor.dtype))
