"""Feature statistics over a corpus against the client-side aggregation of per-document
`engine.features` results (every feature's activation at every token, read in one trace of
the same documents, so the numerics are the same).

Tolerances: tokens fired on and the contexts (document, position, window token ids) equal;
activation sums, means and each context's window activations within 1e-6 relative.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import envoykit as ek
from envoykit.errors import InvalidRequest
from envoykit.plot.text import short

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "sae"
CORPUS = ek.shipped_corpus()
EDGES = np.logspace(-3, 3, 49)


def reference(engine: ek.Engine, texts: list[str], sae: ek.SAE, n: int, window: int) -> dict:
    """The statistics from every feature's activation at every token of every document."""
    results = engine.features(texts, sae, features=list(range(sae.d_sae)), top_k=1)
    fired = np.zeros(sae.d_sae, np.int64)
    total = np.zeros(sae.d_sae, np.float64)
    histograms = np.zeros((sae.d_sae, len(EDGES) - 1), np.int64)
    candidates = []  # (feature, -activation, document, position, window ids, window acts)
    before = window - window // 4 - 1
    for doc, res in enumerate(results):
        acts = res.tracked_acts  # [features, positions]
        fired += (acts > 0).sum(1)
        total += acts.astype(np.float64).sum(1)
        for f in range(sae.d_sae):
            on = acts[f][acts[f] > 0].astype(np.float64)
            np.add.at(histograms[f], np.searchsorted(EDGES[1:-1], on, side="left"), 1)
            if not len(on):
                continue
            p = int(np.argmax(acts[f]))
            span = range(max(0, p - before), min(acts.shape[1], p - before + window))
            ids = tuple(int(res.token_ids[i]) for i in span)
            candidates.append((f, -float(acts[f, p]), doc, p, ids, acts[f, list(span)]))
    candidates.sort(key=lambda c: c[:4])
    top: dict[int, list] = {}
    for c in candidates:
        if len(top.setdefault(c[0], [])) < n:
            top[c[0]].append(c)
    return {"fired": fired, "total": total, "histograms": histograms, "top": top}


def check_equal(stats: ek.FeatureStats, ref: dict, tokens: int) -> None:
    np.testing.assert_array_equal(stats.fired, ref["fired"])
    np.testing.assert_allclose(stats.activation_sum, ref["total"], rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(stats.frequency, ref["fired"] / tokens, atol=1e-6)
    np.testing.assert_allclose(stats.mean, ref["total"] / tokens, rtol=1e-6, atol=1e-9)
    np.testing.assert_array_equal(stats.histograms, ref["histograms"])
    assert stats.n_tokens == tokens
    for f in range(stats.d_sae):
        found = stats.contexts(f)
        expected = ref["top"].get(f, [])
        assert [(c.document, c.position, c.token_ids) for c in found] == [
            (doc, pos, ids) for _, _, doc, pos, ids, _ in expected
        ], f"feature {f}"
        for context, (_, act, _, _, _, acts) in zip(found, expected):
            assert context.activation == pytest.approx(-act, rel=1e-6)
            np.testing.assert_allclose(context.activations, acts, rtol=1e-6, atol=1e-6)
            assert context.activations[context.focus] == pytest.approx(-act, rel=1e-6)


def load_sae(name: str) -> ek.SAE:
    return ek.SAE.load(DATA / name)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", ["saelens_topk", "saelens_standard", "saelens_jumprelu"])
def test_equal_to_the_aggregated_features_of_each_document(tiny_engines, tp, name):
    engine = tiny_engines[tp]
    sae = load_sae(name)
    texts = CORPUS[:12]
    stats = engine.feature_stats(texts, sae, contexts=3, window=6, progress=False)
    tokens = sum(len(engine.tokenizer(t)["input_ids"]) for t in texts)
    check_equal(stats, reference(engine, texts, sae, 3, 6), tokens)
    assert stats.n_documents == 12 and stats.meta["sae"]["key"] == sae.key


def test_many_traces_keep_the_best_contexts(tiny1):
    """Small traces: the thresholds sent to the ranks and the client's merge, trace after
    trace, keep what one trace over everything keeps."""
    sae = load_sae("saelens_topk")
    texts = CORPUS[:12]
    whole = tiny1.feature_stats(texts, sae, contexts=4, window=5, progress=False)
    cut = tiny1.feature_stats(texts, sae, contexts=4, window=5, batch_tokens=40, progress=False)
    np.testing.assert_array_equal(cut.fired, whole.fired)
    np.testing.assert_array_equal(cut.top_documents, whole.top_documents)
    np.testing.assert_array_equal(cut.top_positions, whole.top_positions)
    np.testing.assert_allclose(cut.top_acts, whole.top_acts, rtol=1e-6)
    np.testing.assert_allclose(cut.activation_sum, whole.activation_sum, rtol=1e-6)


@pytest.mark.slow
def test_demo_tp3_equals_the_aggregated_features(demo3):
    """A 4x TopK SAE on demo's layer 10, sharded over three ranks."""
    d = demo3.info.d_model
    generator = torch.Generator().manual_seed(1)
    W_dec = torch.nn.functional.normalize(torch.randn(4 * d, d, generator=generator), dim=-1)
    sae = ek.SAE("topk", W_dec.T.clone(), torch.zeros(4 * d), W_dec, torch.zeros(d), layer=10, k=16)
    texts = CORPUS[:8]
    stats = demo3.feature_stats(texts, sae, contexts=3, window=8, progress=False)
    tokens = sum(len(demo3.tokenizer(t)["input_ids"]) for t in texts)
    check_equal(stats, reference(demo3, texts, sae, 3, 8), tokens)


def test_the_store_opens_without_envoykit_and_as_feature_stats(tiny1, tmp_path):
    sae = load_sae("saelens_topk")
    out = tmp_path / "stats"
    stats = tiny1.feature_stats(CORPUS[:6], sae, contexts=2, window=4, out=out, progress=False)
    index = json.loads((out / "index.json").read_text())
    assert index["complete"] and index["documents"] == 6
    arrays = load_file(str(out / index["file"]))
    np.testing.assert_array_equal(arrays["fired"], stats.fired)
    assert sorted(p.name for p in out.iterdir()) == sorted(["index.json", index["file"]])
    opened = ek.FeatureStats.open(out)
    for name in ("fired", "activation_sum", "histograms", "top_acts", "window_ids"):
        np.testing.assert_array_equal(getattr(opened, name), getattr(stats, name))
    f = int(np.argmax(stats.fired))
    assert opened.contexts(f) == stats.contexts(f)
    assert pickle.loads(pickle.dumps(stats)).contexts(f) == stats.contexts(f)
    # Run again: the store is complete, nothing is read twice.
    again = tiny1.feature_stats(CORPUS[:6], sae, contexts=2, window=4, out=out, progress=False)
    np.testing.assert_array_equal(again.fired, stats.fired)
    with pytest.raises(InvalidRequest, match="other settings"):
        tiny1.feature_stats(CORPUS[:6], sae, contexts=3, window=4, out=out, progress=False)
    with pytest.raises(InvalidRequest, match="not this corpus"):
        tiny1.feature_stats(CORPUS[1:7], sae, contexts=2, window=4, out=out, progress=False)


CHILD = """
import sys
import envoykit as ek
if __name__ == "__main__":
    sae = ek.SAE.load(sys.argv[1])
    corpus = ek.shipped_corpus() * 8
    with ek.Engine("tiny", 1, progress=False) as engine:
        engine.feature_stats(corpus, sae, contexts=3, window=4, out=sys.argv[2],
                             batch_tokens=64, progress=False)
"""


def test_a_killed_run_continues_where_its_store_stopped(tiny1, tmp_path):
    sae = load_sae("saelens_topk")
    out = tmp_path / "stats"
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(CHILD))
    child = subprocess.Popen(
        [sys.executable, str(script), str(DATA / "saelens_topk"), str(out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    index = out / "index.json"
    deadline = time.monotonic() + 300
    while not (index.exists() and json.loads(index.read_text())["documents"] > 0):
        assert child.poll() is None and time.monotonic() < deadline, "the child never wrote"
        time.sleep(0.2)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    cut = json.loads(index.read_text())
    assert not cut["complete"] and 0 < cut["documents"] < len(CORPUS) * 8
    corpus = CORPUS * 8
    resumed = tiny1.feature_stats(
        corpus, sae, contexts=3, window=4, out=out, batch_tokens=64, progress=False
    )
    whole = tiny1.feature_stats(corpus, sae, contexts=3, window=4, batch_tokens=64, progress=False)
    assert resumed.n_tokens == whole.n_tokens and resumed.n_documents == whole.n_documents
    np.testing.assert_array_equal(resumed.fired, whole.fired)
    np.testing.assert_allclose(resumed.activation_sum, whole.activation_sum, rtol=1e-6)
    np.testing.assert_array_equal(resumed.top_documents, whole.top_documents)
    np.testing.assert_array_equal(resumed.top_positions, whole.top_positions)


def test_bad_requests_are_refused_and_leave_the_engine_usable(tiny1, tmp_path):
    sae = load_sae("saelens_topk")
    fields = {name: getattr(sae, name) for name in sae.__dataclass_fields__ if name != "key"}
    other = ek.SAE(**{**fields, "model_name": "SmolLM2-135M-Instruct"})
    for kwargs, message in (
        ({"sae": other}, "model_check=False"),
        ({"sae": "sae/"}, "one ek.SAE"),
        ({"contexts": 0}, "contexts must be"),
        ({"window": 0}, "window must be"),
        ({"contexts": 101}, "at most 100"),
        ({"batch_tokens": 0}, "batch_tokens must be"),
        ({"max_length": 10**6}, "max_model_len"),
    ):
        request = {"sae": sae, **kwargs}
        with pytest.raises(InvalidRequest, match=message):
            tiny1.feature_stats(CORPUS[:2], request.pop("sae"), progress=False, **request)
    with pytest.raises(InvalidRequest, match="empty"):
        tiny1.feature_stats([], sae, progress=False)
    stats = tiny1.feature_stats(CORPUS[:2], sae, contexts=np.int64(2), window=4, progress=False)
    assert stats.top_acts.shape[1] == 2
    for bad in (sae.d_sae, -1, 1.5):
        with pytest.raises(InvalidRequest, match="feature"):
            stats.contexts(bad)
    with pytest.raises(InvalidRequest, match="no feature statistics"):
        ek.FeatureStats.open(tmp_path)


def test_the_dashboard_draws_what_the_statistics_hold(tiny1):
    import matplotlib

    matplotlib.use("Agg")
    sae = load_sae("saelens_topk")
    stats = tiny1.feature_stats(CORPUS, sae, contexts=3, window=6, progress=False)
    f = int(np.argmax(stats.fired))
    logits = tiny1.feature_logits(sae, f, k=4)
    histogram, effects, contexts = ek.plot.feature(stats, f, logits=logits).axes
    assert [bar.get_height() for bar in histogram.patches] == stats.histogram(f)[1].tolist()
    shown = [label.get_text() for label in effects.get_yticklabels()]  # whitespace marked
    assert short(logits.top_tokens[0][0], 12) in shown
    assert short(logits.bottom_tokens[0][0], 12) in shown
    texts = [text.get_text() for text in contexts.texts]
    assert texts == [short(t, 9) for c in stats.contexts(f) for t in c.tokens]
    assert len(contexts.get_yticklabels()) == 3


def test_the_command_line_writes_the_store_and_the_figure(tiny1, tmp_path, capsys):
    import argparse

    import matplotlib

    from envoykit.cli.sae import print_feature_stats

    matplotlib.use("Agg")
    args = argparse.Namespace(
        corpus="shipped",
        sae=DATA / "saelens_topk",
        layer=None,
        site=None,
        out=tmp_path / "stats",
        contexts=2,
        window=4,
        max_length=None,
        feature=3,
        figure=tmp_path / "feature.png",
    )
    print_feature_stats(tiny1, args)
    printed = capsys.readouterr().out
    opened = ek.FeatureStats.open(tmp_path / "stats")
    assert opened.n_documents == len(CORPUS) and opened.meta["complete"]
    best = int(np.argmax(opened.frequency))
    assert f"feature {best:>6}: {opened.frequency[best]:7.2%}" in printed
    assert (tmp_path / "feature.png").stat().st_size > 0 and "feature 3's dashboard" in printed


def test_a_full_disk_is_a_clear_error_and_a_rerun_continues(tiny1, small_disk):
    sae = load_sae("saelens_topk")
    out = small_disk / "stats"  # 1 MiB: the first state (about 1 MiB) does not fit
    kwargs = dict(contexts=20, window=16, out=out, progress=False)
    with pytest.raises(ek.StoreWriteError, match=r"the disk is full.*intact; free space"):
        tiny1.feature_stats(CORPUS, sae, **kwargs)
    assert not list(out.glob("*.tmp"))
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    resumed = tiny1.feature_stats(CORPUS, sae, **kwargs)
    whole = tiny1.feature_stats(CORPUS, sae, contexts=20, window=16, progress=False)
    np.testing.assert_array_equal(resumed.fired, whole.fired)
    np.testing.assert_array_equal(resumed.top_positions, whole.top_positions)
    assert ek.FeatureStats.open(out).meta["complete"]
