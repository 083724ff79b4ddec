"""Matplotlib figures drawn from results; nothing here computes a statistic.

``heatmap`` shows layers x positions with the top-1 token written in each cell; the colour is
the top-1 probability, the entropy, the KL to the final layer, or a target's probability.
``trajectory`` follows target tokens across layers at one position; ``attention``,
``attribution``, ``head_attribution``, ``sweep``, ``compare``, ``steering``, ``lens_quality``,
``lens_corpus``, ``features`` and ``feature`` (SAE features) draw the other results.
"""

import warnings

from envoykit.plot.attention import attention
from envoykit.plot.attribution import attribution, head_attribution
from envoykit.plot.compare import compare
from envoykit.plot.corpus import lens_corpus
from envoykit.plot.features import feature, features
from envoykit.plot.lens import heatmap, trajectory
from envoykit.plot.steering import steering
from envoykit.plot.sweep import sweep
from envoykit.plot.tuned import lens_quality

# Tokens are arbitrary text: one whose glyph the font lacks is drawn as a box, and matplotlib
# says so once per glyph and per drawing, in the middle of a notebook's output. The box is
# the honest rendering; the notice is noise.
warnings.filterwarnings("ignore", message=r"Glyph \d+ .* missing from font")

__all__ = [
    "attention",
    "attribution",
    "compare",
    "feature",
    "features",
    "head_attribution",
    "heatmap",
    "lens_corpus",
    "lens_quality",
    "steering",
    "sweep",
    "trajectory",
]
