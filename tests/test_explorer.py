"""`LensExplorer` and its widgets at the Python level: traitlets in, traitlets out.

The browser only ever changes the synced traitlets, so ``set_state`` (what ipywidgets calls
when a message arrives from the browser) stands in for a click here; `test_browser` checks
the clicks themselves.
"""

from __future__ import annotations

import dataclasses
import html
import json
import re
import subprocess
import sys
import threading
import time
from html.parser import HTMLParser

import ipywidgets as widgets
import matplotlib.pyplot as plt
import numpy as np
import pytest
import traitlets
from matplotlib.colors import to_hex
from test_features import load_sae

import envoykit as ek
from envoykit import plot
from envoykit.analyses.request import describe_target, lens_rows
from envoykit.explorer import (
    AttributionPanel,
    ComparePanel,
    FeaturesPanel,
    Heatmap,
    LayerPicker,
    LensExplorer,
    compare_data,
    heatmap_data,
    picker_layers,
    result_layers,
    rows,
    standalone_html,
    widgets_dir,
)
from envoykit.explorer.compare_panel import drop_patch, patched_cell
from envoykit.explorer.feature_html import (
    chips_data,
    contexts_html,
    continuation_html,
    logits_html,
    token_label,
    token_row,
)
from envoykit.explorer.sweep_panel import SweepPanel, join_rows
from envoykit.model.envoys import Location
from envoykit.plot.text import visible
from envoykit.results.feature_stats import Context

PROMPT = "The capital of France is"
OTHER = "The capital of Italy is"  # as many tokens as PROMPT on tiny (7)

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


def test_read_only_explorer_has_no_compare_mode():
    explorer = LensExplorer(ek.LensResult.example(), compare_with=OTHER)
    assert explorer.compare.disabled and not explorer.compare.value
    assert explorer.compare_box.layout.display == "none"
    assert explorer.patch_cell([0, 0], [0, 0]) is None
    assert "needs compare mode" in explorer.message.value
    assert explorer.run_sweep() is None and explorer.sweep is None
    assert "Run in compare mode first" in explorer.sweep_panel.header.value


def test_panels_are_tabs_one_open_at_a_time():
    explorer = LensExplorer(ek.LensResult.example())
    tabs = explorer.panels
    assert tabs.titles == ("Trajectory", "Attribution", "Attention", "Compare")
    assert tabs.children[:3] == (
        explorer.trajectory,
        explorer.attribution_panel,
        explorer.attention_panel,
    )
    assert tabs.selected_index == 0
    explorer.open_panel("Attention")
    assert tabs.selected_index == 2
    assert explorer.compare_hint.layout.display is None  # compare mode is off: a hint
    with pytest.raises(ValueError):
        explorer.open_panel("Nowhere")


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


def diverging_comparison() -> ek.CompareResult:
    """`CompareResult.example` where the runs' top-1 differs in the second cell and the
    second column's input tokens differ."""
    res = ek.CompareResult.example()
    return dataclasses.replace(
        res, top_ids_b=np.array([[3, 5]]), top_tokens_b=(" z", XSS_IMG), js=np.array([[0.1, 0.5]])
    )


def test_diff_payload_names_both_runs_and_colours_like_plot_compare():
    res = diverging_comparison()
    data = compare_data(res, ("clean", "patched"))
    assert data["layer_labels"] == ["1"]
    assert data["tokens"] == ["a", " b| c"]
    assert data["cell_text"] == [[" z", f" w→{XSS_IMG}"]]
    assert data["top_labels"] == ["clean", "patched"]
    assert data["top_ids"] == [[[3, 3], [4, 5]]]
    assert data["vocab"] == {"3": " z", "4": " w", "5": XSS_IMG}
    np.testing.assert_allclose(data["top_probs"], [[[0.5, 0.75], [0.5, 0.5]]])
    assert list(data["grids"]) == ["js", " z"]
    np.testing.assert_allclose(data["grids"][" z"]["values"], res.delta(" z"))
    assert data["grids"][" z"]["label"] == "Δ p(' z'), patched − clean"
    for key, grid in data["grids"].items():
        figure = plot.compare(res, key)
        image = figure.axes[0].images[0]
        assert (grid["vmin"], grid["vmax"]) == pytest.approx(image.get_clim())
        samples = image.cmap(np.linspace(0, 1, len(grid["stops"])))
        assert grid["stops"] == [to_hex(colour) for colour in samples]
        plt.close(figure)
    assert data["grids"][" z"]["cmap"] == "RdBu_r"  # diverging: no change is the middle
    # Fitted to the largest change, centred at none (a change of 0.25 is the darkest).
    largest = float(np.abs(res.delta(" z")).max())
    assert (data["grids"][" z"]["vmin"], data["grids"][" z"]["vmax"]) == (-largest, largest)
    assert not data["grids"][" z"]["robust"]


def test_the_diff_colours_over_plus_minus_one_on_the_toggle():
    panel = ComparePanel("group")
    panel.diff.metric = " z"
    assert panel.diff.limits == {}  # the metric's own: fitted, centred
    panel.diff_scale.value = "absolute"
    assert panel.diff.limits == {"vmin": -1.0, "vmax": 1.0, "log": False}
    panel.diff.metric = "js"  # the JS divergence keeps its own 0..ln 2
    assert panel.diff.limits == {}
    panel.diff.metric = " z"
    assert panel.diff.limits["vmin"] == -1.0
    panel.diff_scale.value = "fitted"
    assert panel.diff.limits == {}


def test_a_drop_patches_the_dragged_row_at_the_column_dropped_on():
    """The patch takes the dragged cell's row (layer and site) and position; of the cell
    dropped on only the column counts."""
    source = rows_result([(0, "resid"), (2, "attn"), (2, "resid")])
    target = rows_result([(0, "resid"), (2, "attn"), (2, "resid")])
    patch = drop_patch(source, [1, 0], target, [2, 1])  # dropped on row 2, column 1
    assert patch == ek.Patch("a b", 2, source_position=0, target_position=1, site="attn")
    assert patched_cell(target, patch) == [1, 1]  # the dragged row, the column dropped on
    assert patched_cell(rows_result([(0, "resid")]), patch) is None
    for source_cell, target_cell in (([3, 0], [0, 0]), ([0, 2], [0, 0]), ([0, 0], [0, 5])):
        with pytest.raises(ek.InvalidRequest, match="outside its heatmap"):
            drop_patch(source, source_cell, target, target_cell)


def test_heatmap_drop_is_a_checked_pair_of_cells():
    view = Heatmap(drag_role="source", drag_group="g")
    assert view.get_state()["drop"] is None
    view.set_state({"drop": {"source": [1, 2], "target": [0, 3]}})
    assert view.drop == {"source": [1, 2], "target": [0, 3]}
    for bad in (
        {"source": [1, 2]},
        {"source": [1], "target": [0, 0]},
        {"source": [-1, 0], "target": [0, 0]},
        {"source": [True, 0], "target": [0, 0]},
        {"source": [0, 0], "target": [0, 0], "x": 1},
    ):
        with pytest.raises(traitlets.TraitError):
            view.set_state({"drop": bad})
    with pytest.raises(traitlets.TraitError):
        view.set_state({"drag_role": "sink"})


def test_compare_panel_shows_model_text_as_text():
    panel = ComparePanel("g")
    assert (panel.source.drag_role, panel.source.drag_group) == ("source", "g")
    panel.show_source(hostile_result())
    panel.show_diff(diverging_comparison(), ("first", "second"), XSS_SCRIPT)
    for header in (panel.source_header.value, panel.diff_header.value):
        assert "<img" not in header and "<script" not in header
    assert "&lt;img" in panel.source_header.value and "drag a cell" in panel.source_header.value
    assert panel.result is not None and panel.diff.data["top_labels"] == ["first", "second"]
    panel.say_diff("prompts differ", error=True)
    assert (panel.result, panel.diff.data) == (None, {})


def test_sweep_rows_join_in_order():
    res = ek.SweepResult.example()
    rows_of = [
        dataclasses.replace(res, layers=[i], values=res.values[[k]])
        for k, i in enumerate(res.layers)
    ]
    joined = join_rows(rows_of)
    assert joined.layers.tolist() == res.layers.tolist()
    np.testing.assert_array_equal(joined.values, res.values)
    assert (joined.clean, joined.source_value, joined.tokens) == (
        res.clean,
        res.source_value,
        res.tokens,
    )


def test_the_sweep_colours_fit_its_range_unless_asked_for_0_to_1():
    small = dataclasses.replace(ek.SweepResult.example(), metric="prob")
    small = dataclasses.replace(small, values=small.values * 0.1 + 0.03)  # effects of 0.03-0.13
    low, high = float(small.values.min()), float(small.values.max())
    panel = SweepPanel()
    panel.show(small)
    image = panel.figure.axes[0].images[0]
    assert image.get_clim() == pytest.approx((low, high))
    assert f"colours fitted to {low:.3g}..{high:.3g}" in panel.figure.axes[0].get_title()
    panel.scale.value = "absolute"  # redrawn, asking nothing
    assert panel.figure.axes[0].images[0].get_clim() == (0.0, 1.0)
    assert panel.result is small
    flat = dataclasses.replace(small, values=np.full_like(small.values, 0.5))
    vmin, vmax = ek.plot.sweep(flat).axes[0].images[0].get_clim()
    assert vmin < 0.5 < vmax  # a flat map still has a colour scale


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
    assert tiny2.readout.family is not None  # so the explorer offers the sites


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
def test_run_says_its_time_and_the_time_left_at_the_last_runs_pace(explorer, monkeypatch):
    """While a Run's lens is on the ranks the status line counts the seconds; from the
    second Run on it also gives the time left at the last Run's pace per row and position
    (or says the Run is slower than that). A finished Run says what it took."""
    said: list[str] = []
    explorer.status.observe(lambda change: said.append(change["new"]), "value")
    lens = explorer.engine.lens

    def slow_lens(**request):  # long enough for the ticker's second line
        time.sleep(1.3)
        return lens(**request)

    monkeypatch.setattr(explorer.engine, "lens", slow_lens)
    explorer.run()
    running = [line for line in said if line.startswith("<i>running the lens on tiny")]
    assert running[0] == "<i>running the lens on tiny: 0 s…</i>"  # no pace known yet
    assert "running the lens on tiny: 1 s…" in running[1]
    assert re.search(r"top-5; took [12] s$", said[-1]), said[-1]
    said.clear()
    explorer.prompt.value = PROMPT + " and the capital of Spain is"  # twice the cells
    explorer.run()
    running = [line for line in said if line.startswith("<i>running the lens on tiny")]
    assert re.fullmatch(
        r"<i>running the lens on tiny: 0 s, about [2-5] s left at the last run's pace…</i>",
        running[0],
    ), running[0]
    assert "took" in said[-1]


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
    assert explorer.wait(60)
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

    # A pin is for display: the attribution still measures the first target, asking the
    # engine nothing new, and offers the pinned token beside it.
    new_id = next(int(i) for i in res.top_ids[-1, 2] if i != paris)
    choice = explorer.attribution_panel.target
    explorer.heatmap.set_state({"pinned": [new_id]})
    assert explorer.wait(60)
    assert new_id in explorer.result.target_ids.tolist()  # the lens traces the pin
    assert explorer.attribution is att and choice.chosen() == paris
    assert [value for _, value in choice.options] == [paris, new_id]
    assert choice.options[1][0].endswith("(pinned)")
    # Picking it in the panel attributes it, at the selection kept.
    choice.value = new_id
    assert explorer.wait(60)
    assert explorer.attribution.target_ids.tolist() == [new_id]
    assert explorer.attribution.positions.tolist() == [2]
    # A new Run keeps the pick while the token is offered; unpinned, the first target is back.
    explorer.run()
    assert explorer.wait(60) and choice.chosen() == new_id
    explorer.heatmap.pinned = []
    assert explorer.wait(60)
    assert choice.chosen() == paris and explorer.attribution.target_ids.tolist() == [paris]

    # No target: the panel says what to do and holds no attribution.
    explorer.targets.value = ""
    explorer.run()
    explorer.heatmap.set_state({"selected": [0, 1]})
    assert explorer.attribution is None
    assert "type a target, or pin a token" in explorer.attribution_panel.header.value


@pytest.mark.engine
def test_clicking_a_cell_opens_the_attention_at_its_layer_and_position(explorer, tiny2):
    panel = explorer.attention_panel
    assert "click a heatmap cell" in panel.header.value
    res = explorer.run()
    n = tiny2.info.n_layers
    explorer.heatmap.set_state({"selected": [len(res.layers) - 1, 3]})
    assert explorer.wait(60)
    assert panel.query == 3 and panel.selected[0] == n
    data = panel.view.data
    expected = tiny2.attention(PROMPT, queries=[3])
    np.testing.assert_allclose(
        np.array(data["strips"])[:, :, :4], expected.weights[..., 0, :4], atol=1e-6
    )
    assert data["pattern"]["layer"] == n and len(data["pattern"]["weights"]) == len(res.tokens)
    whole = tiny2.attention(PROMPT, layers=[n], heads=[panel.selected[1]])
    np.testing.assert_allclose(data["pattern"]["weights"], whole.weights[0, 0], atol=1e-6)
    # The bars: the selected layer's heads' contributions to the target, adding up to the
    # attribution's attention row there.
    bars = data["contributions"]
    att = explorer.attribution
    attn_row = att.values[att.components.index(f"attn {n}"), 0, 0]
    assert bars["layer"] == n and bars["target"] == att.target_tokens[0]
    np.testing.assert_allclose(
        sum(bars["values"]) + att.head_bias[n - 1, 0, 0], attn_row, atol=1e-4
    )
    # A click on another head (what the browser sends) draws that head's whole pattern.
    panel.view.set_state({"selected": [1, 2]})
    assert panel.wait(60)
    first = tiny2.attention(PROMPT, layers=[1], heads=[2])
    np.testing.assert_allclose(
        panel.view.data["pattern"]["weights"], first.weights[0, 0], atol=1e-6
    )
    assert panel.view.data["contributions"]["layer"] == 1


def test_attention_panel_shows_a_stored_result():
    from envoykit.explorer import AttentionPanel

    res = ek.AttentionResult.example()
    panel = AttentionPanel(res)
    assert panel.query == 1 and panel.selected == [1, 0]
    assert panel.view.data["pattern"]["weights"] == [[1.0, 0.0], [0.25, 0.75]]
    assert "attends to" in panel.header.value


@pytest.mark.engine
def test_select_and_pin_update_the_trajectory(explorer):
    res = explorer.run()
    assert res.tokens[-1] in explorer.trajectory_figure.axes[0].get_title()
    explorer.heatmap.set_state({"selected": [len(res.layers) - 1, 0]})
    assert repr(res.tokens[0]) in explorer.trajectory_figure.axes[0].get_title()
    before = explorer.trajectory.outputs

    new_id = next(int(i) for i in res.top_ids[-1, 0] if i not in res.target_ids)
    explorer.heatmap.set_state({"pinned": [new_id]})
    assert explorer.wait(60)
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
    explorer.targets.value = " Paris, ,"  # blank pieces (a trailing comma) are no targets
    assert "tokenizes to nothing" not in explorer.tokenization.value
    assert explorer.run().target_labels == (" Paris",)

    explorer.picker.set_state({"selected": []})
    assert explorer.run() is None
    assert "no layers picked" in explorer.message.value

    explorer.picker.set_state({"selected": [1, 2]})
    assert explorer.run() is not None
    assert explorer.message.value == ""


@pytest.mark.engine
def test_rows_set_from_code_outside_the_model_are_a_message(explorer, tiny2):
    explorer.picker.rows = [(-1, "resid"), (2, "resid")]
    assert explorer.run() is None
    assert "[-1] are not rows of this model" in explorer.message.value
    assert not explorer.run_button.disabled and "running" not in explorer.status.value
    explorer.picker.rows = [(tiny2.info.n_layers + 1, "resid")]
    assert explorer.run() is None and "are not rows" in explorer.message.value
    explorer.picker.rows = [(2, "resid")]
    assert explorer.run() is not None and explorer.message.value == ""


@pytest.mark.engine
def test_a_refused_run_marks_the_old_heatmap_and_a_new_run_clears_it(explorer):
    good = explorer.run()
    explorer.prompt.value = "   "
    assert explorer.run() is None
    assert explorer.heatmap.stale
    assert "still shows the previous run" in explorer.status.value
    assert explorer.result is good
    explorer.prompt.value = PROMPT
    assert explorer.run() is not None
    assert not explorer.heatmap.stale and explorer.message.value == ""


@pytest.mark.engine
def test_a_new_prompt_follows_its_own_last_position(explorer):
    explorer.run()
    explorer.heatmap.selected = [0, 1]
    explorer.run()  # the same prompt keeps the selection
    assert explorer.heatmap.selected == [0, 1]
    explorer.prompt.value = "The capital of Italy is in the south"
    explorer.run()
    assert explorer.heatmap.selected is None  # the trajectory follows the last position


@pytest.mark.engine
def test_a_target_of_several_tokens_is_a_warning_naming_what_is_measured(explorer, tiny2):
    explorer.targets.value = " Paris"  # ' ', 'Paris' on tiny's tokenizer
    tokens = describe_target(tiny2.tokenizer, " Paris")
    assert len(tokens) > 1
    shown = explorer.tokenization.value
    assert "--jp-warn-color1" in shown and f"{len(tokens)} tokens" in shown
    assert f"only <code>{html.escape(repr(tokens[0]))}</code> is measured" in shown


@pytest.mark.engine
def test_pins_are_chips_that_unpin_and_change_no_measured_token(explorer, tiny2):
    res = explorer.run()
    first = int(res.target_ids[0])
    token = int(res.top_ids[-1, -1, 1])
    panels = (explorer.attribution_panel.target, explorer.sweep_panel.target)
    assert [panel.chosen() for panel in panels] == [first, first]
    explorer.heatmap.pinned = [token]
    assert explorer.wait(60)
    assert token in explorer.result.target_ids.tolist()
    chips = [w for w in explorer.pins.children if isinstance(w, widgets.Button)]
    text = tiny2.tokenizer.decode([token])
    assert [c.description for c in chips] == [f"{text!r} ×"]
    # Offered in every panel that measures a token, measured by none until picked there.
    assert [panel.chosen() for panel in panels] == [first, first]
    for panel in panels:
        assert (f"{text!r} (pinned)", token) in panel.options
    chips[0].click()  # the chip goes with the click, before the lens without it is back
    assert not any(isinstance(w, widgets.Button) for w in explorer.pins.children)
    assert explorer.wait(60)
    assert explorer.heatmap.pinned == []
    assert token not in explorer.result.target_ids.tolist()  # the lens ran without it
    assert all(token not in [value for _, value in panel.options] for panel in panels)


@pytest.mark.engine
def test_an_error_envoykit_did_not_mean_shows_its_traceback_folded(explorer, tiny2, monkeypatch):
    """An error that is not one of envoykit's refusals (a bug, or a library's error let
    through, as nnsight raises a rank's failure) is no one-line message: Run says its line
    and keeps its traceback under a collapsed "details" (escaped), and the explorer stays
    usable. Called from a cell, the same error reaches the cell."""
    good = explorer.run()

    def failing(*args, **kwargs):
        raise RuntimeError("ValueError: <b>a failure</b> on every rank")

    monkeypatch.setattr(tiny2, "lens", failing)
    explorer.run_button.click()
    assert explorer.work.wait(60)
    shown = explorer.message.value
    assert "RuntimeError: ValueError: &lt;b&gt;a failure&lt;/b&gt; on every rank" in shown
    details = shown[shown.index("<details") :]
    assert "<summary>details</summary>" in details and "<b>" not in details
    assert "Traceback (most recent call last)" in details and "in failing" in details
    assert explorer.result is good and not explorer.run_button.disabled
    with pytest.raises(RuntimeError, match="a failure"):
        explorer.run()
    monkeypatch.undo()
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


@pytest.fixture
def comparing(tiny2):
    explorer = LensExplorer(tiny2, prompt=PROMPT, targets=[" Paris"], top_k=5, compare_with=OTHER)
    explorer.picker.rows = [(0, "resid"), (2, "attn"), (2, "resid"), (4, "resid")]
    return explorer


@pytest.mark.engine
def test_compare_mode_lenses_both_prompts_and_draws_their_diff(comparing, tiny2):
    titles = comparing.panels.titles
    assert titles[4:] == ("Steering", "Corpus", "Training")  # with an engine
    comparing.compare.value = False
    comparing.compare.value = True  # ticked: its tab opens, its hint goes
    assert titles[comparing.panels.selected_index] == "Compare"
    assert comparing.compare_hint.layout.display == "none"
    res = comparing.run()
    assert comparing.compare_box.layout.display is None
    other = comparing.other_result
    assert (other.prompt, other.layer_labels) == (OTHER, ["embed", "2.attn", "2", "4"])
    alone = tiny2.lens(
        OTHER, layers=[0, 2, 4], sites=["attn", "resid"], top_k=5, targets=[" Paris"]
    )
    np.testing.assert_array_equal(other.top_ids, rows.keep(alone, comparing.picker.rows).top_ids)
    assert comparing.compare_panel.source.data["layer_labels"] == other.layer_labels

    paris = int(res.target_ids[0])
    expected = tiny2.lens([PROMPT, OTHER], compare=True, layers=[0, 2, 4], targets=[paris])
    cmp = comparing.comparison
    assert cmp.layer_labels == ["embed", "2", "4"]
    np.testing.assert_allclose(cmp.js, expected.js, atol=1e-9)
    data = comparing.compare_panel.diff.data
    np.testing.assert_allclose(data["grids"]["js"]["values"], cmp.js, atol=1e-6)
    assert data["top_labels"] == ["first", "second"]
    differ = cmp.top_ids_a != cmp.top_ids_b
    assert differ.any()
    li, pi = np.argwhere(differ)[0]
    assert data["cell_text"][li][pi] == f"{cmp.top_token('a', li, pi)}→{cmp.top_token('b', li, pi)}"
    assert data["tokens"][3] == f"{cmp.tokens_a[3]}|{cmp.tokens_b[3]}"  # ' F' | ' I'

    # The metric menu drives the diff: a target's Δp, JS otherwise.
    assert comparing.compare_panel.diff.metric == "js"
    comparing.metric.value = " Paris"
    assert comparing.compare_panel.diff.metric == str(paris)
    assert comparing.compare_panel.source.metric == " Paris"
    np.testing.assert_allclose(
        comparing.compare_panel.diff.data["grids"][str(paris)]["values"],
        cmp.delta(paris),
        atol=1e-6,
    )
    comparing.metric.value = "entropy"
    assert comparing.compare_panel.diff.metric == "js"


@pytest.mark.engine
def test_a_drop_draws_the_patched_lens_and_its_diff(comparing, tiny2):
    res = comparing.run()
    clean = comparing.current  # the run shown: one frozen value, replaced whole
    with pytest.raises(dataclasses.FrozenInstanceError):
        clean.result = None  # type: ignore[misc]
    paris = int(res.target_ids[0])
    # Row "2" of the second prompt at ' I' (position 3), dropped on the first heatmap's top
    # row at position 3: the patch is layer 2's stream, whatever row it was dropped on.
    comparing.heatmap.set_state({"drop": {"source": [2, 3], "target": [3, 3]}})
    assert comparing.wait(60)
    assert comparing.heatmap.drop is None  # handled, ready for the next drop
    patch = ek.Patch(OTHER, 2, source_position=3, target_position=3, site="resid")
    assert comparing.patch == patch == comparing.current.patch
    assert clean.patch is None and clean.result is res  # the clean run is as it was
    # The second prompt's lens is the clean run's (its request is unchanged), not lensed again.
    assert comparing.current.other_result is clean.other_result
    assert comparing.current.rows == clean.rows and "patched" in comparing.current.label
    patched = comparing.result
    assert [dict(p) for p in patched.meta["patches"]] == [dataclasses.asdict(patch)]
    expected = tiny2.lens(
        PROMPT, layers=[0, 2, 4], sites=["attn", "resid"], top_k=5, targets=[" Paris"], patch=patch
    )
    np.testing.assert_array_equal(
        patched.top_ids, rows.keep(expected, comparing.picker.rows).top_ids
    )
    assert not np.array_equal(patched.top_probs, res.top_probs)
    assert comparing.heatmap.data["marks"] == [[2, 3]]
    note = html.unescape(comparing.patch_note.value)
    assert "row 2 of 'The capital of Italy is' at position 3 (' I') → position 3 (' F')" in note
    assert "patched" in comparing.status.value

    # The diff is now the first run against its patched run: nothing changes before the
    # patched layer, nor at earlier positions.
    cmp = comparing.comparison
    assert comparing.compare_panel.diff.data["top_labels"] == ["clean", "patched"]
    assert float(cmp.js[0].max()) < 1e-12 and float(cmp.js[:, :3].max()) < 1e-12
    assert float(cmp.js[1, 3]) > 1e-6
    again = ek.compare((tiny2, PROMPT), (tiny2, PROMPT, patch), layers=[0, 2, 4], targets=[paris])
    np.testing.assert_allclose(cmp.js, again.js, atol=1e-9)

    # Attribution does not pretend to explain the patched run.
    comparing.heatmap.set_state({"selected": [3, 6]})
    assert comparing.attribution is None
    assert "patched run" in comparing.attribution_panel.header.value
    assert "patched run" in comparing.attention_panel.header.value

    # A sub-layer row: the patch copies that block's write.
    comparing.heatmap.set_state({"drop": {"source": [1, 3], "target": [0, 4]}})
    assert comparing.wait(60)
    assert comparing.patch == ek.Patch(OTHER, 2, source_position=3, target_position=4, site="attn")

    # Run goes back to the unpatched lens and the diff of the two prompts; every panel
    # under the selected cell follows it, no notice of the patched run left.
    comparing.run()
    assert comparing.wait(60)
    assert comparing.patch is None and "patches" not in comparing.result.meta
    position = int(comparing.result.positions[comparing.heatmap.selected[1]])
    assert comparing.attribution.positions.tolist() == [position]
    assert comparing.attention_panel.query == position
    for panel in (comparing.attribution_panel, comparing.attention_panel):
        assert "patched" not in panel.header.value
    assert comparing.heatmap.data["marks"] == [] and comparing.patch_note.value == ""
    assert comparing.compare_panel.diff.data["top_labels"] == ["first", "second"]

    # Unticked, Run compares nothing and the panel is hidden and empty.
    comparing.compare.value = False
    assert comparing.compare_box.layout.display == "none"
    comparing.run()
    assert (comparing.other_result, comparing.comparison) == (None, None)
    assert comparing.compare_panel.source.data == {} and comparing.compare_panel.diff.data == {}


@pytest.mark.engine
def test_sweep_button_draws_the_map_with_progress(comparing, tiny2):
    res = comparing.run()
    paris = int(res.target_ids[0])
    comparing.sweep_panel.button.click()  # sweeps on a thread of its own
    assert comparing.sweep_panel.wait(120)
    sweep = comparing.sweep
    assert (sweep.source, sweep.target) == (OTHER, PROMPT)
    assert sweep.values.shape == (3, 7) and sweep.layers.tolist() == [0, 2, 4]
    assert (comparing.sweep_panel.progress.value, comparing.sweep_panel.progress.max) == (3, 3)
    expected = tiny2.patch_sweep(
        OTHER, PROMPT, layers=[0, 2, 4], target_token=paris, progress=False
    )
    np.testing.assert_allclose(sweep.values, expected.values, rtol=1e-5, atol=1e-7)
    assert (sweep.clean, sweep.source_value) == pytest.approx(
        (expected.clean, expected.source_value)
    )
    assert comparing.sweep_figure.axes[0].images
    assert comparing.sweep_panel.view.outputs[0]["data"]["image/png"]
    assert not comparing.sweep_panel.button.disabled
    assert "took" in comparing.sweep_panel.header.value

    # Picking a pinned token in the sweep panel sweeps again, measuring it.
    token = next(int(i) for i in res.top_ids[-1, -1] if i != paris)
    comparing.heatmap.pinned = [token]
    assert comparing.wait(60) and comparing.sweep is sweep  # the pin swept nothing
    comparing.sweep_panel.target.value = token
    assert comparing.sweep_panel.wait(120)
    again = tiny2.patch_sweep(OTHER, PROMPT, layers=[0, 2, 4], target_token=token, progress=False)
    assert comparing.sweep.target_token == again.target_token != sweep.target_token
    np.testing.assert_allclose(comparing.sweep.values, again.values, rtol=1e-5, atol=1e-7)


@pytest.mark.engine
def test_click_to_patch_equals_the_drop(comparing):
    comparing.run()
    panel = comparing.compare_panel
    assert panel.patch_button.disabled  # nothing selected to patch yet
    panel.source.selected = [2, 3]
    assert not panel.patch_button.disabled
    panel.patch_button.click()  # no column picked in the first heatmap: the same position
    assert comparing.wait(60)
    assert comparing.patch == ek.Patch(OTHER, 2, source_position=3, target_position=3)
    comparing.heatmap.selected = [0, 5]
    panel.patch_button.click()
    assert comparing.wait(60)
    assert comparing.patch == ek.Patch(OTHER, 2, source_position=3, target_position=5)


@pytest.mark.engine
def test_the_export_of_a_patched_run_says_so_and_carries_every_panel(comparing, tmp_path):
    comparing.run()
    comparing.heatmap.set_state({"drop": {"source": [2, 3], "target": [3, 3]}})
    assert comparing.wait(60)
    assert "logit lens, patched (layer 2 resid)" in comparing.status.value
    page = comparing.export(tmp_path / "patched.html").read_text()
    assert "<h3>Logit lens, patched (layer 2 resid) of" in page
    titles = re.findall(r'<section class="ek-panel"><h4>([^<]*)</h4>', page)
    assert titles[0].startswith("diff: ") and "trajectory" in titles
    assert "direct logit attribution" not in titles  # a patched run shows none
    assert page.count('class="ek-figure-light"') == len(titles)  # and one per theme each
    assert page.count("data:image/png;base64,") == 2 * len(titles)


@pytest.mark.engine
def test_a_sweep_refused_before_it_starts_gives_the_button_back(explorer):
    explorer.sweep_panel.button.click()  # no compare run yet
    assert explorer.sweep_panel.wait(60)
    assert "Run in compare mode first" in explorer.sweep_panel.header.value
    assert not explorer.sweep_panel.button.disabled


@pytest.mark.engine
def test_cancel_stops_the_sweep_and_leaves_the_engine_usable(comparing, tiny2):
    comparing.run()
    panel = comparing.sweep_panel
    said: list[str] = []
    panel.header.observe(lambda change: said.append(change["new"]), "value")
    panel.button.click()
    assert panel.button.disabled and not panel.cancel_button.disabled
    panel.cancel_button.click()  # heard while the sweep runs: the kernel is not blocked
    assert panel.wait(120)
    assert panel.result is None and "cancelled after" in panel.header.value
    assert re.search(r"row 1 of \d+; \d+ s so far", said[0]), said[0]
    assert panel.progress.value < panel.progress.max
    assert not panel.button.disabled and panel.cancel_button.disabled
    assert comparing.run() is not None  # the engine answers
    panel.button.click()  # and the next sweep is not cancelled by the last Cancel
    assert panel.wait(120) and panel.result is not None


@pytest.mark.engine
def test_cancel_stops_a_run_and_says_so(explorer, tiny2):
    """Cancel while Run's lens is on the ranks: the explorer says it was cancelled, gives the
    buttons back, and the next Run draws."""
    explorer.prompt.value = "The capital of France is " * 32
    explorer.run_button.click()
    while explorer.work.busy and tiny2._lenses_in_flight.key(explorer.work.thread) is None:
        time.sleep(0.001)
    assert explorer.run_button.disabled and not explorer.cancel_button.disabled
    explorer.cancel_button.click()  # heard while the lens runs: the kernel is not blocked
    assert explorer.work.wait(120)
    assert "cancelled" in explorer.message.value and explorer.result is None
    assert not explorer.run_button.disabled and explorer.cancel_button.disabled
    explorer.prompt.value = PROMPT
    assert explorer.run() is not None and explorer.result.prompt == PROMPT
    # A Cancel heard once the lens is done, while its thread still draws it (here a job
    # that marks itself drawing and holds the thread), has nothing to stop and leaves the
    # status as it is.
    status = explorer.status.value
    release = threading.Event()
    explorer.work.submit(lambda: (explorer._drawing.set(), release.wait()))
    while not explorer._drawing.is_set():
        time.sleep(0.001)
    assert explorer.cancel() is False and explorer.status.value == status
    release.set()
    assert explorer.work.wait(30)
    explorer._drawing.clear()


@pytest.mark.engine
def test_cancel_stops_the_explorers_lens_not_a_cells(explorer, tiny2):
    """A cell's lens holds the ranks while Run waits for them, and Cancel is pressed at once:
    the Run's lens is stopped, the cell's lens returns what it returns alone, and once the
    Run has ended nothing is left to cancel a lens started later."""
    long = "The capital of France is " * 32
    expected = tiny2.lens(long, top_k=3)
    box: dict = {}
    cell = threading.Thread(target=lambda: box.update(result=tiny2.lens(long, top_k=3)))
    cell.start()
    while cell.is_alive() and tiny2._lenses_in_flight.key(cell) is None:
        time.sleep(0.001)
    explorer.prompt.value = long
    explorer.run_button.click()
    explorer.cancel_button.click()
    assert explorer.work.wait(120)
    cell.join(120)
    assert "cancelled" in explorer.message.value and explorer.result is None
    np.testing.assert_array_equal(box["result"].top_ids, expected.top_ids)
    np.testing.assert_allclose(box["result"].top_probs, expected.top_probs, atol=1e-6)
    later = tiny2.lens(long, top_k=3)  # not cancelled by a canceller left behind
    np.testing.assert_array_equal(later.top_ids, expected.top_ids)


@pytest.mark.engine
def test_a_pin_during_a_run_draws_that_runs_lens_with_the_pin(explorer, tiny2):
    """A token pinned while a Run's lens is in flight does not run a lens of its own beside
    it (nor on the kernel's thread): once the Run is drawn, the lens runs again on the Run's
    request with the pin added, and that is what is shown."""
    first = explorer.run()
    token = next(int(i) for i in first.top_ids[-1, -1] if i not in first.target_ids)
    explorer.prompt.value = OTHER
    explorer.run_button.click()
    assert explorer.work.busy  # the Run is on its thread when the pin arrives
    explorer.heatmap.pinned = [token]
    assert explorer.wait(120)
    shown = explorer.result
    assert shown.prompt == OTHER and shown.target_ids.tolist() == [int(first.target_ids[0]), token]
    layers, sites = rows.lens_arguments(explorer.picker.rows)
    alone = tiny2.lens(OTHER, layers=layers, sites=sites, top_k=5, targets=[" Paris", token])
    alone = rows.keep(alone, explorer.picker.rows)
    np.testing.assert_array_equal(shown.top_ids, alone.top_ids)
    np.testing.assert_allclose(shown.target(token).prob, alone.target(token).prob, atol=1e-6)
    assert explorer.message.value == "" and not explorer.run_button.disabled


@pytest.mark.engine
def test_quick_cell_clicks_draw_the_last_and_skip_those_between(explorer, tiny2, monkeypatch):
    """Cell clicks ask the engine on the cells' thread, never the kernel's: clicks made while
    one attribution runs keep only the latest, which is what the panel ends up showing."""
    res = explorer.run()
    assert explorer.wait(60)
    asked: list[int] = []
    release = threading.Event()
    attribute = tiny2.attribute

    def gated(prompt, targets, *, positions, **kwargs):  # the real attribution, held back
        asked.append(positions[0])
        release.wait(60)
        return attribute(prompt, targets, positions=positions, **kwargs)

    monkeypatch.setattr(tiny2, "attribute", gated)
    top = len(res.layers) - 1
    for position in range(4):
        explorer.heatmap.selected = [top, position]  # returns at once: the kernel is free
    deadline = time.monotonic() + 60
    while not asked and time.monotonic() < deadline:  # the first click's job has begun
        time.sleep(0.01)
    assert asked == [0] and explorer.cells.busy
    release.set()
    assert explorer.wait(120)
    assert asked == [0, 3]  # positions 1 and 2 were replaced before they ran
    att = explorer.attribution
    expected = attribute(PROMPT, [int(res.target_ids[0])], positions=[3])
    assert att.positions.tolist() == [3]
    np.testing.assert_allclose(att.values, expected.values, rtol=1e-5, atol=1e-5)
    assert explorer.attention_panel.query == 3


@pytest.mark.engine
def test_training_panel_offers_the_tuned_lens_and_cancel_keeps_the_best_so_far(explorer):
    """Train within a budget from the page: the bar fills, the lens menu offers the result,
    and the header says how it did. With a long budget, Cancel ends it within its piece of
    work in flight, long before the budget, and still offers the best translators so far."""
    panel = explorer.training_panel
    assert explorer.translator is None and explorer.lens_kind.layout.display == "none"
    panel.seconds.value = 3
    began = time.monotonic()
    assert panel.start() and panel.wait(120)
    tuned = panel.tuned
    assert tuned is not None and explorer.translator is tuned
    assert explorer.lens_kind.layout.display is None  # the menu offers it
    assert re.search(r"\d+ steps in \d+ s: closer to the final distribution", panel.header.value)
    assert panel.progress.value == panel.progress.max == 3
    assert time.monotonic() - began < 3 + 30  # the budget, and the set-up before it
    assert not tuned.model.get("stopped")
    explorer.lens_kind.value = "tuned"
    assert explorer.run().meta["lens"] == "tuned"

    panel.seconds.value = 600
    said: list[str] = []
    panel.header.observe(lambda change: said.append(change["new"]), "value")
    began = time.monotonic()
    assert panel.start()
    while not any("training:" in line for line in said):
        time.sleep(0.05)
    assert panel.button.disabled and not panel.cancel_button.disabled
    panel.cancel_button.click()  # heard while it trains: the kernel is not blocked
    assert panel.wait(120) and time.monotonic() - began < 120
    assert panel.tuned is not tuned and panel.tuned.model["stopped"]
    assert explorer.translator is panel.tuned
    assert "cancelled after" in panel.header.value and "Traceback" not in panel.header.value
    assert not panel.button.disabled and panel.cancel_button.disabled


@pytest.mark.engine
def test_prompts_of_different_lengths_still_patch(comparing):
    comparing.other_prompt.value = "The capital of Spain is"  # 6 tokens on tiny, not 7
    assert comparing.run() is not None
    assert comparing.comparison is None
    assert "as many tokens" in comparing.compare_panel.diff_header.value
    # A drop still patches (a patch has a position in each prompt), and says why no diff.
    comparing.heatmap.set_state({"drop": {"source": [3, 5], "target": [3, 6]}})
    assert comparing.wait(60)
    assert comparing.patch.source_position == 5 and comparing.patch.target_position == 6
    assert comparing.comparison is not None  # the run against its patched run
    assert comparing.run_sweep() is None
    assert "as many tokens" in comparing.sweep_panel.header.value


@pytest.mark.engine
def test_lens_selector_applies_the_tuned_lens(tiny2):
    from envoykit.analyses.tuned import offline_texts

    tuned = ek.TunedLens.train(tiny2, offline_texts()[0], steps=2, progress=False)
    plain = LensExplorer(tiny2, prompt="The capital of France is")
    assert plain.lens_kind.layout.display == "none"  # no translators, no selector
    explorer = LensExplorer(tiny2, prompt="The capital of France is", translator=tuned)
    assert explorer.lens_kind.layout.display is None
    assert explorer.run().meta["lens"] == "logit"
    explorer.lens_kind.value = "tuned"
    res = explorer.run()
    assert res.meta["lens"] == "tuned"
    expected = tiny2.lens("The capital of France is", layers=res.layers.tolist(), translator=tuned)
    np.testing.assert_array_equal(res.top_ids, expected.top_ids)


def test_panel_figures_come_in_both_themes_inks():
    """A panel's figure travels as two PNGs with no background, one per theme: its
    default-coloured text and black lines dark in the light one and light in the dark one,
    a colour set on purpose and text written in the data kept in both; the HTML shows the
    light one unless the page's style sheet says the theme is dark."""
    import base64
    import io

    import numpy as np
    from matplotlib.figure import Figure
    from PIL import Image

    from envoykit.explorer.outputs import INK, figure_output

    ax = Figure(figsize=(3, 2)).subplots()
    ax.plot([0, 1], [0, 1], label="a line", color="tab:blue")
    ax.set_title("title " + "█" * 20)  # a block of ink to read back
    ax.legend()
    kept = ax.text(0.5, 0.5, "white on purpose", color="white")
    on_a_cell = ax.text(0.2, 0.2, "written on a cell")  # data text keeps its colour
    total = ax.axhline(0.5, color="k", linestyle=":")  # a black line is inked
    data = figure_output(ax.figure, "figure <b>")["data"]
    page = data["text/html"]
    light, dark = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert light == data["image/png"] and light != dark
    assert re.search(r'class="ek-figure-dark"[^>]*style="display:none"', page)
    assert 'alt="figure &lt;b&gt;"' in page and "<b>" not in page

    def inked(png: str) -> float:
        """The mean brightness of the figure's most opaque pixels (its ink)."""
        rgba = np.asarray(Image.open(io.BytesIO(base64.b64decode(png))).convert("RGBA"))
        assert rgba[0, 0, 3] == 0  # the corner shows the page through
        ink = rgba[rgba[..., 3] > 250][:, :3]
        return float(ink.mean())

    assert inked(light) < 100 < 150 < inked(dark)
    again = figure_output(ax.figure, "figure <b>")["data"]  # the export draws it again
    assert (again["image/png"], again["text/html"]) == (light, page)
    assert ax.title.get_color() == INK["dark"] and kept.get_color() == "white"
    assert ax.get_legend().get_texts()[0].get_color() == INK["dark"]
    assert total.get_color() == INK["dark"] and on_a_cell.get_color() == "black"


def test_panel_figure_lines_read_at_4_5_to_1_in_both_themes():
    """A line of its own colour (a trajectory, its dashed rank line) keeps its hue but is
    drawn, in each theme's PNG, at a contrast of at least 4.5:1 against that theme's
    paper: tab:blue is 4.1:1 on JupyterLab Dark's, tab:orange 2.6:1 on white. The figure
    keeps its own colours for pyplot and exports."""
    from matplotlib.figure import Figure

    from envoykit.explorer.outputs import PAPER, contrast, figure_output

    ax = Figure(figsize=(3, 2)).subplots()
    hues = [f"C{i}" for i in range(10)]
    for hue in hues:
        ax.plot([0, 1], [0, 1], color=hue, label=hue)
        ax.plot([0, 1], [1, 0], color=hue, linestyle="--")  # the rank line
    ax.legend()
    drawn: list[list[tuple]] = []
    save = ax.figure.savefig

    def recording(*args, **kwargs):  # what each theme's PNG is drawn with
        drawn.append([line.get_color() for line in ax.get_lines()])
        return save(*args, **kwargs)

    ax.figure.savefig = recording
    figure_output(ax.figure, "lines")
    assert len(drawn) == 2
    assert min(contrast(c, PAPER["light"]) for c in drawn[0]) >= 4.5
    assert min(contrast(c, PAPER["dark"]) for c in drawn[1]) >= 4.5
    assert contrast("C0", PAPER["dark"]) < 4.5 and contrast("C1", PAPER["light"]) < 4.5
    assert [line.get_color() for line in ax.get_lines()] == [h for h in hues for _ in (0, 1)]


def test_diff_cells_are_as_wide_as_their_text():
    from envoykit.explorer.payload import cell_width

    assert cell_width([["a", "b"]]) == 52  # a lens's width at least
    assert cell_width([[" Paris→ London"]]) == round(len(" Paris→ London") * 6.2 + 8)
    assert cell_width([["x" * 200]]) == 160  # cut there, whole in the tooltip


def test_colour_controls_set_the_heatmaps_limits_and_the_export(tmp_path):
    explorer = LensExplorer(ek.LensResult.example())
    explorer.colour_min.value = "0.2"
    explorer.colour_max.value = "0.9"
    explorer.colour_scale.value = "log"
    assert explorer.heatmap.limits == {"vmin": 0.2, "vmax": 0.9, "log": True}
    explorer.colour_max.value = "0.1"  # not above the minimum: refused, nothing changed
    assert "is not below the maximum" in explorer.message.value
    assert explorer.heatmap.limits["vmax"] == 0.9
    explorer.colour_max.value = "lots"
    assert "'lots' is not a number" in html.unescape(explorer.message.value)
    explorer.colour_max.value = ""  # blank: the metric's own
    assert explorer.heatmap.limits == {"vmin": 0.2, "vmax": None, "log": True}
    assert explorer.message.value == ""
    page = explorer.export(tmp_path / "lens.html").read_text()
    assert '"limits": {"vmin": 0.2, "vmax": null, "log": true}' in page
    figure = plot.heatmap(ek.LensResult.example(), vmin=0.2, log=True)
    norm = figure.axes[0].get_images()[0].norm
    assert type(norm).__name__ == "LogNorm" and norm.vmin == pytest.approx(0.2)
    with pytest.raises(traitlets.TraitError, match="limits are"):
        explorer.heatmap.limits = {"vmin": "low"}


# -- the Features panel ---------------------------------------------------------------------

FEATURE_SAE = "saelens_jumprelu"  # layer 3 "resid": clamps act on it
# A clamp that changes tiny's first greedy token after PROMPT for its top feature at the
# last token (the test checks it on the engine itself).
BIG_CLAMP = 300.0


class Tags(HTMLParser):
    """The elements of a piece of markup with a given class: each one's attributes and its
    text, as a browser would show them."""

    def __init__(self, markup: str, class_name: str) -> None:
        super().__init__()
        self.class_name, self.found = class_name, []
        self._open: list[int | None] = []  # per open tag: its index in `found`, or None
        self.feed(markup)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attrs = dict(attrs)
        found = self.class_name in (attrs.get("class") or "").split()
        if found:
            self.found.append({**attrs, "text": ""})
        self._open.append(len(self.found) - 1 if found else None)

    def handle_endtag(self, tag: str) -> None:
        self._open.pop()

    def handle_data(self, data: str) -> None:
        for index in self._open:
            if index is not None:
                self.found[index]["text"] += data


def tags(markup: str, class_name: str) -> list[dict[str, str]]:
    return Tags(markup, class_name).found


def hostile_features() -> ek.FeatureResult:
    """Three tokens of markup, a space and a newline, each with two features."""
    tokens = (XSS_IMG, " ", "\n")
    return ek.FeatureResult(
        prompt="".join(tokens),
        tokens=tokens,
        token_ids=np.arange(3),
        top_ids=np.array([[4, 9], [9, -1], [2, 4]]),
        top_acts=np.array([[3.0, 1.0], [2.0, 0.0], [0.5, 0.25]], dtype=np.float32),
        l0=np.array([2, 1, 2]),
        sq_error=np.zeros(3, dtype=np.float32),
        sq_centered=np.ones(3, dtype=np.float32),
        d_model=8,
    )


def test_feature_text_is_escaped_and_whitespace_stays_visible():
    res = hostile_features()
    data = chips_data(res)
    assert data["tokens"] == [XSS_IMG, " ", "\n"]
    marked = XSS_IMG.replace(" ", "␣")  # text for the page's text nodes, whitespace marked
    assert data["labels"] == [marked, "␣", "↵"]
    assert data["chips"] == [[[4, 3.0], [9, 1.0]], [[9, 2.0]], [[2, 0.5], [4, 0.25]]]
    assert data["top"] == 3.0
    assert token_label("") == "∅" and token_label("  ") == "␣␣" and token_label("\xa0") == "\\xa0"
    assert token_label(" \t") == "␣⇥"
    row = token_row(res.tokens, [3.0, 1.5, 0.0], top=3.0, focus=1)
    effects = {"up": [(XSS_IMG, 2.0)], "down": [(XSS_SCRIPT, -1.0)]}
    context = Context(0, 1, 1.5, res.tokens, (0, 1, 2), (3.0, 1.5, 0.0), 1)
    shown = [
        row,
        logits_html(4, effects),
        contexts_html(4, [context]),
        continuation_html(XSS_IMG, XSS_SCRIPT, XSS_IMG),
    ]
    for markup in shown:
        assert "<img" not in markup and "<script" not in markup and "&lt;" in markup
    spans = tags(row, "ek-feat-tok")
    assert [span["text"] for span in spans] == [marked, "␣", "↵"]
    assert [float(span["data-act"]) for span in spans] == [3.0, 1.5, 0.0]
    assert "ek-feat-strong" in spans[0]["class"] and "ek-feat-focus" in spans[1]["class"]
    logits = tags(shown[1], "ek-feat-logit")
    assert [json.loads(item["data-token"]) for item in logits] == [XSS_IMG, XSS_SCRIPT]


@pytest.fixture
def feature_panel(tiny1):
    return FeaturesPanel(tiny1, load_sae(FEATURE_SAE), prompt=PROMPT, clamp=BIG_CLAMP)


@pytest.mark.engine
def test_feature_chips_are_the_features_read(feature_panel, tiny1):
    res = feature_panel.read()
    expected = tiny1.features(PROMPT, load_sae(FEATURE_SAE), top_k=8)
    np.testing.assert_array_equal(res.top_ids, expected.top_ids)
    data = feature_panel.chips.get_state()["data"]
    assert data["tokens"] == list(expected.tokens)
    assert data["l0"] == expected.l0.tolist()
    for chips, ids, acts in zip(data["chips"], expected.top_ids, expected.top_acts):
        fired = ids >= 0
        assert [f for f, _ in chips] == ids[fired].tolist()
        np.testing.assert_allclose([a for _, a in chips], acts[fired], rtol=1e-6)
    assert feature_panel.clamp.max >= 10 * data["top"]  # clamps past what fires
    assert "mean L0" in feature_panel.header.value


@pytest.mark.engine
def test_selecting_a_feature_shows_its_activation_and_logit_effects(feature_panel, tiny1):
    """A click on a chip (the browser sets ``selected``): the feature's exact activation at
    every token and its logit effects; typing an id selects as a click does."""
    sae = load_sae(FEATURE_SAE)
    res = feature_panel.read()
    feature = int(res.top_ids[-1, 0])
    feature_panel.chips.set_state({"selected": feature})
    expected = tiny1.features(PROMPT, sae, features=[feature]).activation(feature)
    np.testing.assert_allclose(feature_panel.activation, expected, rtol=1e-6)
    row = tags(feature_panel.activation_view.value, "ek-feat-tok")
    assert [span["text"] for span in row] == [token_label(t) for t in res.tokens]
    np.testing.assert_allclose([float(span["data-act"]) for span in row], expected, rtol=1e-6)
    effects = tiny1.feature_logits(sae, [feature], k=10).of(feature)
    logits = feature_panel.logits_view.value
    for side in ("up", "down"):
        shown = tags(logits, f"ek-feat-{side}")
        assert len(shown) == 1
    items = tags(logits, "ek-feat-logit")
    assert [json.loads(item["data-token"]) for item in items] == [
        token for side in ("up", "down") for token, _ in effects[side]
    ]
    np.testing.assert_allclose(
        [float(item["data-logit"]) for item in items],
        [logit for side in ("up", "down") for _, logit in effects[side]],
        rtol=1e-6,
    )
    assert feature_panel.feature.value == str(feature) and feature_panel.selected == feature

    other = int(res.top_ids[0, 1])
    feature_panel.feature.value = str(other)  # typed, then Enter
    assert feature_panel.selected == other and feature_panel.chips.selected == other
    expected = tiny1.features(PROMPT, sae, features=[other]).activation(other)
    np.testing.assert_allclose(feature_panel.activation, expected, rtol=1e-6)


@pytest.mark.engine
def test_a_clamped_feature_regenerates_beside_the_plain_continuation(feature_panel, tiny1):
    """Generate clamped, clicked: off the kernel's thread, the continuation of
    ``engine.generate`` with the same `ek.Clamp`, its first token unlike the plain one's."""
    sae = load_sae(FEATURE_SAE)
    res = feature_panel.read()
    feature = int(res.top_ids[-1, 0])
    assert feature_panel.generate() is None  # nothing selected yet: a message
    assert "click a feature first" in feature_panel.header.value
    feature_panel.chips.set_state({"selected": feature})
    feature_panel.max_tokens.value = 4
    feature_panel.clamp_button.click()
    assert feature_panel.work.wait(120) and not feature_panel.clamp_button.disabled
    clamped = tiny1.generate(PROMPT, 4, steer=ek.Clamp(sae, feature, BIG_CLAMP))
    plain = tiny1.generate(PROMPT, 4)
    assert feature_panel.clamped.token_ids == clamped.token_ids
    assert feature_panel.plain.token_ids == plain.token_ids
    assert clamped.token_ids[0] != plain.token_ids[0]  # the clamp changes the next token
    texts = [
        tags(view.value, "ek-continuation-text")[0]["text"]
        for view in (feature_panel.plain_view, feature_panel.clamped_view)
    ]
    assert texts == [visible(str(plain)), visible(str(clamped))]
    assert f"clamped to {BIG_CLAMP:g}" in feature_panel.clamped_view.value
    assert "unlike the plain continuation" in feature_panel.header.value


@pytest.mark.engine
def test_feature_stats_show_contexts_and_a_histogram(tiny1):
    sae = load_sae(FEATURE_SAE)
    documents = [PROMPT, OTHER, "Hello world, this is a test.", f"Tokens {XSS_IMG} as text"]
    feature = int(tiny1.features(PROMPT, sae, top_k=1).top_ids[-1, 0])
    stats = tiny1.feature_stats(documents, sae, contexts=3, window=7, progress=False)
    panel = FeaturesPanel(tiny1, sae, prompt=PROMPT, stats=stats)
    panel.read()
    panel.select(feature)
    contexts = stats.contexts(feature)
    assert contexts
    shown = tags(panel.contexts_view.value, "ek-feat-context")
    assert [(int(c["data-document"]), int(c["data-position"])) for c in shown] == [
        (item.document, item.position) for item in contexts
    ]
    focus = tags(panel.contexts_view.value, "ek-feat-focus")
    assert [span["text"] for span in focus] == [token_label(c.tokens[c.focus]) for c in contexts]
    np.testing.assert_allclose(
        [float(span["data-act"]) for span in focus], [c.activation for c in contexts]
    )
    spans = tags(panel.contexts_view.value, "ek-feat-tok")
    assert len(spans) == sum(len(c.tokens) for c in contexts)
    assert "<img" not in panel.contexts_view.value
    edges, counts = stats.histogram(feature)
    (stairs,) = panel.histogram_figure.axes[0].patches
    np.testing.assert_array_equal(stairs.get_data().values, counts)
    np.testing.assert_array_equal(stairs.get_data().edges, edges)
    assert panel.histogram_view.outputs[0]["data"]["text/html"].count("<img") == 2  # 2 themes
    assert "contexts shown" in panel.header.value


@pytest.mark.engine
def test_feature_panel_refuses_bad_input_with_a_message(feature_panel, tiny1):
    import torch

    wide = ek.SAE(
        "relu", torch.zeros(576, 8), torch.zeros(8), torch.zeros(8, 576), torch.zeros(576), layer=1
    )
    other = FeaturesPanel(tiny1, wide, prompt=PROMPT)
    assert "d_model=128" in other.header.value and "Traceback" not in other.header.value
    assert other.read_button.disabled and other.clamp_button.disabled
    assert other.read() is None and other.select(3) is None and other.generate() is None
    assert "d_model=128" in other.header.value
    not_an_sae = FeaturesPanel(tiny1, "sae/")
    assert "takes an ek.SAE" in not_an_sae.header.value
    not_an_sae.chips.set_state({"selected": 3})  # a message, not an error in the observer
    assert "takes an ek.SAE" in not_an_sae.header.value

    feature_panel.read()
    feature_panel.select(3)
    assert feature_panel.select(256) is None  # the SAE has 256 features
    assert "feature 256 is out of range" in feature_panel.header.value
    assert feature_panel.selected is None and feature_panel.activation_view.value == ""
    assert feature_panel.chips.selected is None
    feature_panel.feature.value = XSS_IMG
    assert "is an integer id" in feature_panel.header.value
    assert "<img" not in feature_panel.header.value
    feature_panel.prompt.value = ""
    assert feature_panel.read() is None and "empty" in feature_panel.header.value
    feature_panel.prompt.value = f"The {XSS_IMG} is"  # markup in the prompt: text
    res = feature_panel.read()
    assert res is not None and feature_panel.select(int(res.top_ids[0, 0])) is not None
    for view in (feature_panel.activation_view, feature_panel.logits_view, feature_panel.header):
        assert "<img" not in view.value


@pytest.mark.engine
def test_explorer_with_an_sae_has_the_features_panel_on_its_prompt(tiny1):
    assert LensExplorer(tiny1, prompt=PROMPT).features_panel is None
    explorer = LensExplorer(tiny1, prompt=PROMPT, sae=load_sae(FEATURE_SAE))
    panel = explorer.features_panel
    assert panel in explorer.panels.children and panel.prompt.layout.display == "none"
    explorer.prompt.value = OTHER
    assert panel.read().prompt == OTHER
