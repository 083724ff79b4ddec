"""Every result is one kind of value: frozen, picklable, deep-copyable, checked when built."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import numpy as np
import pytest

from envoykit.results.attention import AttentionResult
from envoykit.results.attribution import AttributionResult
from envoykit.results.base import Result
from envoykit.results.compare import CompareResult
from envoykit.results.lens import LensResult
from envoykit.results.sweep import SweepResult
from envoykit.results.tuned import LensQuality


def _quality() -> LensQuality:
    return LensQuality(np.array([0, 1]), np.array([2.0, 1.0]), np.array([1.5, 0.5]), 10)


def _with_nested_meta(res):
    return dataclasses.replace(res, meta={"model": "x", "patches": [{"layer": 1}]})


EXAMPLES = {
    "lens": lambda: _with_nested_meta(LensResult.example()),
    "attention": lambda: _with_nested_meta(AttentionResult.example()),
    "attribution": lambda: _with_nested_meta(AttributionResult.example()),
    "compare": lambda: _with_nested_meta(CompareResult.example()),
    "sweep": lambda: _with_nested_meta(SweepResult.example()),
    "quality": _quality,
}


def _arrays(res) -> dict[str, np.ndarray]:
    return {
        f.name: getattr(res, f.name)
        for f in dataclasses.fields(res)
        if isinstance(getattr(res, f.name), np.ndarray)
    }


def _same(a, b) -> bool:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            if not (np.array_equal(x, y) and x.dtype == y.dtype):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("kind", EXAMPLES)
class TestOneResultType:
    def test_is_a_result(self, kind):
        assert isinstance(EXAMPLES[kind](), Result)

    def test_pickles_to_an_equal_frozen_copy(self, kind):
        res = EXAMPLES[kind]()
        back = pickle.loads(pickle.dumps(res))
        assert _same(res, back)
        assert all(not a.flags.writeable for a in _arrays(back).values())

    def test_deep_copies(self, kind):
        res = EXAMPLES[kind]()
        assert _same(res, copy.deepcopy(res))

    def test_fields_cannot_be_set(self, kind):
        res = EXAMPLES[kind]()
        name = dataclasses.fields(res)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(res, name, None)

    def test_arrays_are_read_only(self, kind):
        for array in _arrays(EXAMPLES[kind]()).values():
            with pytest.raises(ValueError):
                array.flat[0] = array.flat[0]


@pytest.mark.parametrize("kind", [kind for kind in EXAMPLES if kind != "quality"])
def test_nested_meta_is_read_only(kind):
    res = EXAMPLES[kind]()
    with pytest.raises(TypeError):
        res.meta["model"] = "y"
    with pytest.raises((TypeError, AttributeError)):
        res.meta["patches"].append({})
    with pytest.raises(TypeError):
        res.meta["patches"][0]["layer"] = 2


def test_attribution_checks_that_its_values_add_up_to_the_logits():
    res = AttributionResult.example()
    wrong = res.logits + np.float32(1.0)
    with pytest.raises(ValueError, match="do not add up to the logits"):
        dataclasses.replace(res, logits=wrong)


def test_quality_checks_its_shapes():
    with pytest.raises(ValueError, match="tuned_kl has shape"):
        LensQuality(np.array([0, 1]), np.array([2.0, 1.0]), np.array([1.5]), 10)
