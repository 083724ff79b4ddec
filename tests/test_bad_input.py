"""Every bad request is refused before it reaches the ranks, and the engine answers the next.

One table: the request, the error it must raise, and words the message must contain so the
user knows what to do. After each refusal a real lens runs on the same engine.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import envoykit as ek

PROMPT = "The capital of France is"
CASES = [
    ("empty prompt", dict(prompt=""), "prompt is empty"),
    ("blank prompt", dict(prompt="   "), "prompt is empty"),
    ("empty prompt list", dict(prompt=[]), "non-empty list"),
    ("prompt too long", dict(prompt="one two " * 400), "exceeds the engine's max_model_len"),
    ("prompt plus generation too long", dict(prompt=PROMPT, generate=300), "max_model_len"),
    ("layer out of range", dict(layers=[5]), r"layer 5 does not exist: the model has 4 layers"),
    ("negative layer out of range", dict(layers=[-6]), r"layer -6 does not exist"),
    ("layer of the wrong type", dict(layers=[1.5]), "a layer is an integer"),
    ("position out of range", dict(positions=[40]), r"position 40 is outside the prompt"),
    ("negative position out of range", dict(positions=[-40]), "outside the prompt"),
    ("top_k zero", dict(top_k=0), r"top_k must be an integer >= 1"),
    ("top_k above vocab", dict(top_k=10**6), "exceeds the vocabulary size"),
    ("top_k not an int", dict(top_k="5"), "top_k must be an integer"),
    ("target that tokenizes to nothing", dict(targets=[""]), "tokenizes to nothing"),
    ("target id outside vocab", dict(targets=[10**6]), "outside the vocabulary"),
    ("negative target id", dict(targets=[-1]), "outside the vocabulary"),
    ("tensor as target", dict(targets=[torch.tensor(3)]), "a target is a string or a token id"),
    ("tensor as prompt", dict(prompt=torch.tensor([1, 2])), "prompt must be a string"),
    ("negative generate", dict(generate=-1), r"generate must be an integer >= 0"),
    ("unknown reduction dtype", dict(dtype="float16"), "dtype must be one of"),
]


@pytest.mark.parametrize(("case", "kwargs", "message"), CASES, ids=[c[0] for c in CASES])
def test_refused_then_engine_answers(tiny2, case, kwargs, message):
    kwargs = {"prompt": PROMPT, **kwargs}
    prompt = kwargs.pop("prompt")
    with pytest.raises(ek.InvalidRequest, match=message):
        tiny2.lens(prompt, **kwargs)
    res = tiny2.lens(PROMPT, top_k=3)
    assert res.top_ids.shape == (4, len(res.positions), 3)


def test_duplicate_unsorted_layers_are_normalised(tiny2):
    res = tiny2.lens(PROMPT, layers=[3, -1, 1, 3, "embed"], top_k=2)
    assert res.layers.tolist() == [0, 1, 3, 4]


def test_exception_in_trace_code_reaches_the_caller(tiny2):
    """A user's error inside trace code comes back with its message; the engine stays usable."""
    with pytest.raises(Exception, match="deliberate failure on every rank"):
        with tiny2.trace(PROMPT):
            tiny2.model.model.layers[1].output[0].save()
            raise ValueError("deliberate failure on every rank")
    np.testing.assert_array_equal(
        tiny2.lens(PROMPT, top_k=2).top_ids, tiny2.lens(PROMPT, top_k=2).top_ids
    )
