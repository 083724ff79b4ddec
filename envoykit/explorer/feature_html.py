"""What the Features panel shows, shaped: the chips' data (`chips_data`) and the HTML of one
feature's activation over the prompt, its logit effects, its max-activating contexts and two
continuations.

Tokens are arbitrary strings: here every one passes through ``html.escape`` (the chips write
theirs as text nodes). A token's whitespace is marked and a control character written as
its escape (`token_label`): shaded by activation, a bare space would show as a coloured gap
and a newline would break the row. The exact text stays in each token's
``title``, quoted.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from envoykit.plot.text import token_text, visible
from envoykit.results.features import FeatureResult

# The shading of an activation: the accent colour at an opacity up to `_DEEPEST`, which reads
# on the light and the dark theme alike; past `_STRONG` the text on it turns white.
_ACCENT = "25, 118, 210"
_DEEPEST = 0.85
_STRONG = 0.55


def token_label(token: str) -> str:
    """``token`` as the panel writes it (`envoykit.plot.text.token_text`: ``␣`` for a space,
    ``↵`` for a newline, escapes for control characters), an empty one as ``∅``."""
    return token_text(token) or "∅"


def quoted(token: str) -> str:
    """``token`` quoted, every character of it visible: what a tooltip says."""
    return json.dumps(str(token), ensure_ascii=False)


def share(value: float, top: float) -> float:
    """``value`` as a share (0..1) of ``top``, the largest activation drawn beside it."""
    return float(np.clip(value / top, 0.0, 1.0)) if top > 0 else 0.0


def chips_data(res: FeatureResult) -> dict[str, Any]:
    """What `FeatureChips` draws: per position the token (``tokens``, and ``labels`` as
    `token_label` writes them), its fired features as ``[feature, activation]`` pairs,
    largest first (``chips``), its ``l0``, and ``top``, the largest activation of all."""
    chips = [
        [[int(f), float(a)] for f, a in zip(ids, acts) if f >= 0]
        for ids, acts in zip(res.top_ids.tolist(), res.top_acts.tolist())
    ]
    return {
        "tokens": list(res.tokens),
        "labels": [token_label(t) for t in res.tokens],
        "chips": chips,
        "l0": res.l0.tolist(),
        "top": float(res.top_acts.max(initial=0.0)),
    }


def token_row(
    tokens: Sequence[str], values: Iterable[float], top: float, focus: int | None = None
) -> str:
    """Tokens in a row, each shaded by its value's share of ``top``; ``focus`` (an index)
    outlined. Each carries its value in ``data-act``."""
    spans = []
    for i, (token, value) in enumerate(zip(tokens, values)):
        value = float(value)
        weight = share(value, top)
        classes = ["ek-feat-tok"]
        if weight > _STRONG:
            classes.append("ek-feat-strong")
        if i == focus:
            classes.append("ek-feat-focus")
        title = html.escape(f"{quoted(token)}: {value:.4g}")
        spans.append(
            f'<span class="{" ".join(classes)}" data-act="{value!r}" title="{title}" '
            f'style="background:rgba({_ACCENT}, {weight * _DEEPEST:.3f})">'
            f"{html.escape(token_label(token))}</span>"
        )
    return f'<div class="ek-feat-row">{"".join(spans)}</div>'


def activation_html(feature: int, tokens: Sequence[str], values: np.ndarray) -> str:
    """Feature ``feature``'s activation at each token of the prompt, shaded."""
    values = np.asarray(values, dtype=np.float64)
    top = float(values.max(initial=0.0))
    where = f"max {top:.4g} at {quoted(tokens[int(values.argmax())])}" if top > 0 else "silent here"
    return (
        f'<div class="ek-feat-view ek-feat-activation"><div class="ek-feat-title">'
        f"feature {feature} over the prompt: {html.escape(where)}</div>"
        f"{token_row(tokens, values, top)}</div>"
    )


def logits_html(feature: int, effects: dict[str, list[tuple[str, float]]]) -> str:
    """The tokens feature ``feature``'s decoder direction raises and lowers most, each with
    its logit (``effects``: `FeatureLogitsResult.of`)."""
    sides = []
    for side, word in (("up", "raises"), ("down", "lowers")):
        items = "".join(
            f'<span class="ek-feat-logit" data-token="{html.escape(quoted(token))}" '
            f'data-logit="{logit!r}" title="{html.escape(quoted(token))}: {logit:+.4g}">'
            f"{html.escape(token_label(token))}<small>{logit:+.3g}</small></span>"
            for token, logit in effects[side]
        )
        sides.append(f'<div class="ek-feat-{side}"><b>{word}</b>{items}</div>')
    return (
        f'<div class="ek-feat-view ek-feat-logits"><div class="ek-feat-title">feature '
        f"{feature}'s logit effects: its decoder direction through the final norm and the "
        f"unembedding</div>{''.join(sides)}</div>"
    )


def contexts_html(feature: int, contexts: Sequence[Any]) -> str:
    """Feature ``feature``'s max-activating contexts: each a window of tokens shaded by the
    feature's activation, its focus token outlined, after the document and position."""
    if not contexts:
        body = '<div class="ek-feat-where">it fires nowhere in the corpus</div>'
    else:
        top = max(float(item.activation) for item in contexts)
        body = "".join(
            f'<div class="ek-feat-context" data-document="{int(item.document)}" '
            f'data-position="{int(item.position)}"><span class="ek-feat-where">document '
            f"{int(item.document)}, token {int(item.position)}: "
            f"{float(item.activation):.4g}</span>"
            f"{token_row(item.tokens, item.activations, top, focus=int(item.focus))}</div>"
            for item in contexts
        )
    return (
        f'<div class="ek-feat-view ek-feat-contexts"><div class="ek-feat-title">where feature '
        f"{feature} fires most in the corpus</div>{body}</div>"
    )


def continuation_html(title: str, prompt: str, text: str) -> str:
    """A continuation under its title, after its prompt in a fainter colour; all escaped,
    control characters written as escapes (a clamped model often writes them)."""
    return (
        f'<div class="ek-continuation"><b>{html.escape(title)}</b><div>'
        f'<span class="ek-continuation-prompt">{html.escape(visible(prompt))}</span>'
        f'<span class="ek-continuation-text">{html.escape(visible(text))}</span></div></div>'
    )
