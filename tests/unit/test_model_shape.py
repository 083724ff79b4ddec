"""A checkpoint's shape read under one set of names, whatever its config calls them."""

from __future__ import annotations

import pytest

import envoykit as ek
from envoykit.runtime.info import ModelShape, choose_tp


def test_gpt2_names():
    shape = ModelShape.from_config(
        {"n_layer": 4, "n_embd": 128, "vocab_size": 500, "n_head": 4, "n_positions": 256}
    )
    assert (shape.n_layers, shape.d_model, shape.n_heads, shape.n_kv_heads) == (4, 128, 4, 4)
    assert shape.max_positions == 256


def test_falcon_multi_query_has_one_kv_head():
    config = {"num_hidden_layers": 2, "hidden_size": 128, "vocab_size": 500}
    shape = ModelShape.from_config({**config, "num_attention_heads": 4, "multi_query": True})
    assert shape.n_kv_heads == 1
    assert shape.valid_tp_sizes() == [1, 2, 4]  # one KV head, replicated


def test_nested_text_config_of_a_multimodal_model():
    text = {"num_hidden_layers": 3, "hidden_size": 64, "vocab_size": 100}
    text |= {"num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 96}
    shape = ModelShape.from_config({"text_config": text, "vision_config": {"hidden_size": 9}})
    assert (shape.n_layers, shape.d_model, shape.n_kv_heads) == (3, 64, 1)


def test_expert_widths_must_divide_too():
    config = {"num_hidden_layers": 2, "hidden_size": 128, "vocab_size": 500}
    config |= {"num_attention_heads": 4, "intermediate_size": 256, "moe_intermediate_size": 6}
    assert ModelShape.from_config(config).valid_tp_sizes() == [1, 2]
    with pytest.raises(ek.InvalidRequest, match=r"MLP widths \[256, 6\]"):
        choose_tp(config, 4, "cpu")


def test_missing_numbers_are_named():
    with pytest.raises(ek.InvalidRequest, match=r"no number of attention heads .*'n_head'"):
        ModelShape.from_config({"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 9})
