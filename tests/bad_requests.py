"""Bad lens requests on the ``tiny`` model, each with words its refusal must contain.

One table for two checks: `tests/unit/test_request.py` refuses each through
`envoykit.analyses.request.build_request` with no engine, and `tests/test_bad_input.py` through
``Engine.lens``, which must then answer the next request normally. The limits are tiny's
(4 layers, a vocabulary of a few hundred tokens, 256 positions).
"""

from __future__ import annotations

import torch

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
    ("float tensor as target", dict(targets=[torch.tensor(3.0)]), "a target is a string or a"),
    ("tensor as prompt", dict(prompt=torch.tensor([1, 2])), "prompt must be a string"),
    ("negative generate", dict(generate=-1), r"generate must be an integer >= 0"),
    ("unknown reduction dtype", dict(reduce_dtype="float16"), "reduce_dtype must be one of"),
]
IDS = [case[0] for case in CASES]
