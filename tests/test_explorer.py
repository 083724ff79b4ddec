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
import traitlets
from matplotlib.colors import to_hex

import envoykit as ek
from envoykit import plot
from envoykit.envoys import Location
from envoykit.explorer import (
    AttributionPanel,
    Heatmap,
    LayerPicker,
    LensExplorer,
    heatmap_data,
    picker_layers,
    result_layers,
    rows,
    standalone_html,
    widgets_dir,
)
from envoykit.request import describe_target, lens_rows

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


def rows_result(picked: list[tuple[int, str]]) -> ek.LensResult:
    """A result holding exactly the rows ``picked``, row ``i``'s top-1 probability ``i / 100``
    (and its top-1 id ``i``), so a test can tell which row landed where."""
    n = len(picked)
    top1 = np.arange(n, dtype=np.float32) / 100
    probs = np.stack([top1, top1 / 2], axis=-1)[:, None, :].repeat(2, axis=1)
    ids = np.stack([np.arange(n), np.arange(n) + 100], axis=-1)[:, None, :].repeat(2, axis=1)
    return ek.LensResult(
        prompt="a b",
        token_ids=np.array([5, 6]),
        tokens=("a", " b"),
        positions=np.array([0, 1]),
        layers=np.array([layer for layer, _ in picked]),
        sites=tuple(site for _, site in picked),
        top_ids=ids,
        top_tokens=ids.astype(str).astype(object),
        top_probs=probs,
        entropy=np.ones((n, 2), dtype=np.float32),
        kl=np.zeros((n, 2), dtype=np.float32),
        target_ids=np.array([3]),
        target_labels=(" z",),
        target_tokens=(" z",),
        target_probs=np.full((n, 2, 1), 0.1, dtype=np.float32),
        target_ranks=np.zeros((n, 2, 1), dtype=np.int64),
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


def test_picked_rows_come_from_one_lens_of_their_union():
    """Rows that are no cross product (layer 1's attention, layer 3's stream between its
    blocks, the embedding) are lensed as the union of their layers and sites, and exactly
    the picked rows are kept, each with its own numbers."""
    picked = rows.picked([3, 0], [[3, "resid_mid"], [1, "attn"], [3, "resid_mid"]])
    assert picked == [(0, "resid"), (1, "attn"), (3, "resid_mid"), (3, "resid")]
    layers, sites = rows.lens_arguments(picked)
    assert (layers, sites) == ([0, 1, 3], ["attn", "resid_mid", "resid"])
    union = list(lens_rows(layers, sites))  # the rows Engine.lens returns for these
    assert set(picked) < set(union)
    kept = rows.keep(rows_result(union), picked)
    assert kept.layer_labels == ["embed", "1.attn", "3.mid", "3"]
    assert kept.top_ids[:, 0, 0].tolist() == [union.index(row) for row in picked]
    full = rows_result(union)
    assert rows.keep(full, union) is full
    assert rows.keep(full, [(2, "mlp")]) is None


def test_picker_sites_are_checked_and_kept_in_model_order():
    picker = LayerPicker(result_layers(rows_result([(0, "resid"), (1, "attn"), (1, "resid")])))
    assert picker.rows == [(0, "resid"), (1, "resid")]  # the streams, as before sites
    picker.set_state({"selected_sites": [[2, "mlp"], [1, "attn"], [2, "resid_mid"]]})
    assert picker.selected_sites == [[1, "attn"], [2, "resid_mid"], [2, "mlp"]]
    assert picker.get_state()["selected_sites"] == picker.selected_sites
    assert picker.rows == [(0, "resid"), (1, "attn"), (1, "resid"), (2, "resid_mid"), (2, "mlp")]
    for bad in ([[0, "attn"]], [[1, "resid"]], [[1, "ffn"]], [[True, "mlp"]], [[1]]):
        with pytest.raises(traitlets.TraitError):
            picker.set_state({"selected_sites": bad})
    picker.rows = [(2, "mlp"), (0, "resid")]
    assert (picker.selected, picker.selected_sites) == ([0], [[2, "mlp"]])


def test_picker_offers_sublayer_sites_of_each_decoder_layer():
    locations = [Location("model.embed_tokens", "embed", None)]
    for i in range(2):
        locations += [
            Location(f"model.layers.{i}", "layer", i),
            Location(f"model.layers.{i}.self_attn.o_proj", "attn", i),
            Location(f"model.layers.{i}.mlp.down_proj", "mlp", i),
        ]
    items = picker_layers(locations)
    assert [(item["layer"], item["label"], item["resid"]) for item in items] == [
        (0, "embed", True),
        (1, "1", True),
        (2, "2", True),
    ]
    assert items[0]["subs"] == []  # the embedding is a stream with no blocks
    subs = items[2]["subs"]
    assert [(sub["site"], sub["label"]) for sub in subs] == [
        ("attn", "attn"),
        ("resid_mid", "mid"),
        ("mlp", "mlp"),
    ]
    assert [sub["path"] for sub in subs] == [
        "model.layers.1.self_attn.o_proj",
        "",
        "model.layers.1.mlp.down_proj",
    ]
    assert subs[0]["title"].startswith("2.attn: what layer 2's attention writes")
    assert "model.layers.1.self_attn.o_proj" in subs[0]["title"]
    assert all(item["subs"] == [] for item in picker_layers(locations, sublayers=False))


def test_read_only_explorer_picks_sublayer_rows():
    """A stored result with sub-layer rows: the picker offers exactly its rows, dropping one
    hides it, and the selected cell stays on its row (by label) when rows above it go."""
    res = rows_result([(0, "resid"), (2, "attn"), (2, "resid_mid"), (2, "resid")])
    explorer = LensExplorer(res)
    item = explorer.picker.layers[1]
    assert (item["layer"], item["resid"]) == (2, True)
    assert [sub["site"] for sub in item["subs"]] == ["attn", "resid_mid"]
    assert [i["layer"] for i in explorer.picker.layers] == [0, 2]
    assert explorer.heatmap.data["layer_labels"] == ["embed", "2.attn", "2.mid", "2"]

    explorer.heatmap.set_state({"selected": [3, 1]})
    explorer.picker.set_state({"selected_sites": [[2, "resid_mid"]]})
    assert explorer.heatmap.data["layer_labels"] == ["embed", "2.mid", "2"]
    assert explorer.heatmap.selected == [2, 1]  # still row "2"
    np.testing.assert_allclose(explorer.heatmap.data["top_probs"][1][0][0], 0.02)
    explorer.picker.set_state({"selected": [0]})
    assert explorer.heatmap.selected is None  # row "2" is gone

    assert explorer.attribution is None
    assert "needs an engine" in explorer.attribution_panel.header.value


def test_attribution_panel_draws_and_escapes():
    """The panel names target and position as text (an HTML widget: escaped), draws the
    attention and MLP bars with the clicked row's layer shaded, and forgets them on a
    message."""
    att = ek.AttributionResult(
        prompt=XSS_IMG + XSS_SCRIPT,
        token_ids=np.array([6]),
        tokens=(XSS_SCRIPT,),
        positions=np.array([1]),
        components=("embed", "attn 1", "mlp 1"),
        target_ids=np.array([3]),
        target_labels=(XSS_IMG,),
        target_tokens=(XSS_IMG,),
        values=np.array([[[1.0]], [[-1.0]], [[3.0]]]),
        logits=np.array([[3.0]]),
        model_logits=np.array([[3.0]]),
    )
    panel = AttributionPanel()
    panel.show(att, 3, layer=1, row="1.attn")
    header = panel.header.value
    assert "<img" not in header and "<script" not in header
    assert "&lt;img" in header and "position 1" in header and "1.attn" in header
    assert panel.result is att
    ax = panel.figure.axes[0]
    heights = [bar.get_height() for bars in ax.containers for bar in bars]
    assert heights == pytest.approx([1.0, -1.0, 3.0])  # embed, attn 1, mlp 1
    shade = [p for p in ax.patches if p.get_label() == "row 1.attn"]
    assert len(shade) == 1
    assert shade[0].get_window_extent().x0 < ax.transData.transform((0.8, 0))[0]
    assert panel.view.outputs[0]["data"]["image/png"]
    panel.say("type or pin a target")
    assert (panel.result, panel.figure, panel.view.outputs) == (None, None, ())
    assert "type or pin a target" in panel.header.value


@pytest.mark.engine
def test_layer_picker_offers_whole_valued_layers(tiny2):
    locations = tiny2.locations()
    items = picker_layers(locations)
    n = tiny2.info.n_layers
    assert [item["layer"] for item in items] == list(range(n + 1))
    assert items[0]["label"] == "embed"
    whole = {loc.path for loc in locations}
    for item in items[1:]:
        assert [sub["site"] for sub in item["subs"]] == ["attn", "resid_mid", "mlp"]
        assert {item["path"], *(sub["path"] for sub in item["subs"])} - {""} <= whole
    picker = LayerPicker(items)
    assert picker.selected == list(range(n + 1))
    picker.set_state({"selected": [0, n]})
    assert picker.get_state()["selected"] == [0, n]
    assert tiny2.readout.mlp_prenorm is not None  # so the explorer offers the sites


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
def test_run_lenses_the_picked_sublayer_rows(explorer, tiny2):
    """Rows that are no cross product come back exactly, each with the numbers a lens of
    that row alone gives, and the heatmap labels them."""
    n = tiny2.info.n_layers
    explorer.picker.rows = [(0, "resid"), (1, "attn"), (n, "resid_mid"), (n, "resid")]
    res = explorer.run()
    assert res.layer_labels == ["embed", "1.attn", f"{n}.mid", str(n)]
    assert explorer.heatmap.data["layer_labels"] == res.layer_labels
    for i, (layer, site) in enumerate([(1, "attn"), (n, "resid_mid")], start=1):
        alone = tiny2.lens(PROMPT, layers=[layer], sites=[site], top_k=5, targets=[" Paris"])
        np.testing.assert_array_equal(res.top_ids[i], alone.top_ids[0])
        np.testing.assert_allclose(res.top_probs[i], alone.top_probs[0], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(res.kl[i], alone.kl[0], rtol=1e-4, atol=1e-6)
    assert "4 rows" in explorer.status.value


@pytest.mark.engine
def test_clicking_a_cell_attributes_its_position(explorer, tiny2):
    assert "click a heatmap cell" in explorer.attribution_panel.header.value
    res = explorer.run()
    assert explorer.attribution is None
    paris = int(res.target_ids[0])

    explorer.heatmap.set_state({"selected": [len(res.layers) - 1, 2]})
    att = explorer.attribution
    assert (att.positions.tolist(), att.target_ids.tolist()) == ([2], [paris])
    assert att.tokens == (res.tokens[2],)
    expected = tiny2.attribute(PROMPT, [paris], positions=[2])
    np.testing.assert_allclose(att.values, expected.values, rtol=1e-5, atol=1e-5)
    assert "position 2" in explorer.attribution_panel.header.value
    assert explorer.attribution_figure.axes[0].containers  # the bars are drawn

    # Another row of the same column asks the engine nothing new: same attribution object.
    explorer.heatmap.set_state({"selected": [0, 2]})
    assert explorer.attribution is att
    assert "row embed" in explorer.attribution_panel.header.value

    # Pinning a token attributes it (the token pinned last), at the selection kept.
    new_id = next(int(i) for i in res.top_ids[-1, 2] if i != paris)
    explorer.heatmap.set_state({"pinned": [new_id]})
    assert explorer.attribution.target_ids.tolist() == [new_id]
    assert explorer.attribution.positions.tolist() == [2]

    # No target: the panel says what to do and holds no attribution.
    explorer.heatmap.pinned = []
    explorer.targets.value = ""
    explorer.run()
    explorer.heatmap.set_state({"selected": [0, 1]})
    assert explorer.attribution is None
    assert "type or pin a target" in explorer.attribution_panel.header.value


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
