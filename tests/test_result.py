"""`LensResult` holds its invariants; transforms, exports and plots read it faithfully."""

from __future__ import annotations

import dataclasses

import matplotlib
import numpy as np
import pytest

import envoykit as ek

matplotlib.use("Agg")


@pytest.fixture
def res() -> ek.LensResult:
    return ek.LensResult.example()


class TestValidation:
    def test_rejects_inconsistent_shapes(self, res):
        with pytest.raises(ValueError, match="top_probs has shape"):
            dataclasses.replace(res, top_probs=res.top_probs[:, :1])
        with pytest.raises(ValueError, match="entropy"):
            dataclasses.replace(res, entropy=np.zeros((2, 2)))
        with pytest.raises(ValueError, match="distinct"):
            dataclasses.replace(res, tokens=("a", "a"))

    def test_is_immutable(self, res):
        with pytest.raises(dataclasses.FrozenInstanceError):
            res.prompt = "x"


class TestTransforms:
    def test_stride_keeps_last_layer(self, res):
        assert res.stride(2).layers.tolist() == [0, 2]
        longer = res.select(layers=[0, 1, 2, 1])
        assert longer.stride(3).layers.tolist()[-1] == 1

    def test_select(self, res):
        sub = res.select(layers=[2], positions=[1])
        assert sub.top_probs.tolist() == [[[pytest.approx(0.7), pytest.approx(0.1)]]]
        assert sub.tokens == (" b",)
        with pytest.raises(KeyError):
            res.select(layers=[9])

    def test_target(self, res):
        assert res.target(" z").prob.shape == (3, 2)
        assert res.target(3).label == " z"
        with pytest.raises(KeyError, match="not a target"):
            res.target(" q")


class TestExport:
    def test_json_round_trip_is_exact(self, res, tmp_path):
        back = ek.LensResult.from_json(res.to_json())
        for field in dataclasses.fields(res):
            a, b = getattr(res, field.name), getattr(back, field.name)
            if isinstance(a, np.ndarray):
                assert a.dtype == b.dtype or a.dtype == object, field.name
                np.testing.assert_array_equal(a, b)
            else:
                assert a == b, field.name
        path = tmp_path / "lens.json"
        res.to_json(str(path))
        np.testing.assert_array_equal(ek.LensResult.from_json(str(path)).top_probs, res.top_probs)

    def test_pandas_one_row_per_layer_position_rank(self, res):
        frame = res.to_pandas()
        assert len(frame) == 3 * 2 * 2
        assert not frame.duplicated(["layer", "position", "rank"]).any()
        row = frame.query("layer == 2 and position == 1 and rank == 0").iloc[0]
        assert row.token == "z" and row.prob == pytest.approx(0.7)
        assert "target_prob[ z]" in frame

    def test_html_repr_lists_each_layer(self, res):
        html = res._repr_html_()
        assert html.count("<tr>") == 1 + len(res.layers)


class TestPlots:
    def test_heatmap_cells_and_labels(self, res):
        figure = res.plot("kl")
        ax = figure.axes[0]
        assert len(ax.texts) == 3 * 2
        assert [t.get_text() for t in ax.get_yticklabels()] == ["embed", "1", "2"]
        assert [t.get_text() for t in ax.get_xticklabels()] == ["a", " b"]
        np.testing.assert_array_equal(ax.images[0].get_array(), res.kl)

    def test_heatmap_of_a_target(self, res):
        ax = ek.plot.heatmap(res, " z").axes[0]
        np.testing.assert_array_equal(ax.images[0].get_array(), res.target(" z").prob)

    def test_trajectory(self, res, tmp_path):
        figure = ek.plot.trajectory(res, [" z"])
        prob_line = figure.axes[0].lines[0]
        np.testing.assert_array_equal(prob_line.get_ydata(), res.target(" z").prob[:, -1])
        figure.savefig(tmp_path / "t.svg")
        assert (tmp_path / "t.svg").stat().st_size > 1000
