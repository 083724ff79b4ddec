"""Every bad request is refused before it reaches the ranks, and the engine answers the next.

The table of bad requests (`tests/bad_requests.py`) is shared with the engine-free check of
request validation (`tests/unit/test_request.py`); here each one goes through
``Engine.lens``, and after each refusal the same engine gives the lens it gave before.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bad_requests import CASES, IDS, PROMPT

import envoykit as ek

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def before(tiny2) -> ek.LensResult:
    """The lens of a good request, taken before any bad one."""
    return tiny2.lens(PROMPT, top_k=3)


def assert_same_lens(after: ek.LensResult, before: ek.LensResult) -> None:
    np.testing.assert_array_equal(after.top_ids, before.top_ids)
    np.testing.assert_allclose(after.top_probs, before.top_probs, rtol=0, atol=1e-6)
    np.testing.assert_allclose(after.kl, before.kl, rtol=0, atol=1e-6)


@pytest.mark.parametrize(("case", "kwargs", "message"), CASES, ids=IDS)
def test_refused_then_engine_answers(tiny2, before, case, kwargs, message):
    kwargs = {"prompt": PROMPT, **kwargs}
    prompt = kwargs.pop("prompt")
    with pytest.raises(ek.InvalidRequest, match=message):
        tiny2.lens(prompt, **kwargs)
    assert_same_lens(tiny2.lens(PROMPT, top_k=3), before)


def test_duplicate_unsorted_layers_are_normalised(tiny2, before):
    res = tiny2.lens(PROMPT, layers=[3, -1, 1, 3, "embed"], top_k=3)
    assert res.layers.tolist() == [0, 1, 3, 4]
    assert_same_lens(res.select(layers=[1, 3, 4]), before.select(layers=[1, 3, 4]))


def test_exception_in_trace_code_reaches_the_caller(tiny2, before):
    """A user's error inside trace code comes back with its type and message (nnsight
    raises a rank's error as a ``RuntimeError`` naming the original type); the engine then
    gives the lens it gave before."""
    with pytest.raises(RuntimeError, match="ValueError: deliberate failure on every rank"):
        with tiny2.trace(PROMPT):
            tiny2.model.model.layers[1].output[0].save()
            raise ValueError("deliberate failure on every rank")
    assert_same_lens(tiny2.lens(PROMPT, top_k=3), before)


@pytest.mark.parametrize(
    "option",
    [
        {"generate": 2},
        {"reduce_dtype": "float64"},
        {"translator": object()},
        {"top_k": 3},
        {"keep_error": True},
    ],
    ids=["generate", "reduce_dtype", "translator", "top_k", "keep_error"],
)
def test_compare_refuses_what_it_would_drop(tiny2, option):
    """``compare=True`` compares plain lenses: an option it cannot honour is refused, not
    silently dropped (it once returned the plain comparison)."""
    name = next(iter(option))
    with pytest.raises(ek.InvalidRequest, match=f"compare=True does not take {name}="):
        tiny2.lens([PROMPT, "The capital of Italy is"], compare=True, **option)


def test_keep_error_without_a_splice_is_refused_not_dropped(tiny2, before):
    with pytest.raises(ek.InvalidRequest, match="keep_error=True goes with splice="):
        tiny2.lens(PROMPT, keep_error=True)
    assert_same_lens(tiny2.lens(PROMPT, top_k=3), before)


ATTENTION_CASES = [
    ("layer 0", dict(layers=[0]), "the embedding, which has no attention"),
    ("layer out of range", dict(layers=[9]), "layer 9 does not exist"),
    ("head out of range", dict(heads=[4]), r"head 4 is out of range: this model has 4 heads"),
    ("negative head out of range", dict(heads=[-5]), "out of range"),
    ("no heads", dict(heads=[]), "no heads given"),
    ("head of the wrong type", dict(heads=["0"]), "head must be an integer, not '0'"),
    ("query out of range", dict(queries=[40]), "outside the prompt"),
    ("top_k zero", dict(top_k=0), r"top_k must be None \(every key\) or an integer >= 1"),
    ("prompt list", dict(prompt=[PROMPT, PROMPT]), "one prompt"),
]


@pytest.mark.parametrize(
    ("case", "kwargs", "message"), ATTENTION_CASES, ids=[c[0] for c in ATTENTION_CASES]
)
def test_attention_refusals_leave_the_engine_answering(tiny2, before, case, kwargs, message):
    kwargs = {"prompt": PROMPT, **kwargs}
    prompt = kwargs.pop("prompt")
    with pytest.raises(ek.InvalidRequest, match=message):
        tiny2.attention(prompt, **kwargs)
    assert_same_lens(tiny2.lens(PROMPT, top_k=3), before)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (ek.Ablate(1, 7), "ablation head 7 is out of range"),
        (ek.Ablate(0, 1), "the embedding .layer 0. has only the 'resid' site"),
        (ek.Ablate(1, 1, kind="half"), "kind is 'zero' or 'mean'"),
        (ek.Patch(PROMPT, 1, site="head"), "patch head must be an integer, not None"),
        (ek.Ablate(1, "0"), "ablation head must be an integer, not '0'"),
        (ek.Patch(PROMPT, 1, site="attn", head=1), "head= goes with site='head'"),
    ],
    ids=[
        "head out of range",
        "embedding",
        "unknown kind",
        "no head",
        "string head",
        "head without site",
    ],
)
def test_head_edit_refusals_leave_the_engine_answering(tiny2, before, patch, message):
    with pytest.raises(ek.InvalidRequest, match=message):
        tiny2.lens(PROMPT, patch=patch)
    assert_same_lens(tiny2.lens(PROMPT, top_k=3), before)


LONG = "one two " * 400  # past tiny's 256 positions


def test_long_prompts_are_refused_by_every_entry_point_not_by_vllm(tiny2, before):
    steer = ek.Steer(torch.ones(tiny2.info.d_model), 2)
    for call in (
        lambda: tiny2.lens(LONG),
        lambda: tiny2.lens(LONG, steer=steer),
        lambda: tiny2.lens([LONG, PROMPT], compare=True, positions=[0]),
        lambda: tiny2.lens(PROMPT, patch=ek.Patch(LONG, layer=1)),
        lambda: ek.compare((tiny2, PROMPT), (tiny2, LONG), positions=[0]),
        lambda: ek.compare((tiny2, PROMPT), ek.Run(tiny2, PROMPT, patch=ek.Patch(LONG, 1))),
        lambda: tiny2.patch_sweep(LONG, LONG, target_token=5),
        lambda: tiny2.attribute(LONG, [5]),
        lambda: tiny2.attention(LONG),
        lambda: tiny2.steering_vector([LONG], [PROMPT], layer=2),
        lambda: tiny2.steer_sweep(LONG, steer, scales=[0, 1], max_tokens=2),
        lambda: tiny2.generate(LONG, 4),
        lambda: tiny2.generate(PROMPT, 300),
    ):
        with pytest.raises(ek.InvalidRequest, match="max_model_len=256"):
            call()
    assert_same_lens(tiny2.lens(PROMPT, top_k=3), before)


def test_numpy_integers_are_integers(tiny2, before):
    res = tiny2.lens(PROMPT, top_k=np.int64(3), layers=np.arange(1, 5))
    assert_same_lens(res, before)
    assert tiny2.lens(PROMPT, top_k=3, layers=[np.int64(2)]).layers.tolist() == [2]
    assert tiny2.generate(PROMPT, np.int64(3)).token_ids == tiny2.generate(PROMPT, 3).token_ids


def test_numpy_arrays_are_lists_of_integers(tiny2):
    """Integer arrays and numpy integers wherever a list of ints or an int is taken: each
    request gives what the same request in Python ints gives."""
    plain = tiny2.lens(PROMPT, positions=[0, -1], targets=[5], top_k=3)
    res = tiny2.lens(PROMPT, positions=np.array([0, -1]), targets=[np.int64(5)], top_k=3)
    np.testing.assert_array_equal(res.top_ids, plain.top_ids)
    np.testing.assert_array_equal(res.target_probs, plain.target_probs)
    pattern = tiny2.attention(PROMPT, layers=[1], heads=[0, 1], queries=[-1], top_k=3)
    same = tiny2.attention(
        PROMPT,
        layers=np.array([1]),
        heads=np.array([0, 1]),
        queries=np.array([-1]),
        top_k=np.int64(3),
    )
    np.testing.assert_array_equal(same.weights, pattern.weights)
    att = tiny2.attribute(PROMPT, [5], positions=np.array([-1]))
    np.testing.assert_array_equal(att.values, tiny2.attribute(PROMPT, [5], positions=[-1]).values)
    sweep = {"target_token": np.int64(5), "positions": np.array([-1]), "progress": False}
    one = tiny2.patch_sweep("The capital of Italy is", PROMPT, layers=1, **sweep)
    same_sweep = tiny2.patch_sweep("The capital of Italy is", PROMPT, layers=np.int64(1), **sweep)
    np.testing.assert_array_equal(same_sweep.values, one.values)
    patched = tiny2.lens(PROMPT, patch=ek.Patch("The capital of Italy is", layer=np.int64(1)))
    assert patched.meta["patches"][0]["layer"] == 1
    assert ek.LensResult.from_json(patched.to_json()).meta == patched.meta


def test_corpus_options_are_checked_before_the_corpus_runs(tiny2):
    class Unread:
        """A corpus that fails if anything reads past its first document."""

        def __iter__(self):
            yield PROMPT
            raise AssertionError("the corpus was read before the options were checked")

    for kwargs, message in (
        ({"n_boot": 0}, "n_boot must be an integer >= 1"),
        ({"n_boot": 10.0}, "n_boot must be an integer"),
        ({"confidence": 1.0}, r"confidence lies in \(0, 1\)"),
    ):
        with pytest.raises(ek.InvalidRequest, match=message):
            tiny2.lens_corpus(Unread(), progress=False, **kwargs)


def test_collect_skips_positions_a_short_document_lacks(tiny2, tmp_path):
    texts = [PROMPT, "one two " * 20]
    store = tiny2.collect(texts, out=tmp_path / "store", layers=[2], positions=[30, -1])
    lengths = [len(tiny2.tokenizer(text)["input_ids"]) for text in texts]
    assert lengths[0] <= 30 < lengths[1]
    kept = list(zip(store.documents.tolist(), store.positions.tolist()))
    assert kept == [(0, lengths[0] - 1), (1, 30), (1, lengths[1] - 1)]
