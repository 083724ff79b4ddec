"""`FeaturesPanel`: an SAE's features on a prompt, one feature looked at closely, and the
prompt's continuation with that feature clamped.

Read shows each token's most active features as chips (`FeatureChips`, from
`Engine.features`). A click on a chip, or a feature id typed in, selects a feature: the panel
reads it again at every token (tracked by id, so exact even where it is not among a token's
top features) and asks for its logit effects (`Engine.feature_logits`). Given ``stats`` (the
`FeatureStats` of ``engine.feature_stats`` over a corpus), it also shows where the feature
fires most and how its activations are spread. Generate clamped writes the plain and the
clamped greedy continuation side by side (`ek.Clamp` as a steer: the feature set to the
slider's value at every position, generated ones too).

Read and Generate run on a thread of their own (`Background`), so the notebook stays
usable; a selection is one short read and runs where the click arrives, as the explorer's
attribution does. Neither has a Cancel: generation has no point at which to stop, as in
the steering panel. An SAE that does not fit the engine, or a feature out of range, is a
line in the header, not a traceback. Every text shown passes through ``html.escape``
(`feature_html`) or a text node.
"""

from __future__ import annotations

import html
import math
from typing import Any

import ipywidgets as widgets
import numpy as np

from envoykit.analyses.clamp import Clamp
from envoykit.analyses.sae import SAE
from envoykit.errors import InvalidRequest
from envoykit.explorer.feature_html import (
    activation_html,
    chips_data,
    contexts_html,
    continuation_html,
    logits_html,
)
from envoykit.explorer.outputs import ENGINE_ERRORS, figure_output, message_html
from envoykit.explorer.views import FeatureChips
from envoykit.explorer.work import Background
from envoykit.results.feature_stats import FeatureStats
from envoykit.results.features import FeatureLogitsResult, FeatureResult
from envoykit.results.steering import Generation

TITLE = "Features"
HINT = "Read shows each token's most active features; click one to see it, then clamp it"
# How many of a feature's max-activating contexts the panel shows.
CONTEXTS = 10


class FeaturesPanel(widgets.VBox):
    """A prompt and an SAE in; feature chips, one feature's activation, logit effects (and
    with ``stats`` its contexts and histogram), and a clamped continuation out.

    ``result`` is the last `FeatureResult` read, ``selected`` the feature looked at,
    ``activation`` its activation at each token of ``result``'s prompt ``[positions]``,
    ``logits`` its `FeatureLogitsResult`, ``histogram_figure`` the figure of its histogram,
    ``plain`` and ``clamped`` the last two `Generation`\\ s; each None while not shown.
    The slider ``clamp`` starts at the value given (0 ablates the feature); ``k`` is the
    number of logit effects shown per side. ``refusal`` says why ``sae`` cannot be read on
    ``engine`` ("" when it can): then every action only says it again.
    """

    def __init__(
        self,
        engine: Any,
        sae: SAE,
        *,
        prompt: str | None = None,
        stats: FeatureStats | None = None,
        top_k: int = 8,
        k: int = 10,
        clamp: float = 0.0,
        max_tokens: int = 12,
    ) -> None:
        self.engine, self.sae, self.stats, self.k = engine, sae, stats, k
        self._build_inputs(prompt, top_k)
        self.chips = FeatureChips()
        self.header = widgets.HTML()
        self.activation_view = widgets.HTML()
        self.logits_view = widgets.HTML()
        self.contexts_view = widgets.HTML()
        self.histogram_view = widgets.Output()
        self._build_clamp(clamp, max_tokens)
        self.result: FeatureResult | None = None
        self.selected: int | None = None
        self.activation: np.ndarray | None = None
        self.logits: FeatureLogitsResult | None = None
        self.histogram_figure: Any = None
        self.plain: Generation | None = None
        self.clamped: Generation | None = None
        self._echo = False  # a selection shown in the other control is not made again
        super().__init__(
            [
                self.header,
                self.prompt,
                widgets.HBox([self.top_k, self.read_button, self.feature]),
                self.chips,
                self.activation_view,
                self.logits_view,
                self.contexts_view,
                self.histogram_view,
                widgets.HBox([self.clamp, self.max_tokens, self.clamp_button]),
                widgets.HBox([self.plain_view, self.clamped_view], layout={"width": "100%"}),
            ]
        )
        self.add_class("ek-features-panel")
        self.work = Background(
            "envoykit-features",
            lambda why, details: self.say(
                f"the features failed: {why}", error=True, details=details
            ),
        )
        self.read_button.on_click(lambda _: self.work.start(self.read))
        self.clamp_button.on_click(lambda _: self.work.start(self.generate))
        self.chips.observe(self._on_chip, "selected")
        self.feature.observe(self._on_feature, "value")
        self.refusal = _misfit(engine, sae)
        for control in (self.read_button, self.clamp_button, self.feature):
            control.disabled = bool(self.refusal)
        self.say(self.refusal or HINT, error=bool(self.refusal))

    def _build_inputs(self, prompt: str | None, top_k: int) -> None:
        """The prompt, how many features a token shows, Read features and a feature's id."""
        self.prompt = widgets.Textarea(
            value=prompt or "", placeholder="prompt", layout={"width": "auto", "height": "50px"}
        )
        self.top_k = widgets.BoundedIntText(
            value=top_k, min=1, max=64, description="top-k", layout={"width": "160px"}
        )
        self.read_button = widgets.Button(
            description="Read features", icon="play", layout={"width": "auto"}
        )
        # A feature id typed in (Enter), for a feature that is no token's chip.
        self.feature = widgets.Text(
            description="feature",
            placeholder="id, then Enter",
            continuous_update=False,
            layout={"width": "200px"},
        )

    def _build_clamp(self, clamp: float, max_tokens: int) -> None:
        """The value to clamp to, how many tokens to generate, Generate clamped, and the
        plain and clamped continuations side by side."""
        bound = _round_up(max(100.0, abs(clamp)))
        self.clamp = widgets.FloatSlider(
            value=clamp,
            min=-bound,
            max=bound,
            step=bound / 200,
            description="clamp to",
            readout_format=".4g",
            layout={"width": "420px"},
        )
        self.max_tokens = widgets.BoundedIntText(
            value=max_tokens, min=1, max=256, description="tokens", layout={"width": "160px"}
        )
        self.clamp_button = widgets.Button(
            description="Generate clamped", icon="play", layout={"width": "auto"}
        )
        self.plain_view = widgets.HTML(layout={"width": "50%"})
        self.clamped_view = widgets.HTML(layout={"width": "50%"})

    # -- actions ---------------------------------------------------------------------------

    def read(self) -> FeatureResult | None:
        """Read the prompt's features into the chips; the result, or None when refused (the
        reason is shown). A feature selected stays selected, and is read again."""
        if not self._fits():
            return None
        self.read_button.disabled = True
        try:
            self.say("reading features…")
            res = self.engine.features(self.prompt.value, self.sae, top_k=self.top_k.value)
        except ENGINE_ERRORS as err:
            self.say(str(err), error=True)
            return None
        finally:
            self.read_button.disabled = False
        self.result = res
        self.chips.data = chips_data(res)
        top = float(res.top_acts.max(initial=0.0))
        bound = _round_up(10 * top)
        if bound > self.clamp.max:  # clamps well past what fires, never narrowed
            self.clamp.max, self.clamp.min, self.clamp.step = bound, -bound, bound / 200
        if self.selected is not None:
            self.select(self.selected)
        else:
            self.say(
                f"{len(res.tokens)} tokens, mean L0 {res.l0.mean():.1f}, variance explained "
                f"{res.variance_explained():.3f}; click a feature to see it"
            )
        return res

    def select(self, feature: int) -> np.ndarray | None:
        """Look at ``feature``: its activation at every token of the prompt read, its logit
        effects and, with ``stats``, its contexts and histogram. The activation, or None
        when refused (the reason is shown)."""
        if not self._fits():
            return None
        try:
            feature = self.sae.check_feature(feature)
            prompt = self.prompt.value if self.result is None else self.result.prompt
            self.say(f"reading feature {feature}…")
            res = self.engine.features(prompt, self.sae, top_k=self.top_k.value, features=[feature])
            logits = self.engine.feature_logits(self.sae, [feature], k=self.k)
        except ENGINE_ERRORS as err:
            self.say(str(err), error=True)
            return None
        if self.result is None or self.result.prompt != res.prompt:
            self.result = res
            self.chips.data = chips_data(res)
        self.selected, self.activation, self.logits = feature, res.activation(feature), logits
        self._show_selected(feature)
        self.activation_view.value = activation_html(feature, res.tokens, self.activation)
        self.logits_view.value = logits_html(feature, logits.of(feature))
        shown = self._show_stats(feature)
        self.say(
            f"feature {feature}: fires at {int((self.activation > 0).sum())} of "
            f"{len(res.tokens)} tokens" + shown + "; Generate clamped sets it to the value "
            "chosen"
        )
        return self.activation

    def generate(self) -> Generation | None:
        """The plain and the clamped continuation of the prompt, side by side; the clamped
        one, or None when refused (the reason is shown)."""
        if not self._fits():
            return None
        if self.selected is None:
            self.say("click a feature first: Generate clamped clamps the feature selected")
            return None
        feature, value = self.selected, float(self.clamp.value)
        prompt, tokens = self.prompt.value, self.max_tokens.value
        self.clamp_button.disabled = True
        try:
            self.say(f"generating with feature {feature} clamped to {value:g}…")
            plain = self.engine.generate(prompt, tokens)
            clamped = self.engine.generate(prompt, tokens, steer=Clamp(self.sae, feature, value))
        except ENGINE_ERRORS as err:
            self.say(str(err), error=True)
            return None
        finally:
            self.clamp_button.disabled = False
        self.plain, self.clamped = plain, clamped
        self.plain_view.value = continuation_html("plain", prompt, str(plain))
        self.clamped_view.value = continuation_html(
            f"feature {feature} clamped to {value:g}", prompt, str(clamped)
        )
        same = "the same as" if plain.token_ids == clamped.token_ids else "unlike"
        self.say(f"feature {feature} clamped to {value:g}: {same} the plain continuation")
        return clamped

    def say(self, text: str, *, error: bool = False, details: str = "") -> None:
        """Show ``text`` in the header; an error also clears the feature's views."""
        if error:
            self.selected = self.activation = self.logits = self.histogram_figure = None
            self.plain = self.clamped = None
            for view in (
                self.activation_view,
                self.logits_view,
                self.contexts_view,
                self.plain_view,
                self.clamped_view,
            ):
                view.value = ""
            self.histogram_view.outputs = ()
            self._show_selected(None)
        self.header.value = (
            f"<b>{html.escape(TITLE)}</b>{message_html(text, error=error, details=details)}"
        )

    # -- what shows it ---------------------------------------------------------------------

    def _fits(self) -> bool:
        """Whether the SAE fits the engine; if not, say why again."""
        if self.refusal:
            self.say(self.refusal, error=True)
        return not self.refusal

    def _show_stats(self, feature: int) -> str:
        """Draw ``feature``'s contexts and histogram from ``stats``; what the header adds."""
        self.contexts_view.value, self.histogram_view.outputs = "", ()
        self.histogram_figure = None
        if self.stats is None:
            return ""
        try:
            contexts = list(self.stats.contexts(feature))[:CONTEXTS]
            edges, counts = self.stats.histogram(feature)
        except (LookupError, ValueError, *ENGINE_ERRORS) as err:
            self.contexts_view.value = message_html(f"no statistics: {err}", error=True)
            return ""
        self.contexts_view.value = contexts_html(feature, contexts)
        figure = histogram(feature, np.asarray(edges), np.asarray(counts))
        self.histogram_figure = figure
        self.histogram_view.outputs = (figure_output(figure, f"feature {feature}'s histogram"),)
        return f", {len(contexts)} contexts shown"

    def _show_selected(self, feature: int | None) -> None:
        """Mark ``feature`` in the chips and the feature box, selecting nothing again."""
        self._echo = True
        try:
            self.chips.selected = feature
            self.feature.value = "" if feature is None else str(feature)
        finally:
            self._echo = False

    def _on_chip(self, change: dict[str, Any]) -> None:
        if not self._echo and change["new"] is not None:
            self.select(change["new"])

    def _on_feature(self, change: dict[str, Any]) -> None:
        text = change["new"].strip()
        if self._echo or not text:
            return
        try:
            feature = int(text)
        except ValueError:
            self.say(f"a feature is an integer id, not {text!r}", error=True)
            return
        self.select(feature)


def histogram(feature: int, edges: np.ndarray, counts: np.ndarray) -> Any:
    """A feature's activations over a corpus as a histogram, on a bare matplotlib figure."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.0, 2.2))
    ax = figure.subplots()
    ax.stairs(counts, edges, fill=True, color="tab:orange")
    ax.set_xlabel("activation", fontsize=8)
    ax.set_ylabel("tokens", fontsize=8)
    ax.set_title(f"feature {feature}: its activations over the corpus", fontsize=9)
    ax.tick_params(labelsize=8)
    figure.tight_layout()
    return figure


def _misfit(engine: Any, sae: Any) -> str:
    """Why ``sae`` cannot be read on ``engine``; "" when it can."""
    if not isinstance(sae, SAE):
        return f"the Features panel takes an ek.SAE (ek.SAE.load(path)), not {sae!r}"
    try:
        sae.check_engine(engine.info)
    except InvalidRequest as err:
        return str(err)
    return ""


def _round_up(value: float) -> float:
    """``value`` rounded up to one significant digit (340 -> 400): a slider's bound."""
    if value <= 0:
        return 1.0
    scale = 10.0 ** math.floor(math.log10(value))
    return math.ceil(value / scale) * scale
