"""Layer families: how each kind of decoder layer vLLM serves holds the residual stream.

Every analysis reads and writes the stream through one `Family` (see `envoykit.model.readout`),
so what differs between architectures is written here once, as data:

* what a layer returns — a **pair** whose sum is the stream (``(mlp write, stream before the
  MLP)``: Llama-like and Gemma 2/3 layers), the **stream** itself as one tensor (Granite,
  GPT-2, GPT-J, Falcon and the layers vLLM runs through its Transformers backend), or a tuple
  whose **first** element is the stream (StableLM: ``(stream, stream between the blocks)``;
  Cohere: ``(stream, layer input)``) — never summed;
* (a pair family's final norm and MLP pre-norm are vLLM's fused add-norm,
  ``norm(x, residual)``, which the lens calls the same way so that its last layer equals the
  model's logits to the bit in bfloat16 too; the others' norms take the stream alone);
* where the stream between attention and MLP is: the fused pre-norm's two inputs, the one
  input of a plain pre-norm, the MLP's own input (OLMo 2's post-norm layers), or nowhere
  (parallel attention and MLP: GPT-J, Pythia, Cohere, Falcon-7B);
* for parallel blocks, the module whose output is the attention's write: the attention
  block, or its output projection where the block's own output is a per-rank partial sum at
  TP > 1 (Cohere and parallel Falcon sum attention and MLP over the ranks only after both;
  the projection's value is made whole like any row-parallel layer's);
* (the ``hf-`` families' layers, run by vLLM's Transformers backend, hold ``[1, tokens, d]``
  values, which the readout reads as ``[tokens, d]``).

`family_of` maps a checkpoint's architecture (its config's ``architectures[0]``) to a
family; an architecture missing from `ARCHITECTURES` is not one envoykit reads, and its
analyses are refused with that said (plain traces still work). The same table drives
``envoykit models`` and the architecture tests.
"""

from __future__ import annotations

from dataclasses import dataclass

# How the stream after a layer is read from its output.
PAIR, STREAM, FIRST = "pair", "stream", "first"
# Where the stream between attention and MLP is read.
FUSED_PRENORM, PRENORM_INPUT, MLP_INPUT = "fused-prenorm", "prenorm-input", "mlp-input"


@dataclass(frozen=True)
class Family:
    """One readout convention; see the module docstring for each field's meaning."""

    name: str
    output: str
    mid: str | None
    prenorm: tuple[str, ...] = ()
    attn: tuple[str, ...] = ()

    @property
    def parallel(self) -> bool:
        """Attention and MLP read the same input: no stream between them."""
        return self.mid is None


LLAMA = Family("llama", PAIR, FUSED_PRENORM, prenorm=("post_attention_layernorm",))
GEMMA2 = Family("gemma2", PAIR, FUSED_PRENORM, prenorm=("pre_feedforward_layernorm",))
SEQUENTIAL = Family(
    "sequential", STREAM, PRENORM_INPUT, prenorm=("post_attention_layernorm", "ln_2")
)
PARALLEL = Family("parallel", STREAM, None, attn=("attn",))
FALCON_PARALLEL = Family("falcon-parallel", STREAM, None, attn=("self_attention.dense",))
STABLELM = Family("stablelm", FIRST, PRENORM_INPUT, prenorm=("post_attention_layernorm",))
COHERE = Family("cohere", FIRST, None, attn=("self_attn.o_proj",))
HF_SEQUENTIAL = Family(
    "hf-sequential",
    STREAM,
    PRENORM_INPUT,
    prenorm=("post_attention_layernorm",),
)
HF_PARALLEL = Family("hf-parallel", STREAM, None, attn=("attention",))
HF_POST_NORM = Family("hf-post-norm", STREAM, MLP_INPUT)


@dataclass(frozen=True)
class Architecture:
    """A model class envoykit reads: its family and what sets it apart, in words."""

    name: str
    family: Family
    notes: str = ""
    moe: bool = False


def _architectures() -> dict[str, Architecture]:
    rows = [
        ("LlamaForCausalLM", LLAMA, ""),
        ("MistralForCausalLM", LLAMA, "sliding-window attention"),
        ("Qwen2ForCausalLM", LLAMA, "q/k/v biases"),
        ("Qwen3ForCausalLM", LLAMA, "q/k norms"),
        ("Phi3ForCausalLM", LLAMA, "fused qkv and gate_up in the checkpoint"),
        ("GemmaForCausalLM", LLAMA, "embedding scaled by sqrt(d)"),
        ("Gemma2ForCausalLM", GEMMA2, "sandwich norms, logit and attention soft-caps"),
        ("Gemma3ForCausalLM", GEMMA2, "sandwich norms, q/k norms, sliding + full layers"),
        ("GraniteForCausalLM", SEQUENTIAL, "embedding, residual and logit multipliers"),
        ("GPT2LMHeadModel", SEQUENTIAL, "LayerNorm, learned positions"),
        ("FalconForCausalLM", SEQUENTIAL, "LayerNorm; parallel blocks where its config says so"),
        ("GPTJForCausalLM", PARALLEL, "parallel attention + MLP, LM-head bias"),
        ("StableLmForCausalLM", STABLELM, "LayerNorm, partial rotary"),
        ("CohereForCausalLM", COHERE, "parallel blocks, LayerNorm, logit scale"),
        ("OlmoForCausalLM", HF_SEQUENTIAL, "Transformers backend, non-parametric LayerNorm"),
        ("Olmo2ForCausalLM", HF_POST_NORM, "Transformers backend, post-norm blocks"),
        ("GPTNeoXForCausalLM", HF_PARALLEL, "Transformers backend, parallel residual (or not)"),
    ]
    moe = [
        ("MixtralForCausalLM", "mixture of experts"),
        ("Qwen2MoeForCausalLM", "mixture of experts with a shared expert"),
        ("Qwen3MoeForCausalLM", "mixture of experts"),
        ("OlmoeForCausalLM", "mixture of experts, q/k norms"),
        ("GptOssForCausalLM", "mixture of experts, attention sinks"),
        ("DeepseekV2ForCausalLM", "multi-head latent attention, shared experts"),
        ("DeepseekV3ForCausalLM", "multi-head latent attention, shared experts"),
    ]
    table = {name: Architecture(name, family, notes) for name, family, notes in rows}
    table |= {name: Architecture(name, LLAMA, notes, moe=True) for name, notes in moe}
    return table


ARCHITECTURES = _architectures()

# Architectures vLLM serves that envoykit refuses to read, and why: a reading that cannot be
# trusted is not offered. (None today: the table is where a refusal and its reason go.)
REFUSED: dict[str, str] = {}


def sites_of(family: Family) -> tuple[str, ...]:
    """The lens sites a family's layers have."""
    if family.parallel:
        return ("attn", "mlp", "resid")
    return ("attn", "resid_mid", "mlp", "resid")


def family_of(architecture: str, config: dict) -> Family | None:
    """The family of a checkpoint's ``architecture``, given its ``config``; None when
    envoykit does not read this architecture (see `ARCHITECTURES`)."""
    known = ARCHITECTURES.get(architecture)
    if known is None:
        return None
    if architecture == "GPTNeoXForCausalLM" and not config.get("use_parallel_residual", True):
        return HF_SEQUENTIAL
    if architecture == "FalconForCausalLM" and (
        config.get("parallel_attn", True) or config.get("new_decoder_architecture")
    ):
        return FALCON_PARALLEL
    return known.family
