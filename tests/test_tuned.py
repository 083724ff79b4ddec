"""The tuned lens on tiny: trained against the engine, applied on the ranks.

Checks: on held-out text the tuned lens is closer to the final distribution than the logit
lens at >= 3 of 4 layers after seconds of training; training is deterministic given the
seed; the same translators give the same lens at TP=1 and TP=2 (1e-5); they are sent to the
ranks once per engine; files round-trip and are refused on another model.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import envoykit as ek
from envoykit.analyses.tuned import offline_texts

pytestmark = pytest.mark.engine

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def texts():
    return offline_texts()


@pytest.fixture(scope="module")
def tuned(tiny2, texts):
    return ek.TunedLens.train(tiny2, texts[0], steps=20, progress=False)


def test_tuned_lens_beats_the_logit_lens_on_held_out_text(tiny2, tuned, texts):
    quality = tuned.evaluate(tiny2, texts[1][:2])
    assert quality.tokens > 100
    assert (quality.tuned_kl < quality.logit_kl).sum() >= 3, quality.to_pandas()


def test_training_is_deterministic(tiny2, texts):
    first, second = (
        ek.TunedLens.train(tiny2, texts[0], steps=3, progress=False, seed=1) for _ in range(2)
    )
    assert first.key == second.key
    other = ek.TunedLens.train(tiny2, texts[0], steps=3, progress=False, seed=2)
    assert other.key != first.key


def test_training_for_a_time_keeps_a_trained_step(tiny2, texts):
    """With ``max_seconds`` (and no step count) training stops on its own and returns the
    translators of its best step: trained, finite, and their steps recorded, the first one
    piece of text (to learn the pace), none more than a batch."""
    timed = ek.TunedLens.train(tiny2, texts[0], max_seconds=4, progress=False)
    sizes = timed.model["step_tokens"]
    assert timed.model["steps"] == len(sizes) >= 2
    assert sizes[0] <= 128 and max(sizes) <= 256 + 128  # a piece; a batch and its last piece
    weights = torch.stack([a for a, _ in timed.weights.values()])
    assert torch.isfinite(weights).all() and weights.abs().sum() > 0


class StopAfter:
    """A stop that is set once it has been looked at ``n`` times: where training looks."""

    def __init__(self, n: int) -> None:
        self.n, self.asked = n, 0

    def is_set(self) -> bool:
        self.asked += 1
        return self.asked > self.n


def test_training_stops_within_a_step_and_keeps_its_best(tiny2, texts):
    """``stop`` (a Cancel's event, set from another thread) is looked at before each piece
    of text and each layer's backward: set before the start, nothing is trained and the
    logit lens's zero translators come back, marked; set inside a step, that step is
    dropped and training ends there."""
    import threading

    stop = threading.Event()
    stop.set()
    stopped = ek.TunedLens.train(tiny2, texts[0], steps=50, progress=False, stop=stop)
    assert stopped.model["steps"] == 0 and stopped.model["stopped"] is True
    assert all(float(a.abs().sum() + b.abs().sum()) == 0 for a, b in stopped.weights.values())
    # Each step looks before each piece and each of the model's layers: stopping on the
    # fifth look is inside the first step, of two steps asked for.
    midway = ek.TunedLens.train(tiny2, texts[0], steps=2, progress=False, stop=StopAfter(5))
    assert midway.model["steps"] == 0 and midway.model["stopped"] is True
    free = ek.TunedLens.train(tiny2, texts[0], steps=2, progress=False, stop=threading.Event())
    assert free.model["steps"] == 2 and "stopped" not in free.model
    assert free.model["step_tokens"][0] >= 256  # without a budget, whole batches


def test_tp1_equals_tp2_and_sent_once(tiny_engines, tuned, monkeypatch):
    results = {tp: tiny_engines[tp].lens(PROMPT, translator=tuned) for tp in (1, 2)}
    np.testing.assert_allclose(results[1].kl, results[2].kl, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(results[1].top_ids[..., 0], results[2].top_ids[..., 0])
    assert results[2].meta["lens"] == "tuned"
    plain = tiny_engines[2].lens(PROMPT)
    assert results[2].meta["returned_bytes"] == plain.meta["returned_bytes"]
    np.testing.assert_array_equal(results[2].kl[-1], plain.kl[-1])  # the last layer is exact
    calls = []
    entry = tiny_engines[2].model.vllm_entrypoint
    monkeypatch.setattr(entry, "collective_rpc", lambda *a, **k: calls.append(a))
    tiny_engines[2].lens(PROMPT, translator=tuned)
    assert calls == []  # already on the ranks


def test_save_load_and_another_model_is_refused(tiny2, tuned, tmp_path):
    path = tuned.save(tmp_path / "tiny.safetensors")
    again = ek.TunedLens.load(path, engine=tiny2)
    assert again.key == tuned.key
    other = ek.TunedLens(tuned.weights, {**tuned.model, "name": "demo", "head_hash": "0" * 64})
    other.save(tmp_path / "other.safetensors")
    with pytest.raises(ek.InvalidRequest, match=r"trained on 'demo'.*not on the engine's 'tiny'"):
        ek.TunedLens.load(tmp_path / "other.safetensors", engine=tiny2)
    with pytest.raises(ek.InvalidRequest, match="trained on 'demo'"):
        tiny2.lens(PROMPT, translator=other)
    assert tiny2.lens(PROMPT, layers=[1]).layers.tolist() == [1]


def test_a_file_that_is_not_a_whole_tuned_lens_is_refused_at_load(tuned, tmp_path):
    """A file is checked as bytes from a client are: another kind of envoykit file, and
    translators of the wrong shape, are refused when read, not when first used."""
    vector = ek.SteeringVector(np.ones(4, np.float32), 1, "resid", -1, ("a",), ("b",))
    with pytest.raises(ek.InvalidRequest, match="not a tuned lens saved by envoykit"):
        ek.TunedLens.load(vector.save(tmp_path / "vector.safetensors"))
    n = tuned.model["n_layers"]
    wide = {layer: (torch.zeros(3, 3), torch.zeros(3)) for layer in range(n)}
    ek.TunedLens(wide, tuned.model).save(tmp_path / "wide.safetensors")
    with pytest.raises(ek.InvalidRequest, match="not a floating-point"):
        ek.TunedLens.load(tmp_path / "wide.safetensors")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"texts": []}, "non-empty list of texts"),
        ({"texts": ["short text here, only a few tokens"]}, "fewer than one batch"),
        ({"max_seconds": 0}, "max_seconds must be positive"),
        ({"steps": -1}, "steps must be positive"),
    ],
)
def test_bad_training_request_is_refused(tiny2, texts, kwargs, message):
    call = {"texts": texts[0], "steps": 1, "progress": False, **kwargs}
    with pytest.raises(ek.InvalidRequest, match=message):
        ek.TunedLens.train(tiny2, call.pop("texts"), **call)


def test_translator_only_for_the_residual_stream(tiny2, tuned):
    with pytest.raises(ek.InvalidRequest, match="residual stream"):
        tiny2.lens(PROMPT, sites=["attn"], translator=tuned)


def test_ranks_keep_at_most_two_tuned_lenses(tiny2, tuned):
    """Retrained lenses do not pile up on the ranks: a third drops the least recently used,
    which is installed again when it is used next, with the same lens as before."""
    import nnsight

    from envoykit.ranks import translators

    others = [
        ek.TunedLens({k: (a * scale, b) for k, (a, b) in tuned.weights.items()}, tuned.model)
        for scale in (0.5, 0.25)
    ]
    first = tiny2.lens(PROMPT, translator=tuned)
    for other in others:
        tiny2.lens(PROMPT, translator=other)
    with tiny2.trace(PROMPT):
        held = nnsight.save(sorted(translators.INSTALLED))
    assert held == sorted(o.key for o in others)
    again = tiny2.lens(PROMPT, translator=tuned)
    np.testing.assert_array_equal(again.kl, first.kl)


def test_training_reports_held_out_quality(tuned):
    """Training holds texts out and reports the tuned lens against the logit lens there."""
    assert tuned.quality is not None and tuned.quality.tokens > 0
    assert (tuned.quality.tuned_kl < tuned.quality.logit_kl).sum() >= 3, tuned.quality


def test_training_that_never_beats_the_logit_lens_says_so(tiny2, texts):
    """With nothing learned (a zero learning rate) the kept translators are the logit lens
    itself, and a warning says the tuned lens is not better at most layers."""
    with pytest.warns(UserWarning, match="only 0 of 4 layers on held-out text"):
        idle = ek.TunedLens.train(tiny2, texts[0], steps=5, lr=0.0, progress=False)
    assert all(float(a.abs().max()) == 0.0 for a, _ in idle.weights.values())


def test_evaluate_refuses_texts_too_short_to_measure(tiny2, tuned):
    with pytest.raises(ek.InvalidRequest, match="at least 8 tokens"):
        tuned.evaluate(tiny2, ["too short"])
