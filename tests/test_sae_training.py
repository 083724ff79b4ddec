"""`ek.train_sae` on activations an engine collected, at TP=1 and TP=2.

References and tolerances:
  * the stores of TP=1 and TP=2 differ by float error only (test_dataset.py holds them within
    1e-4 of the stream's largest magnitude); the SAEs trained on them with one seed agree
    within 1e-3 of each weight tensor's largest magnitude, and their held-out variance
    explained within 1e-3: a few hundred tokens, one pass, small enough that no TopK choice
    flips between the two;
  * ``source=engine`` collects float32 activations of ``texts`` into a temporary store: it
    trains the SAE that a float32 store collected by hand trains, bit for bit, and leaves
    nothing in the temporary directory; ``engine.features`` of that SAE reports the variance
    explained its client-side encode gives on the stored stream, within 1e-4.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

import envoykit as ek
from envoykit.analyses.tuned import offline_texts

pytestmark = [pytest.mark.engine]

# About 150 tokens each: below tiny's context of 256.
TEXTS = [text[:200] for text in offline_texts()[0][:12]]
LAYER = 2
RUN = {"layer": LAYER, "d_sae": 256, "k": 8, "batch_size": 64, "progress": False}
TOL = 1e-3


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= TOL * max(1.0, float(b.abs().max()))


def variance_explained(sae: ek.SAE, rows: torch.Tensor) -> float:
    recon = sae.decode(sae.encode(rows))
    return 1 - float((rows - recon).pow(2).sum() / (rows - rows.mean(0)).pow(2).sum())


def test_tp2_store_trains_the_tp1_sae(tiny_engines, tmp_path):
    stores = {
        tp: engine.collect(
            TEXTS, out=tmp_path / f"tp{tp}", layers=[LAYER], dtype="float32", progress=False
        )
        for tp, engine in tiny_engines.items()
    }
    one, two = (ek.train_sae(stores[tp], **RUN, out=tmp_path / f"sae{tp}") for tp in (1, 2))
    assert one.model_name == two.model_name == tiny_engines[1].info.name
    assert one.d_in == tiny_engines[1].info.d_model
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        assert close(getattr(two, name), getattr(one, name)), name
    rows = stores[1].load(LAYER)[-round(0.1 * len(stores[1])) :]
    for sae in (one, two):
        sae.check_engine(tiny_engines[1].info)
    explained = [variance_explained(sae, rows) for sae in (one, two)]
    assert abs(explained[0] - explained[1]) <= TOL, explained


def test_engine_source_collects_trains_and_cleans_up(tiny1, tmp_path, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    sae = ek.train_sae(tiny1, texts=TEXTS, **RUN)
    assert list(scratch.iterdir()) == []
    store = tiny1.collect(
        TEXTS, out=tmp_path / "store", layers=[LAYER], dtype="float32", progress=False
    )
    by_hand = ek.train_sae(store, **RUN)
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        assert torch.equal(getattr(sae, name), getattr(by_hand, name)), name
    # On the ranks as on the client: the input scale is in the saved weights.
    explained = variance_explained(sae, store.document(0, LAYER))
    assert abs(tiny1.features(TEXTS[0], sae).variance_explained() - explained) <= 1e-4
