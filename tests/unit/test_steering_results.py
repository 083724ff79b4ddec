"""Steering without an engine: the addition on a stream, the results, the figure."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import envoykit as ek
from envoykit.analyses.steering import check_vector, plan_additions
from envoykit.model.readout import Addition, Cell


def test_addition_on_a_pair_is_the_sum_steered_and_a_zero_residual():
    hidden, residual = torch.randn(5, 8), torch.randn(5, 8)
    stream = hidden + residual
    vector = torch.randn(8)
    Addition(Cell(1, "resid", None), vector, positions=(1, 3)).apply(hidden, residual)
    np.testing.assert_allclose(hidden + residual, stream + vector * torch.tensor(
        [0, 1, 0, 1, 0]
    ).unsqueeze(1).float(), atol=1e-6)  # fmt: skip
    assert torch.equal(residual[[1, 3]], torch.zeros(2, 8))


def test_norm_match_keeps_each_rows_norm():
    stream = torch.randn(4, 16)
    before = stream.norm(dim=-1)
    Addition(Cell(1, "resid", None), torch.randn(16) * 10, norm_match=True).apply(stream, None)
    np.testing.assert_allclose(stream.norm(dim=-1), before, rtol=1e-6)


def test_a_bfloat16_stream_is_steered_in_float32_and_keeps_its_dtype():
    stream = torch.randn(3, 8).bfloat16()
    expected = (stream.float() + 0.5).bfloat16()
    Addition(Cell(1, "resid", None), torch.full((8,), 0.5)).apply(stream, None)
    assert stream.dtype == torch.bfloat16 and torch.equal(stream, expected)


def test_steers_are_checked_before_anything_runs():
    (addition,) = plan_additions([ek.Steer(np.ones(4), -1, scale=2, positions=[-1])], 3, 4, 5)
    assert addition.cell.layer == 3 and addition.positions == (4,)
    assert torch.equal(addition.vector, torch.full((4,), 2.0))
    with pytest.raises(ek.InvalidRequest, match="float"):
        check_vector(np.ones(4, dtype=np.int32), 4)
    with pytest.raises(ek.InvalidRequest, match="embedding"):
        plan_additions([ek.Steer(np.ones(4), 0, site="resid_mid")], 3, 4, 5)


def test_sweep_result_round_trips_and_exports():
    res = ek.SteerSweepResult.example()
    again = ek.SteerSweepResult.from_json(res.to_json())
    np.testing.assert_array_equal(again.target_probs, res.target_probs)
    assert again.texts == res.texts and again.token_ids == res.token_ids
    frame = res.to_pandas()
    assert len(frame) == 3 * 2 and set(frame.scale) == {-4.0, 0.0, 4.0}
    assert res.target(" great").shape == (3, 2)
    with pytest.raises(KeyError, match="was not swept"):
        res.text(1.0)
    with pytest.raises(ValueError, match="probabilities"):
        ek.SteerSweepResult(**{**res.to_dict(), "target_probs": [[[2.0]] * 2] * 3})


def test_steering_vector_saves_with_its_model(tmp_path):
    vector = ek.SteeringVector(
        vector=np.arange(4, dtype=np.float32), layer=2, site="resid", position=-1,
        positive=["a"], negative=["b"], model={"name": "m", "d_model": 4},
    )  # fmt: skip
    loaded = ek.SteeringVector.load(vector.save(tmp_path / "v.safetensors"))
    np.testing.assert_array_equal(loaded.vector, vector.vector)
    assert (loaded.layer, loaded.position, loaded.model) == (2, -1, vector.model)
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file

    save_file({"vector": torch.zeros(4)}, str(other))
    with pytest.raises(ek.InvalidRequest, match="not a steering vector saved by envoykit"):
        ek.SteeringVector.load(other)


def test_generation_is_its_text_with_ids():
    generation = ek.Generation(" hi there", [5, 6], {"steer": [{"scale": 2.0}]})
    assert generation == " hi there" and generation.upper() == " HI THERE"
    copy = pickle.loads(pickle.dumps(generation))
    assert copy.token_ids == (5, 6) and copy.meta["steer"][0]["scale"] == 2.0


def test_the_figure_has_the_map_and_the_last_layer():
    figure = ek.plot.steering(ek.SteerSweepResult.example(), " great")
    heatmap, line = figure.axes[:2]
    assert line.get_lines()[0].get_ydata().tolist() == pytest.approx([0.02, 0.1, 0.6])
    assert heatmap.get_images()[0].get_clim() == pytest.approx((0.0, 0.6))


def test_a_compared_run_names_its_steers_and_clamps():
    from types import SimpleNamespace

    engine = SimpleNamespace(info=SimpleNamespace(name="tiny", tp=1, dtype="float32"))
    clamp = ek.Clamp(SimpleNamespace(layer=2), feature=3)
    run = ek.Run(engine, "a b", steer=[ek.Steer(torch.ones(8), 1, scale=2.0), clamp])
    assert run.describe() == "tiny tp=1 float32: 'a b', steered at layer 1 x2, clamped at layer 2"
