"""`LensExplorer` and its widgets at the Python level: traitlets in, traitlets out.

The browser only ever changes the synced traitlets, so ``set_state`` (what ipywidgets calls
when a message arrives from the browser) stands in for a click here; `test_browser` checks
the clicks themselves.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.colors import to_hex

import envoykit as ek
from envoykit import plot
from envoykit.explorer import (
    Heatmap,
    LayerPicker,
    LensExplorer,
    heatmap_data,
    picker_layers,
    standalone_html,
    widgets_dir,
)
from envoykit.request import describe_target

PROMPT = "The capital of France is"

# Model text is arbitrary: each of these runs a script if it ever reaches a page as HTML.
XSS_IMG = "<img src=x onerror=window.__pwned=1>"
XSS_SCRIPT = "</script><script>window.__pwned=2</script>"
XSS_MODEL = "<img src=x onerror=window.__pwned=3>"


def hostile_result() -> ek.LensResult:
    """`LensResult.example` with markup for every piece of text: tokens, top tokens, the
    target, the prompt and the model name."""
    res = ek.LensResult.example()
    vocab = {1: XSS_IMG, 2: "<b>bold</b>", 3: XSS_SCRIPT, 4: "a & b <!--"}
    return dataclasses.replace(
        res,
        prompt=XSS_IMG + XSS_SCRIPT,
        tokens=(XSS_IMG, XSS_SCRIPT),
        top_tokens=np.vectorize(vocab.get, otypes=[object])(res.top_ids),
        target_ids=np.array([1]),
        target_labels=(XSS_IMG,),
        target_tokens=(XSS_IMG,),
        meta={"model": XSS_MODEL},
    )


def test_import_leaves_vllm_alone():
    code = "import sys, envoykit.explorer; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_widgets_dir_has_the_modules():
    assert {"heatmap.js", "layer_picker.js", "standalone.js", "explorer.css"} <= {
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


def test_plot_and_widget_share_each_metric_definition():
    """The browser colours a metric as the matplotlib heatmap does: same limits, the same
    colour map (sampled), the same title."""
    res = ek.LensResult.example()
    data = heatmap_data(res)
    assert list(data["grids"]) == ["prob", "entropy", "kl", " z"]
    for key, grid in data["grids"].items():
        figure = plot.heatmap(res, key)
        image = figure.axes[0].images[0]
        assert (grid["vmin"], grid["vmax"]) == image.get_clim()
        samples = image.cmap(np.linspace(0, 1, len(grid["stops"])))
        assert grid["stops"] == [to_hex(colour) for colour in samples]
        title = f"{grid['label']} ({grid['units']})" if grid["units"] else grid["label"]
        assert figure.axes[1].get_ylabel() == title  # the colour bar's label
        plt.close(figure)
    assert data["grids"][" z"]["label"] == "p(' z')"
    assert (data["grids"]["entropy"]["units"], data["grids"]["prob"]["units"]) == ("nats", "")


def test_standalone_page_carries_model_text_inertly():
    """No token, prompt or model name reaches the page as markup (the browser test opens it)."""
    page = standalone_html(hostile_result())
    assert "<img" not in page and "<b>" not in page and "<!--" not in page
    # Only the page's own three scripts open and close.
    assert len(re.findall(r"<script", page)) == len(re.findall(r"</script>", page)) == 3
    state = re.search(r'<script type="application/json" id="ek-state">(.*?)</script>', page)
    data = json.loads(state.group(1))["data"]
    assert data["tokens"] == [XSS_IMG, XSS_SCRIPT]
    assert data["grids"][XSS_IMG]["label"] == f"p({XSS_IMG!r})"


def test_heatmap_data_sends_nan_as_null():
    res = ek.LensResult.example()
    entropy = res.entropy.copy()
    entropy[0, 0] = np.nan
    data = heatmap_data(ek.LensResult.from_dict({**res.to_dict(), "entropy": entropy}))
    assert data["grids"]["entropy"]["values"][0][0] is None


@pytest.mark.engine
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


@pytest.mark.engine
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


@pytest.mark.engine
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


@pytest.mark.engine
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


@pytest.mark.engine
def test_targets_show_their_tokenization(explorer, tiny2):
    explorer.targets.value = " Paris, London"
    for piece in (" Paris", " London"):
        for token in describe_target(tiny2.tokenizer, piece):
            assert repr(token).replace("'", "&#x27;") in explorer.tokenization.value


@pytest.mark.engine
def test_typed_markup_is_shown_as_text(explorer):
    """The tokenization is an HTML widget: a target typed as markup shows as text."""
    explorer.targets.value = XSS_IMG
    assert "<img" not in explorer.tokenization.value
    assert "&lt;img" in explorer.tokenization.value


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
    assert "ekCellCenter" in page and page.rstrip().endswith("</body></html>")
    with pytest.raises(ek.InvalidRequest, match="cannot export"):
        explorer.export(tmp_path / "lens.txt")
