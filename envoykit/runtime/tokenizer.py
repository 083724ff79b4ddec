"""The tokenizer of every locally built model: a byte-level BPE trained on a corpus shipped in
the package, so that building a model needs no network."""

from __future__ import annotations

from pathlib import Path

_CORPUS = Path(__file__).parents[1] / "data" / "corpus.txt"


def build_tokenizer(out: Path) -> int:
    """Train the byte-level BPE (500 tokens, ``<s>`` = 0, ``</s>`` = 1) on the shipped corpus.

    Saves it into ``out`` and returns its vocabulary size; every locally built model uses it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(_CORPUS)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    return tok.get_vocab_size()
