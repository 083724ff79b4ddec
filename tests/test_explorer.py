"""`LensExplorer` and its widgets at the Python level: traitlets in, traitlets out.

The browser only ever changes the synced traitlets, so ``set_state`` (what ipywidgets calls
when a message arrives from the browser) stands in for a click here; `test_browser` checks
the clicks themselves.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import envoykit as ek
from envoykit.explorer import (
    Heatmap,
    LayerPicker,
    LensExplorer,
    heatmap_data,
    picker_layers,
    widgets_dir,
)
from envoykit.request import describe_target

PROMPT = "The capital of France is"


def test_import_leaves_vllm_alone():
    code = "import sys, envoykit.explorer; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_widgets_dir_has_the_modules():
    assert {"heatmap.js", "layer_picker.js", "explorer.css"} <= {
        p.name for p in widgets_dir().iterdir()
    }


def test_heatmap_state_round_trip():
    res = ek.LensResult.example()
    view = Heatmap(res)
    data = view.get_state()["data"]
    assert data["layer_labels"] == ["embed", "1", "2"]
    assert data["tokens"] == ["a", " b"]
    assert [data["vocab"][str(i)] for i in data["top_ids"][2][1]] == ["z", "w"]
    assert data["top_ids"] == res.top_ids.tolist()
    np.testing.assert_allclose(data["top_probs"], res.top_probs, atol=1e-6)
    assert set(data["grids"]) == {"prob", "entropy", "kl", " z"}
    np.testing.assert_allclose(data["grids"]["kl"]["values"], res.kl, atol=1e-6)
    view.set_state({"metric": "kl", "selected": [2, 1], "pinned": [3, 4]})
    assert (view.metric, view.selected, view.pinned) == ("kl", [2, 1], [3, 4])
    view.set_state({"selected": None})
    assert view.selected is None
    assert view.get_state()["selected"] is None


def test_heatmap_data_sends_nan_as_null():
    res = ek.LensResult.example()
    entropy = res.entropy.copy()
    entropy[0, 0] = np.nan
    data = heatmap_data(ek.LensResult.from_dict({**res.to_dict(), "entropy": entropy}))
    assert data["grids"]["entropy"]["values"][0][0] is None


def test_layer_picker_offers_whole_valued_layers(tiny2):
    locations = tiny2.locations()
    items = picker_layers(locations)
    n = tiny2.info.n_layers
    assert [item["layer"] for item in items] == list(range(n + 1))
    assert items[0]["label"] == "embed"
    whole = {loc.path for loc in locations}
    for item in items[1:]:
        assert [sub["kind"] for sub in item["subs"]] == ["attn", "mlp"]
        assert {item["path"], *(sub["path"] for sub in item["subs"])} <= whole
    picker = LayerPicker(items)
    assert picker.selected == list(range(n + 1))
    picker.set_state({"selected": [0, n]})
    assert picker.get_state()["selected"] == [0, n]


@pytest.fixture
def explorer(tiny2):
    return LensExplorer(tiny2, prompt=PROMPT, targets=[" Paris"], top_k=5)


def test_run_fills_the_heatmap(explorer, tiny2):
    n = tiny2.info.n_layers
    explorer.picker.set_state({"selected": [0, 1, n]})
    res = explorer.run()
    assert res is explorer.result
    assert res.layers.tolist() == [0, 1, n]
    assert res.top_ids.shape[-1] == 5
    expected = tiny2.lens(PROMPT, layers=[0, 1, n], top_k=5, targets=[" Paris"])
    np.testing.assert_array_equal(res.top_ids, expected.top_ids)
    data = explorer.heatmap.data
    assert data["layer_labels"] == ["embed", "1", str(n)]
    tokens = [[[data["vocab"][str(i)] for i in cell] for cell in row] for row in data["top_ids"]]
    assert tokens == res.top_tokens.astype(str).tolist()
    np.testing.assert_allclose(data["top_probs"], res.top_probs, atol=1e-6)
    assert " Paris" in data["grids"]
    assert " Paris" in [value for _, value in explorer.metric.options]
    explorer.metric.value = " Paris"
    assert explorer.heatmap.metric == " Paris"
    assert not explorer.run_button.disabled
    assert explorer.message.value == ""
    assert explorer.trajectory_targets == [" Paris"]


def test_select_and_pin_update_the_trajectory(explorer):
    res = explorer.run()
    assert res.tokens[-1] in explorer.trajectory_figure.axes[0].get_title()
    explorer.heatmap.set_state({"selected": [len(res.layers) - 1, 0]})
    assert repr(res.tokens[0]) in explorer.trajectory_figure.axes[0].get_title()
    before = explorer.trajectory.outputs

    new_id = next(int(i) for i in res.top_ids[-1, 0] if i not in res.target_ids)
    explorer.heatmap.set_state({"pinned": [new_id]})
    assert new_id in explorer.result.target_ids.tolist()
    assert explorer.result is not res  # re-run with the pinned token as a target
    assert explorer.trajectory_targets == [" Paris", str(new_id)]
    assert explorer.heatmap.selected == [len(res.layers) - 1, 0]  # kept across the re-run
    assert explorer.trajectory.outputs != before
    trace = explorer.result.target(new_id)
    top = explorer.result.top_probs[-1, 0][explorer.result.top_ids[-1, 0] == new_id]
    np.testing.assert_allclose(trace.prob[-1, 0], top[0], rtol=1e-5)

    # A later run keeps the pinned token among the targets.
    explorer.run()
    assert new_id in explorer.result.target_ids.tolist()


def test_bad_input_shows_an_error_and_stays_usable(explorer):
    good = explorer.run()
    explorer.prompt.value = "   "
    assert explorer.run() is None
    assert "prompt is empty" in explorer.message.value
    assert explorer.result is good
    assert not explorer.run_button.disabled

    explorer.prompt.value = PROMPT
    explorer.targets.value = " Paris,"
    assert "tokenizes to nothing" in explorer.tokenization.value
    assert explorer.run() is None
    assert "tokenizes to nothing" in explorer.message.value

    explorer.targets.value = " Paris"
    explorer.picker.set_state({"selected": []})
    assert explorer.run() is None
    assert "no layers picked" in explorer.message.value

    explorer.picker.set_state({"selected": [1, 2]})
    assert explorer.run() is not None
    assert explorer.message.value == ""


def test_targets_show_their_tokenization(explorer, tiny2):
    explorer.targets.value = " Paris, London"
    for piece in (" Paris", " London"):
        for token in describe_target(tiny2.tokenizer, piece):
            assert repr(token).replace("'", "&#x27;") in explorer.tokenization.value


def test_read_only_explorer(tmp_path):
    res = ek.LensResult.example()
    explorer = LensExplorer(res)
    assert explorer.run_button.disabled
    assert explorer.run() is None
    assert "read-only" in explorer.message.value
    assert explorer.heatmap.data == heatmap_data(res)
    assert explorer.trajectory_targets == [" z"]

    # The picker filters the layers shown; the stored result itself is untouched.
    explorer.picker.set_state({"selected": [0, 2]})
    assert explorer.heatmap.data["layer_labels"] == ["embed", "2"]
    assert explorer.result is res

    # Pinning a top-k token that is not a target: drawn from the top-k lists, marked so.
    explorer.heatmap.set_state({"selected": [1, 0], "pinned": [1]})
    assert explorer.trajectory_targets == [" z", "x"]
    line = explorer.trajectory_figure.axes[0].get_lines()[-1]
    assert "where in top-k" in line.get_label()
    np.testing.assert_allclose(line.get_ydata(), res.top_probs[[0, 2], 0, 0])

    for suffix in ("png", "svg", "json", "html"):
        path = explorer.export(tmp_path / f"lens.{suffix}")
        assert path.stat().st_size > 0
    back = ek.LensResult.from_json(str(tmp_path / "lens.json"))
    assert back.layers.tolist() == [0, 2]
    page = (tmp_path / "lens.html").read_text()
    assert "ekCellCenter" in page and "</script></body>" in page
    with pytest.raises(ek.InvalidRequest, match="cannot export"):
        explorer.export(tmp_path / "lens.txt")
