"""`LensResult` holds its invariants; transforms, exports and plots read it faithfully.

No engine: every result here is built by hand, and every expectation is computed from the
arrays it was built from.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle

import matplotlib
import numpy as np
import pytest

import envoykit as ek
from envoykit.results.lens import TOLERANCE

matplotlib.use("Agg")


@pytest.fixture
def res() -> ek.LensResult:
    return ek.LensResult.example()


def sited_result() -> ek.LensResult:
    """The example's rows relabelled as the embedding plus three sites of layer 1."""
    data = ek.LensResult.example().to_dict()
    for name in ("top_ids", "top_tokens", "top_probs", "entropy", "kl"):
        data[name] = [data[name][i] for i in (0, 1, 2, 2)]
    for name in ("target_probs", "target_ranks"):
        data[name] = [data[name][i] for i in (0, 1, 2, 2)]
    data.update(layers=[0, 1, 1, 1], sites=["resid", "attn", "resid_mid", "resid"])
    return ek.LensResult.from_dict(data)


def sparse_result(seed: int = 0) -> ek.LensResult:
    """A result whose labels are not indices: layers [0, 2, 4], positions [3, 7, 9, 10] (the
    last one generated), two targets, plausible random statistics."""
    rng = np.random.default_rng(seed)
    layers, positions, k = np.array([0, 2, 4]), np.array([3, 7, 9, 10]), 3
    shape = (len(layers), len(positions))
    probs = np.sort(rng.dirichlet(np.ones(20), size=shape), axis=-1)[..., ::-1]
    top_ids = rng.permuted(np.tile(np.arange(20), (*shape, 1)), axis=-1)[..., :k]
    return ek.LensResult(
        prompt="w3 w7 w9",
        token_ids=np.array([13, 17, 19, 11]),
        tokens=("w3", "w7", "w9", "w10"),
        positions=positions,
        layers=layers,
        top_ids=top_ids,
        top_tokens=np.vectorize(lambda i: f"t{i}", otypes=[object])(top_ids),
        top_probs=probs[..., :k].astype(np.float32),
        entropy=rng.random(shape).astype(np.float32) * 3,
        kl=rng.random(shape).astype(np.float32),
        target_ids=np.array([4, 5]),
        target_labels=(" four", "5"),
        target_tokens=("t4", "t5"),
        target_probs=(rng.random((*shape, 2)) * 0.05).astype(np.float32),
        target_ranks=rng.integers(0, 20, size=(*shape, 2)),
        n_generated=1,
        meta={"model": "hand-made", "tp": 2, "sizes": [1, 2], "nested": {"a": None}},
    )


ARRAY_FIELDS = [
    f.name
    for f in dataclasses.fields(ek.LensResult)
    if isinstance(getattr(ek.LensResult.example(), f.name), np.ndarray)
]


class TestImmutable:
    """Nothing that holds a result can change what another holder sees."""

    def test_fields_cannot_be_reassigned(self, res):
        with pytest.raises(dataclasses.FrozenInstanceError):
            res.prompt = "x"

    @pytest.mark.parametrize("name", ARRAY_FIELDS)
    def test_arrays_are_read_only(self, res, name):
        array = getattr(res, name)
        assert not array.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            array[(0,) * array.ndim] = array[(0,) * array.ndim]

    def test_callers_arrays_are_copied_not_frozen(self):
        entropy = np.ones((3, 2), dtype=np.float32)
        res = dataclasses.replace(ek.LensResult.example(), entropy=entropy)
        assert entropy.flags.writeable  # the caller's array is still theirs
        entropy[0, 0] = 2.0
        assert res.entropy[0, 0] == 1.0  # and changing it does not change the result

    def test_views_of_the_arrays_are_read_only(self, res):
        assert not res.top_probs[..., 0].flags.writeable
        assert not np.asarray(res.kl).flags.writeable

    def test_meta_is_read_only_all_the_way_down(self):
        res = sparse_result()
        with pytest.raises(TypeError):
            res.meta["model"] = "other"
        with pytest.raises(TypeError):
            res.meta["nested"]["a"] = 1
        with pytest.raises(AttributeError):
            res.meta["sizes"].append(3)

    def test_meta_is_a_copy(self):
        meta = {"model": "m", "sizes": [1]}
        res = dataclasses.replace(ek.LensResult.example(), meta=meta)
        meta["model"] = "changed"
        meta["sizes"].append(2)
        assert res.meta["model"] == "m" and list(res.meta["sizes"]) == [1]

    def test_target_trace_is_read_only(self):
        trace = sparse_result().target(" four")
        assert not trace.prob.flags.writeable and not trace.rank.flags.writeable
        own = ek.TargetTrace("x", 1, "x", np.zeros((2, 2)), np.zeros((2, 2), dtype=int))
        assert not own.prob.flags.writeable and not own.rank.flags.writeable

    def test_replace_keeps_the_result_frozen(self, res):
        changed = dataclasses.replace(res, prompt="other")
        assert changed.prompt == "other"
        assert not changed.top_probs.flags.writeable
        np.testing.assert_array_equal(changed.top_probs, res.top_probs)

    @pytest.mark.parametrize(
        "clone",
        [lambda x: pickle.loads(pickle.dumps(x)), copy.deepcopy],
        ids=["pickle", "deepcopy"],
    )
    def test_copies_are_equal_and_frozen(self, clone):
        res = sparse_result()
        back = clone(res)
        assert_same(back, res)
        assert not back.top_probs.flags.writeable
        with pytest.raises(TypeError):
            back.meta["model"] = "other"
        trace = clone(res.target("5"))
        assert not trace.prob.flags.writeable
        np.testing.assert_array_equal(trace.prob, res.target("5").prob)


def assert_same(a: ek.LensResult, b: ek.LensResult) -> None:
    """Every field equal, arrays with the same dtype."""
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype, field.name
            np.testing.assert_array_equal(x, y, err_msg=field.name)
        else:
            assert x == y, field.name


class TestValidation:
    """A result that breaks an invariant is refused at construction, naming the field."""

    def test_rejects_inconsistent_shapes(self, res):
        with pytest.raises(ValueError, match="top_probs has shape"):
            dataclasses.replace(res, top_probs=res.top_probs[:, :1])
        with pytest.raises(ValueError, match="entropy"):
            dataclasses.replace(res, entropy=np.zeros((2, 2)))
        with pytest.raises(ValueError, match="target_tokens has 2 entries"):
            dataclasses.replace(res, target_tokens=(" z", " y"))

    @pytest.mark.parametrize(
        ("name", "value", "message"),
        [
            ("top_ids", np.full((3, 2, 2), 1.5), "top_ids must hold integers, not float64"),
            ("target_ranks", np.zeros((3, 2, 1), dtype=bool), "target_ranks must hold integers"),
            ("top_probs", np.full((3, 2, 2), "x"), "top_probs must hold real numbers"),
            ("top_tokens", np.ones((3, 2, 2), dtype=object), "top_tokens must hold strings"),
            ("tokens", ("a", 3), "tokens must hold strings"),
            ("tokens", "ab", "tokens is a sequence of strings, not one string"),
            ("prompt", b"a b", "prompt must be a string"),
            ("n_generated", 1.0, "n_generated must be an integer"),
        ],
    )
    def test_rejects_wrong_kinds(self, res, name, value, message):
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(res, **{name: value})

    def test_stores_canonical_dtypes(self, res):
        narrow = dataclasses.replace(
            res,
            top_ids=res.top_ids.astype(np.int16),
            entropy=np.ones((3, 2), dtype=np.float64),
            top_tokens=res.top_tokens.astype(str),
            target_ids=[3],
        )
        assert narrow.top_ids.dtype == np.int64 and narrow.target_ids.dtype == np.int64
        assert narrow.entropy.dtype == np.float32
        assert narrow.top_tokens.dtype == object
        assert all(type(t) is str for t in narrow.top_tokens.flat)

    @pytest.mark.parametrize(
        ("name", "index", "value", "message"),
        [
            ("top_probs", (0, 0, 0), 1.5, r"top_probs must be in \[.*\]: it is 1.5 at index"),
            ("top_probs", (0, 0, 1), -0.1, "top_probs must be in"),
            ("target_probs", (1, 1, 0), 2.0, "target_probs must be in"),
            ("target_probs", (1, 1, 0), np.inf, "target_probs must be in"),
            ("entropy", (2, 1), -0.5, r"entropy must be >= .*index \[2, 1\]"),
            ("kl", (0, 0), -1e-3, "kl must be >="),
            ("target_ranks", (0, 1, 0), -1, "target_ranks must be >= 0"),
            ("top_ids", (0, 0, 0), -2, "top_ids must be >= 0"),
            ("token_ids", (1,), -1, "token_ids must be >= 0"),
            ("target_ids", (0,), -3, "target_ids must be >= 0"),
            ("layers", (0,), -1, "layers must be >= 0"),
        ],
    )
    def test_rejects_values_out_of_range(self, res, name, index, value, message):
        array = getattr(res, name).copy()
        array[index] = value
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(res, **{name: array})

    def test_rounding_within_tolerance_is_kept_as_is(self, res):
        probs = res.top_probs.copy()
        probs[2, 0] = [1 + TOLERANCE / 2, 0.0]
        entropy = res.entropy.copy()
        entropy[0, 0] = -TOLERANCE / 2
        kept = dataclasses.replace(res, top_probs=probs, entropy=entropy)
        assert kept.top_probs[2, 0, 0] == np.float32(1 + TOLERANCE / 2)  # not clipped
        assert kept.entropy[0, 0] == np.float32(-TOLERANCE / 2)

    def test_nan_marks_a_missing_cell(self, res):
        entropy, probs = res.entropy.copy(), res.top_probs.copy()
        entropy[0, 1] = np.nan
        probs[1, 1] = np.nan
        kept = dataclasses.replace(res, entropy=entropy, top_probs=probs)
        assert np.isnan(kept.entropy[0, 1]) and np.isnan(kept.top_probs[1, 1]).all()

    def test_top_probs_most_likely_first(self, res):
        probs = res.top_probs.copy()
        probs[1, 0] = probs[1, 0, ::-1]
        with pytest.raises(ValueError, match=r"most likely first: it rises after \(1, 0, 0\)"):
            dataclasses.replace(res, top_probs=probs)

    def test_top_probs_sum_at_most_one(self, res):
        probs = res.top_probs.copy()
        probs[0, 1] = [0.6, 0.5]
        with pytest.raises(ValueError, match="top_probs summed over k must be <="):
            dataclasses.replace(res, top_probs=probs)

    def test_positions_strictly_increasing(self, res):
        with pytest.raises(ValueError, match="positions must be strictly increasing"):
            dataclasses.replace(res, positions=np.array([1, 0]))
        with pytest.raises(ValueError, match="positions must be strictly increasing"):
            dataclasses.replace(res, positions=np.array([4, 4]))

    def test_meta_must_be_json(self, res):
        with pytest.raises(ValueError, match=r"meta\['tp'\] must be a JSON value"):
            dataclasses.replace(res, meta={"tp": np.int64(2)})
        with pytest.raises(ValueError, match="meta keys must be strings"):
            dataclasses.replace(res, meta={1: "x"})


class TestSelect:
    """`select` names layers and positions by value; `take` by index."""

    def test_positions_are_sequence_positions(self):
        res = sparse_result()
        sub = res.select(positions=[7])
        assert sub.positions.tolist() == [7]
        assert sub.tokens == ("w7",)
        np.testing.assert_array_equal(sub.top_probs, res.top_probs[:, [1]])
        np.testing.assert_array_equal(sub.target_ranks, res.target_ranks[:, [1]])

    def test_positions_keep_sequence_order(self):
        res = sparse_result()
        sub = res.select(positions=[9, 3])
        assert sub.positions.tolist() == [3, 9]
        np.testing.assert_array_equal(sub.kl, res.kl[:, [0, 2]])

    def test_missing_position_names_the_available_ones(self):
        res = sparse_result()
        with pytest.raises(KeyError, match=r"positions \[0\] are not in .* \[3, 7, 9, 10\]"):
            res.select(positions=[0])
        with pytest.raises(KeyError, match="position_index"):
            res.select(positions=[-1])  # an index is not a position

    def test_layers_in_the_order_asked(self):
        res = sparse_result()
        sub = res.select(layers=[4, 0])
        assert sub.layers.tolist() == [4, 0]
        np.testing.assert_array_equal(sub.top_ids, res.top_ids[[2, 0]])
        np.testing.assert_array_equal(sub.top_tokens, res.top_tokens[[2, 0]])

    def test_a_layer_brings_every_row_it_labels(self):
        res = sited_result()
        assert res.layer_labels == ["embed", "1.attn", "1.mid", "1"]
        assert res.select(layers=1).layer_labels == ["1.attn", "1.mid", "1"]
        assert res.select(sites="resid").layer_labels == ["embed", "1"]
        assert res.select(layers=[1], sites=["attn", "resid"]).sites == ("attn", "resid")
        with pytest.raises(KeyError, match="sites \\['mlp'\\] are not in this result"):
            res.select(sites=["mlp"])

    def test_rows_are_distinct_and_the_embedding_has_one_site(self, res):
        with pytest.raises(ValueError, match="distinct"):
            res.take(layer_index=[0, 1, 1])
        with pytest.raises(ValueError, match="only the 'resid' site"):
            dataclasses.replace(res, sites=("attn", "resid", "resid"))
        with pytest.raises(ValueError, match="unknown sites"):
            dataclasses.replace(res, sites=("resid", "ffn", "resid"))

    def test_missing_layer_names_the_available_ones(self):
        with pytest.raises(KeyError, match=r"layers \[1\] are not in .* \[0, 2, 4\]"):
            sparse_result().select(layers=[1, 2])

    def test_layers_and_positions_together(self, res):
        sub = res.select(layers=[2], positions=[1])
        np.testing.assert_array_equal(sub.top_probs, res.top_probs[2:3, 1:2])
        assert sub.tokens == (" b",)

    def test_generated_positions_are_counted(self):
        res = sparse_result()
        assert res.select(positions=[3, 10]).n_generated == 1
        assert res.select(positions=[3, 7]).n_generated == 0

    def test_take_is_by_index(self):
        res = sparse_result()
        sub = res.take(layer_index=[-1], position_index=[0, -1])
        assert sub.layers.tolist() == [4] and sub.positions.tolist() == [3, 10]
        np.testing.assert_array_equal(sub.entropy, res.entropy[np.ix_([2], [0, 3])])
        assert sub.n_generated == 1
        with pytest.raises(IndexError, match="position_index 4 is outside"):
            res.take(position_index=[4])

    def test_select_equals_take_of_the_matching_indices(self):
        res = sparse_result()
        assert_same(
            res.select(layers=[2, 4], positions=[7, 9]),
            res.take(layer_index=[1, 2], position_index=[1, 2]),
        )

    def test_empty_selection_is_refused(self, res):
        with pytest.raises(ValueError, match="at least one layer"):
            res.select(layers=[])


class TestTransforms:
    def test_stride_keeps_last_layer(self, res):
        assert res.stride(2).layers.tolist() == [0, 2]
        longer = sited_result()
        assert longer.stride(3).layer_labels == ["embed", "1"]  # rows 0 and 3 (the last)
        with pytest.raises(ek.InvalidRequest, match="stride must be"):
            res.stride(0)

    def test_target(self, res):
        np.testing.assert_array_equal(res.target(" z").prob, res.target_probs[..., 0])
        assert res.target(3).label == " z"
        with pytest.raises(KeyError, match="not a target"):
            res.target(" q")

    def test_top_k_trace_reads_the_lists_and_leaves_gaps(self, res):
        # token 4 is second at the last column of every row; token 1 is only at column 0
        token, probs = res.top_k_trace(4)
        np.testing.assert_array_equal(probs, res.top_probs[:, -1, 1])
        assert token == "w"
        assert np.isnan(res.top_k_trace(1)[1]).all()
        np.testing.assert_array_equal(res.top_k_trace(1, position=0)[1], res.top_probs[:, 0, 0])

    def test_trajectory_draws_targets_and_top_k_tokens(self, res):
        from matplotlib.figure import Figure

        ax = Figure().subplots()
        ek.plot.trajectory(res, [" z"], from_top_k=[4], ax=ax)
        labels = [line.get_label() for line in ax.get_lines()]
        assert labels == ["p(' z')", "p('w') where in top-k"]
        np.testing.assert_array_equal(ax.get_lines()[1].get_ydata(), res.top_probs[:, -1, 1])


class TestExport:
    def test_json_round_trip_is_exact(self, tmp_path):
        res = sparse_result()
        assert_same(ek.LensResult.from_json(res.to_json()), res)
        path = tmp_path / "lens.json"
        res.to_json(str(path))
        assert_same(ek.LensResult.from_json(str(path)), res)

    def test_pandas_one_row_per_layer_position_rank(self, res):
        frame = res.to_pandas()
        assert len(frame) == 3 * 2 * 2
        assert not frame.duplicated(["layer", "position", "rank"]).any()
        row = frame.query("layer == 2 and position == 1 and rank == 0").iloc[0]
        assert row.token == res.top_tokens[2, 1, 0] and row.prob == res.top_probs[2, 1, 0]
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
        assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "␣b"]  # whitespace marked
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


def test_tokens_are_the_tokens_and_labels_tell_repeats_apart():
    res = dataclasses.replace(ek.LensResult.example(), tokens=(" a", " a"))
    assert res.tokens == (" a", " a")
    assert res.token_labels == (" a#0", " a#1")
    assert ek.LensResult.from_json(res.to_json()).tokens == (" a", " a")
    assert res.to_pandas()["input_token"].tolist()[:2] == [" a", " a"]


def test_run_label_says_what_was_run():
    res = ek.LensResult.example()
    assert res.run_label == "logit lens"
    edited = dataclasses.replace(
        res,
        meta={
            "lens": "tuned",
            "patches": [{"layer": 12, "site": "resid", "head": None}, {"layer": 3, "head": 2}],
            "steer": [{"layer": 10, "scale": -1.0}],
        },
    )
    assert edited.run_label == (
        "tuned lens, patched (layer 12 resid, head 2 of layer 3), steered (layer 10 x-1)"
    )
    assert "Tuned lens, patched" in edited._repr_html_()
    assert edited.run_label in ek.plot.heatmap(edited).axes[0].get_title()


def test_unbounded_metrics_take_robust_colour_limits():
    from envoykit.results.metrics import METRICS

    kl = np.concatenate([np.linspace(0.0, 5.0, 99), [157.0]])  # one embedding-like outlier
    low, high = METRICS["kl"].range(kl)
    assert low == pytest.approx(np.percentile(kl, 1)) and high < 10
    assert METRICS["kl"].scale(kl)["robust"] is True
    assert METRICS["kl"].range(np.array([0.0, 157.0])) == (0.0, 157.0)  # too few to trim
    assert METRICS["prob"].range(kl) == (0.0, 1.0) and not METRICS["prob"].scale(kl)["robust"]


def test_trajectory_with_sites_draws_the_stream_as_its_line():
    """Sub-layer rows are markers between layers, the stream is the line, rank lines are in
    the legend, and the layer ticks are thinned to numbers that do not run together."""
    res = ek.LensResult.example()
    rows = [(0, "resid"), (1, "attn"), (1, "mlp"), (1, "resid")]
    n_pos = len(res.positions)
    k = res.top_ids.shape[-1]
    sited = ek.LensResult(
        **{
            **res.to_dict(),
            "layers": [layer for layer, _ in rows],
            "sites": [site for _, site in rows],
            "top_ids": np.zeros((4, n_pos, k), dtype=np.int64),
            "top_tokens": np.full((4, n_pos, k), "x", dtype=object),
            "top_probs": np.full((4, n_pos, k), 0.1, dtype=np.float32),
            "entropy": np.ones((4, n_pos), dtype=np.float32),
            "kl": np.zeros((4, n_pos), dtype=np.float32),
            "target_probs": np.full((4, n_pos, 1), 0.2, dtype=np.float32),
            "target_ranks": np.zeros((4, n_pos, 1), dtype=np.int64),
        }
    )
    figure = ek.plot.trajectory(sited, " z")
    ax = figure.axes[0]
    line = ax.get_lines()[0]
    assert line.get_xdata().tolist() == [0.0, 1.0]  # the stream after each layer only
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert "rank(' z'), right axis" in labels and "attn rows" in labels
    assert [t.get_text() for t in ax.get_xticklabels()] == ["embed", "1"]
