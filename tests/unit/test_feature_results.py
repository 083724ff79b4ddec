"""FeatureResult, FeatureAttributionResult and FeatureLogitsResult: frozen, exported and
read back whole, checked on construction, and drawn."""

from __future__ import annotations

import copy
import pickle

import matplotlib
import numpy as np
import pytest

import envoykit as ek

matplotlib.use("Agg")


def example() -> ek.FeatureResult:
    return ek.FeatureResult(
        prompt="a b c",
        tokens=("a", " b", " c"),
        token_ids=[1, 2, 3],
        top_ids=[[5, 7], [7, -1], [2, 5]],
        top_acts=[[2.0, 1.0], [3.0, 0.0], [1.5, 0.5]],
        l0=[2, 1, 2],
        sq_error=[1.0, 2.0, 3.0],
        sq_centered=[4.0, 4.0, 4.0],
        d_model=4,
        tracked=[7],
        tracked_acts=[[1.0, 3.0, 0.0]],
        meta={"sae": {"key": "k", "layer": 2, "site": "resid"}},
    )


def test_frozen_exported_and_read_back():
    res = example()
    with pytest.raises(ValueError):
        res.top_acts[0, 0] = 1.0
    again = ek.FeatureResult.from_json(res.to_json())
    for other in (again, pickle.loads(pickle.dumps(res)), copy.deepcopy(res)):
        np.testing.assert_array_equal(other.top_ids, res.top_ids)
        assert other.meta["sae"]["key"] == "k"
    frame = res.to_pandas()
    assert list(frame["feature"])[:2] == [5, 7] and len(frame) == 6


def test_statistics():
    res = example()
    assert res.variance_explained() == pytest.approx(0.5)
    assert res.variance_explained(skip_first=True) == pytest.approx(1 - 5 / 8)
    np.testing.assert_allclose(res.mse, [0.25, 0.5, 0.75])
    np.testing.assert_array_equal(res.activation(7), [1.0, 3.0, 0.0])  # tracked: exact
    np.testing.assert_array_equal(res.activation(5), [2.0, 0.0, 0.5])  # from the top lists


def test_checked_on_construction():
    with pytest.raises(ValueError, match="top_acts has shape"):
        ek.FeatureResult(**{**_fields(example()), "top_acts": [[1.0], [1.0], [1.0]]})
    with pytest.raises(ValueError, match="never negative"):
        ek.FeatureResult(**{**_fields(example()), "sq_error": [-1.0, 0.0, 0.0]})
    attribution = dict(
        prompt="a",
        tokens=("a",),
        positions=[0],
        target_ids=[3],
        target_labels=("x",),
        feature_ids=[[[1, 2]]],
        effects=[[[0.5, -0.25]]],
        features=[[1.0]],
        error=[[0.5]],
        bias=[[0.25]],
        site=[[1.75]],
    )
    assert ek.FeatureAttributionResult(**attribution).target("x") == 0
    with pytest.raises(ValueError, match="differ from the site"):
        ek.FeatureAttributionResult(**{**attribution, "site": [[2.0]]})
    with pytest.raises(ValueError, match="top logits fall"):
        ek.FeatureLogitsResult(
            features=[1],
            top_ids=[[1, 2]],
            top_tokens=[["a", "b"]],
            top_logits=[[1.0, 2.0]],
            bottom_ids=[[3, 4]],
            bottom_tokens=[["c", "d"]],
            bottom_logits=[[-2.0, -1.0]],
        )


def test_plots_draw_the_features():
    res = example()
    figure = ek.plot.features(res)
    ax = figure.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["feature 7", "feature 5", "feature 2"]
    assert "variance explained 0.500" in ax.get_title()
    bars = ek.plot.feature(res, 7).axes[0].patches
    assert [b.get_height() for b in bars] == [1.0, 3.0, 0.0]


def _fields(res) -> dict:
    return {name: getattr(res, name) for name in res.__dataclass_fields__}
