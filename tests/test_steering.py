"""Steering against plain transformers in float32, with the vector added by a forward hook.

Tolerances: a steered greedy generation of 16 tokens has the transformers hook's tokens
exactly, and at every position (prompt and generated) the final distribution agrees to 1e-4
in probability; ``norm_match`` keeps each steered row's norm to 1e-5 (relative); TP=2 equals
TP=1 within 1e-5; a steering vector equals the mean difference of transformers' streams
within 1e-4 (relative to its norm); a sweep's scale equals that steer run alone within 1e-5.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from reference import load, steered_greedy, steered_logits

import envoykit as ek

pytestmark = pytest.mark.engine

PROMPT = "The capital of France is"
TOL = 1e-4
TARGET = "e"  # one token on tiny
POSITIVE = ["I love this movie. It is wonderful", "What a great day, I am so happy"]
NEGATIVE = ["I hate this movie. It is terrible", "What an awful day, I am so sad"]


def vector(engine: ek.Engine, seed: int = 0, norm: float = 8.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    v = torch.randn(engine.info.d_model, generator=generator)
    return v * (norm / v.norm())


def assert_final_distribution(res: ek.LensResult, logits: torch.Tensor) -> None:
    """The lens's last layer (top-k, entropy) against transformers' logits, every position."""
    logp = torch.log_softmax(logits.double(), -1)
    k = res.top_ids.shape[-1]
    np.testing.assert_allclose(res.top_probs[-1], logp.topk(k, -1).values.exp(), atol=TOL)
    np.testing.assert_allclose(res.entropy[-1], -(logp.exp() * logp).sum(-1), atol=TOL)


class TestExact:
    @pytest.mark.parametrize("tp", [1, 2])
    @pytest.mark.parametrize("norm_match", [False, True])
    def test_generation_equals_transformers_hook(self, tiny_engines, tp, norm_match):
        engine = tiny_engines[tp]
        v = vector(engine)
        steer = ek.Steer(v, 1, norm_match=norm_match)
        steered = engine.generate(PROMPT, 16, steer=steer)
        ids = list(steered.token_ids)
        reference = steered_greedy(engine.info.path, PROMPT, 1, v, 16, norm_match=norm_match)
        assert ids == reference[: len(ids)]
        assert len(ids) == 16 or ids[-1] == engine.tokenizer.eos_token_id
        assert ids != engine.generate_ids(PROMPT, 16), "the steer changed nothing"
        assert steered.meta["steer"][0]["norm_match"] is norm_match
        # The distribution at every prompt and generated position, through the lens.
        res = engine.lens(PROMPT, layers=[-1], top_k=5, generate=len(ids) - 1, steer=steer)
        assert list(res.token_ids[-(len(ids) - 1) :]) == ids[:-1]
        prompt_ids = engine.tokenizer(PROMPT)["input_ids"]
        logits = steered_logits(engine.info.path, prompt_ids + ids[:-1], 1, v, norm_match)
        assert_final_distribution(res, logits)
        assert res.meta["steer"][0]["scale"] == 1.0

    @pytest.mark.parametrize(
        ("layer", "site", "positions"), [(0, "resid", None), (2, "resid_mid", [1, -1])]
    )
    def test_sites_and_positions_equal_transformers(self, tiny2, layer, site, positions):
        v = vector(tiny2, seed=1)
        res = tiny2.lens(
            PROMPT, layers=[-1], top_k=5, steer=ek.Steer(v, layer, site=site, positions=positions)
        )
        ids = tiny2.tokenizer(PROMPT)["input_ids"]
        rows = None if positions is None else [p % len(ids) for p in positions]
        assert_final_distribution(
            res, steered_logits(tiny2.info.path, ids, layer, v, positions=rows, site=site)
        )

    def test_steers_add_up_and_tp2_equals_tp1(self, tiny_engines):
        a, b = vector(tiny_engines[1], 2), vector(tiny_engines[1], 3)
        steers = [ek.Steer(a, 2, scale=0.5), ek.Steer(b, 2, scale=2.0)]
        one = tiny_engines[1].lens(PROMPT, top_k=5, steer=steers)
        two = tiny_engines[2].lens(PROMPT, top_k=5, steer=steers)
        combined = tiny_engines[2].lens(PROMPT, top_k=5, steer=ek.Steer(0.5 * a + 2.0 * b, 2))
        np.testing.assert_allclose(one.top_probs, two.top_probs, atol=1e-5)
        np.testing.assert_allclose(two.top_probs, combined.top_probs, atol=1e-5)
        plain = tiny_engines[2].lens(PROMPT, top_k=5)
        np.testing.assert_array_equal(two.top_probs[0], plain.top_probs[0])  # layer 1: before it
        assert not np.allclose(two.top_probs[1], plain.top_probs[1], atol=1e-3)

    def test_norm_match_keeps_norms(self, tiny2):
        import nnsight

        layers = tiny2.model.model.layers

        def stream_after_first_layer(**kwargs):
            with tiny2.trace(PROMPT, **kwargs):
                hidden, residual = layers[0].output
                saved = nnsight.save((hidden + residual).cpu())
            return saved

        plain = stream_after_first_layer()
        v = vector(tiny2, norm=50.0)
        steered = stream_after_first_layer(steer=ek.Steer(v, 1, norm_match=True))
        np.testing.assert_allclose(steered.norm(dim=-1), plain.norm(dim=-1), rtol=1e-5)
        assert not torch.allclose(steered, plain, atol=1e-2)

    def test_steered_trace_equals_transformers_and_is_cleared(self, tiny2):
        import nnsight

        v = vector(tiny2, seed=4)
        before = tiny2.generate_ids(PROMPT, 8)
        with tiny2.trace(PROMPT, steer=ek.Steer(v, 2)):
            logits = nnsight.save(tiny2.model.logits.cpu())
        ids = tiny2.tokenizer(PROMPT)["input_ids"]
        reference = steered_logits(tiny2.info.path, ids, 2, v)[-1]
        np.testing.assert_allclose(
            torch.softmax(logits.reshape(-1, logits.shape[-1])[-1].double(), -1),
            torch.softmax(reference.double(), -1),
            atol=TOL,
        )
        # Nothing stays installed: plain requests and traces run as before.
        assert tiny2.generate_ids(PROMPT, 8) == before
        assert not [e for e in tiny2.model._installed_edits if e.name]


class TestVector:
    def test_mean_difference_equals_transformers(self, tiny_engines):
        one = tiny_engines[1].steering_vector(POSITIVE, NEGATIVE, 2, progress=False)
        two = tiny_engines[2].steering_vector(POSITIVE, NEGATIVE, 2, progress=False)
        model, tokenizer = load(tiny_engines[1].info.path)

        def last_stream(prompt: str) -> np.ndarray:
            out = model(torch.tensor([tokenizer(prompt)["input_ids"]]), output_hidden_states=True)
            return out.hidden_states[2][0, -1].double().numpy()

        with torch.no_grad():
            expected = np.mean([last_stream(p) for p in POSITIVE], 0) - np.mean(
                [last_stream(p) for p in NEGATIVE], 0
            )
        scale = np.linalg.norm(expected)
        np.testing.assert_allclose(one.vector, expected, atol=TOL * scale)
        np.testing.assert_allclose(two.vector, one.vector, atol=1e-5 * scale)
        assert (one.layer, one.site, one.position) == (2, "resid", -1)
        assert one.model == tiny_engines[1].fingerprint()

    def test_save_load_and_another_model_refused(self, tiny2, demo3, tmp_path):
        v = tiny2.steering_vector(POSITIVE, NEGATIVE, 1, position=None, progress=False)
        path = v.save(tmp_path / "v.safetensors")
        loaded = ek.SteeringVector.load(path)
        np.testing.assert_array_equal(loaded.vector, v.vector)
        assert loaded.model == v.model and loaded.positive == tuple(POSITIVE)
        steer = ek.Steer(loaded, loaded.layer, scale=2.0)
        assert tiny2.generate_ids(PROMPT, 4, steer=steer) == tiny2.generate_ids(
            PROMPT, 4, steer=ek.Steer(torch.from_numpy(np.array(v.vector)), 1, scale=2.0)
        )
        with pytest.raises(ek.InvalidRequest, match=r"built on 'tiny'.*not on the engine's 'demo'"):
            demo3.generate(PROMPT, 4, steer=steer)
        assert demo3.generate(PROMPT, 2)  # still answers


class TestSweep:
    def test_each_scale_equals_its_own_run(self, tiny2):
        v = vector(tiny2, seed=5)
        steer = ek.Steer(v, 2)
        scales = [-2.0, 0.0, 1.5]
        res = tiny2.steer_sweep(
            PROMPT, steer, scales=scales, max_tokens=6, targets=[TARGET], batch=2, progress=False
        )
        assert res.target_probs.shape == (3, tiny2.info.n_layers, 1)
        for i, scale in enumerate(scales):
            alone = tiny2.generate(PROMPT, 6, steer=steer.scaled(scale))
            assert res.token_ids[i] == alone.token_ids and res.texts[i] == str(alone)
            lens = tiny2.lens(PROMPT, targets=[TARGET], steer=steer.scaled(scale), top_k=1)
            np.testing.assert_allclose(
                res.target_probs[i, :, 0], lens.target(TARGET).prob[:, -1], atol=1e-5
            )
            assert list(res.top_tokens[i]) == list(lens.top_tokens[:, -1, 0])
        assert tuple(res.token_ids[1]) == tuple(tiny2.generate_ids(PROMPT, 6))  # scale 0
        assert res.meta["steer"][0]["scale"] == 1.0
        assert ek.SteerSweepResult.from_json(res.to_json()).texts == res.texts

    def test_patch_sweep_steers_the_target(self, tiny2):
        steer = ek.Steer(vector(tiny2, seed=6), 1)
        sweep = tiny2.patch_sweep(
            PROMPT,
            "The capital of Italy is",
            layers=[2],
            target_token=TARGET,
            steer=steer,
            progress=False,
        )
        lens = tiny2.lens("The capital of Italy is", layers=[-1], targets=[TARGET], steer=steer)
        assert sweep.clean == pytest.approx(float(lens.target(TARGET).prob[0, -1]), abs=1e-5)
        assert sweep.meta["steer"][0]["layer"] == 1


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda e: ek.Steer(torch.zeros(e.info.d_model + 1), 1), "d_model"),
        (lambda e: ek.Steer(torch.zeros(e.info.d_model, dtype=torch.int64), 1), "floating-point"),
        (lambda e: ek.Steer(torch.full((e.info.d_model,), float("nan")), 1), "NaN or infinite"),
        (lambda e: ek.Steer(torch.zeros(e.info.d_model), 99), "layer"),
        (lambda e: ek.Steer(torch.zeros(e.info.d_model), 1, positions=[40]), "past the prompt"),
        (lambda e: ek.Steer(torch.zeros(e.info.d_model), 1, scale=float("inf")), "finite number"),
        (lambda e: ek.Steer(torch.zeros(e.info.d_model), 1, site="attn"), "'resid' or 'resid_mid'"),
        (lambda e: ek.Steer("up", 1), "a tensor, an array"),
        (lambda e: "not a steer", "ek.Steer objects"),
    ],
)
def test_bad_steer_is_refused_and_engine_answers(tiny2, make, message):
    with pytest.raises(ek.InvalidRequest, match=message):
        tiny2.generate(PROMPT, 4, steer=make(tiny2))
    with pytest.raises(ek.InvalidRequest, match=message):
        tiny2.lens(PROMPT, steer=make(tiny2))
    assert tiny2.lens(PROMPT, layers=[-1]).top_ids.shape[0] == 1


def test_bad_vector_requests_are_refused(tiny2):
    with pytest.raises(ek.InvalidRequest, match="negative prompts are empty"):
        tiny2.steering_vector(POSITIVE, [], 1)
    with pytest.raises(ek.InvalidRequest, match="not a token position of every prompt"):
        tiny2.steering_vector(POSITIVE, NEGATIVE, 1, position=50)
    with pytest.raises(ek.InvalidRequest, match="scales is empty"):
        tiny2.steer_sweep(PROMPT, ek.Steer(vector(tiny2), 1), scales=[])
    with pytest.raises(ek.InvalidRequest, match="positions=None"):
        tiny2.trace(PROMPT, steer=ek.Steer(vector(tiny2), 1, positions=[0]))


class TestPanel:
    def test_generate_shows_both_continuations_and_their_diff(self, tiny2):
        from envoykit.explorer import SteeringPanel

        panel = SteeringPanel(
            tiny2, prompt=PROMPT, positive=POSITIVE, negative=NEGATIVE, layer=2, scale=2.0,
            max_tokens=6, targets=[TARGET, "o"],
        )  # fmt: skip
        steered = panel.generate()
        vector = tiny2.steering_vector(POSITIVE, NEGATIVE, 2, progress=False)
        np.testing.assert_array_equal(panel.vector.vector, vector.vector)
        expected = tiny2.generate(PROMPT, 6, steer=ek.Steer(vector, 2, scale=2.0))
        assert steered.token_ids == expected.token_ids
        assert panel.plain.token_ids == tuple(tiny2.generate_ids(PROMPT, 6))
        assert str(expected) in html_text(panel.steered_view.value)
        cmp = panel.comparison
        assert panel.diff.metric == TARGET and cmp.target_labels == (TARGET, "o")
        # The diff measures the target picked in its menu: a pick redraws, asking nothing.
        assert panel.measure.options == (("'e'", TARGET), ("'o'", "o"))
        panel.measure.value = "o"
        assert panel.comparison is cmp and panel.diff.metric == "o"
        assert "Δ p('o')" in html_text(panel.diff_header.value)
        # Before the steer the two runs are one (JS to float64 rounding of a sum).
        assert cmp.js[cmp.layers < 2].max() < 1e-12 < cmp.js[cmp.layers >= 2].max()
        assert "steered at layer 2 x2" in cmp.b
        again = panel.vector
        panel.scale.value = -1.0
        panel.generate()
        assert panel.vector is again  # same lists and layer: not built again

    def test_the_generate_button_works_off_the_kernels_thread(self, tiny2):
        """A click hands Generate to a thread of its own (the kernel stays free); it shows
        what a call from code shows."""
        from envoykit.explorer import SteeringPanel

        panel = SteeringPanel(
            tiny2, prompt=PROMPT, positive=POSITIVE, negative=NEGATIVE, layer=2, max_tokens=4
        )
        panel.button.click()
        assert panel.work.wait(120) and not panel.button.disabled
        clicked = panel.steered
        assert clicked is not None and panel.generate().token_ids == clicked.token_ids

    def test_cancel_stops_generate_before_its_next_stage(self, tiny2):
        """Cancel pressed while Generate runs (here the moment it says it has begun) stops it
        before its next stage: the panel says so and shows no continuation, the buttons
        come back, and the next Generate runs whole."""
        from envoykit.explorer import SteeringPanel

        panel = SteeringPanel(
            tiny2, prompt=PROMPT, positive=POSITIVE, negative=NEGATIVE, layer=2, max_tokens=4
        )

        def press_cancel(change):
            if "generating" in change["new"]:
                panel.cancel_button.click()

        panel.header.observe(press_cancel, "value")
        panel.button.click()
        assert panel.work.wait(120)
        assert "cancelled before the vector; the engine is free" in panel.header.value
        assert panel.steered is None and panel.steered_view.value == ""
        assert not panel.button.disabled and panel.cancel_button.disabled
        panel.header.unobserve(press_cancel, "value")
        assert panel.generate().token_ids == tuple(
            tiny2.generate(PROMPT, 4, steer=ek.Steer(panel.vector, 2)).token_ids
        )

    def test_cancel_stops_a_continuation_in_flight(self, tiny2):
        """Cancel pressed while the plain continuation of 240 tokens is being generated
        stops it on the ranks (a plain vLLM request would run to its end, and Generate would
        stop only before the steered one), and the next Generate runs whole."""
        from envoykit.explorer import SteeringPanel

        panel = SteeringPanel(
            tiny2, prompt=PROMPT, positive=POSITIVE, negative=NEGATIVE, layer=2, max_tokens=240
        )
        panel.button.click()
        while panel._at != "the plain continuation":
            time.sleep(0.001)
        while not tiny2.cancel(panel.work.thread):  # the generation's trace has begun
            time.sleep(0.001)
        assert panel.work.wait(120)
        assert "cancelled during the plain continuation; the engine is free" in panel.header.value
        assert panel.plain is None and panel.steered is None
        panel.max_tokens.value = 4
        assert panel.generate().token_ids == tuple(
            tiny2.generate(PROMPT, 4, steer=ek.Steer(panel.vector, 2)).token_ids
        )

    def test_bad_input_is_a_message(self, tiny2):
        from envoykit.explorer import SteeringPanel

        panel = SteeringPanel(tiny2, prompt=PROMPT, positive=["<b>up</b>"], negative=[])
        assert panel.generate() is None
        assert "negative prompts are empty" in panel.header.value
        assert panel.steered is None and panel.diff.data == {}
        panel.negative.value = "down"
        panel.layer.value = 1
        assert panel.generate() is not None
        assert "<b>up</b>" not in panel.header.value  # every text escaped

    def test_explorer_steers_its_own_prompt(self, tiny2):
        explorer = ek.LensExplorer(tiny2, prompt=PROMPT, targets=[TARGET])
        panel = explorer.steering_panel
        assert panel in explorer.panels.children and panel.prompt.value == PROMPT
        explorer.prompt.value = "The capital of Italy is"
        explorer.targets.value = "e, a"
        assert panel.prompt.value == "The capital of Italy is" and panel.targets.value == "e, a"


def html_text(markup: str) -> str:
    """The text of escaped markup, as a browser shows it."""
    import html
    import re

    return html.unescape(re.sub(r"<[^>]+>", "", markup))
