"""A lens request is validated and normalised on the client, with no engine.

The tokenizer is the ``tiny`` model's own, loaded with plain transformers from the built
checkpoint (built locally in about a second, then cached); the model's limits come from its
config, as an engine reads them.
"""

from __future__ import annotations

import functools

import pytest
from bad_requests import CASES, IDS, PROMPT
from transformers import AutoTokenizer

import envoykit as ek
from envoykit.analyses.request import build_request, describe_target, normalise_layers
from envoykit.model.config import read_config
from envoykit.runtime import models


@functools.cache
def tiny() -> tuple[object, dict]:
    source = models.resolve("tiny")
    return AutoTokenizer.from_pretrained(source.path), read_config(source.path)


def request(prompt=PROMPT, **kwargs):
    """`build_request` with tiny's tokenizer and limits, as ``Engine.lens`` calls it."""
    tokenizer, config = tiny()
    return build_request(
        tokenizer,
        config["num_hidden_layers"],
        config["vocab_size"],
        config["max_position_embeddings"],
        prompt,
        **kwargs,
    )


def n_tokens(text: str) -> int:
    return len(tiny()[0](text)["input_ids"])


@pytest.mark.parametrize(("case", "kwargs", "message"), CASES, ids=IDS)
def test_bad_request_is_refused(case, kwargs, message):
    with pytest.raises(ek.InvalidRequest, match=message):
        request(**kwargs)


class TestLayers:
    """Layers come back sorted and distinct: 0 the embedding, negative from the end."""

    @pytest.mark.parametrize(
        ("layers", "expected"),
        [
            (None, (1, 2, 3, 4)),
            ("all", (1, 2, 3, 4)),
            ("embed", (0,)),
            (["embed", "all"], (0, 1, 2, 3, 4)),
            ([3, -1, 1, 3, "embed"], (0, 1, 3, 4)),
            (-4, (1,)),
            (range(2, 5), (2, 3, 4)),
        ],
    )
    def test_normalised(self, layers, expected):
        assert request(layers=layers).layers == expected
        assert normalise_layers(layers, 4) == expected

    def test_empty_list_is_refused(self):
        with pytest.raises(ek.InvalidRequest, match="no layers picked"):
            request(layers=[])


class TestPositions:
    def test_all_positions_by_default(self):
        assert request().positions is None

    def test_negative_count_from_the_end_sorted_distinct(self):
        last = n_tokens(PROMPT) - 1
        assert request(positions=[-1, 0, last]).positions == (0, last)

    def test_against_the_shortest_of_several_prompts(self):
        short = "The cat"
        with pytest.raises(ek.InvalidRequest, match=f"it has {n_tokens(short)} tokens"):
            request([PROMPT, short], positions=[n_tokens(short)])


class TestPrompts:
    def test_each_prompt_tokenized(self):
        tokenizer = tiny()[0]
        prompts = ["The cat sat", PROMPT]
        req = request(prompts)
        assert req.prompts == tuple(prompts)
        assert req.prompt_ids == tuple(tuple(tokenizer(p)["input_ids"]) for p in prompts)

    def test_generation_up_to_the_context_length(self):
        room = tiny()[1]["max_position_embeddings"] - n_tokens(PROMPT)
        assert request(generate=room).generate == room
        with pytest.raises(ek.InvalidRequest, match="max_model_len"):
            request(generate=room + 1)


class TestTargets:
    def test_string_is_its_first_token(self):
        tokenizer = tiny()[0]
        ids = tokenizer(" Paris is", add_special_tokens=False)["input_ids"]
        (target,) = request(targets=" Paris is").targets
        assert (target.label, target.token_id) == (" Paris is", ids[0])
        assert target.token == tokenizer.decode([ids[0]])

    def test_id_is_labelled_by_its_number(self):
        (target,) = request(targets=[7]).targets
        assert (target.label, target.token_id, target.token) == ("7", 7, tiny()[0].decode([7]))

    def test_order_kept(self):
        assert [t.label for t in request(targets=["b", " a", 3]).targets] == ["b", " a", "3"]

    def test_describe_target_lists_every_token(self):
        tokenizer = tiny()[0]
        pieces = describe_target(tokenizer, " Paris is")
        ids = tokenizer(" Paris is", add_special_tokens=False)["input_ids"]
        assert pieces == [tokenizer.decode([i]) for i in ids]
        assert "".join(pieces) == " Paris is"


def test_top_k_up_to_the_vocabulary():
    vocab = tiny()[1]["vocab_size"]
    assert request(top_k=vocab).top_k == vocab
    with pytest.raises(ek.InvalidRequest, match="exceeds the vocabulary size"):
        request(top_k=vocab + 1)


def test_reductions_in_float32_unless_asked():
    assert request().reduce_dtype == "float32"
    assert request(reduce_dtype="float64").reduce_dtype == "float64"


def test_installed_translators_keep_the_most_recent():
    from envoykit.analyses.installed import InstalledTranslators

    held = InstalledTranslators()
    assert held.keep_for("a") == ()
    held.installed("a", ())
    assert held.keep_for("b") == ("a",)
    held.installed("b", ("a",))
    assert held.keep_for("a") is None  # installed: now the most recent
    assert held.keep_for("c") == ("a",)  # "b" is dropped
    held.installed("c", ("a",))
    assert "b" not in held and "a" in held and "c" in held
