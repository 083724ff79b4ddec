"""Corpus work: `collect` into a store on disk and `lens_corpus`, against independent
references.

References and tolerances:
  * stored float32 activations against plain transformers' residual stream (forward hooks,
    float32): within 1e-4 of the stream's largest magnitude (the engine's and transformers'
    kernels differ in order of summation only); the blocks' writes against hooks on
    ``self_attn``/``mlp`` likewise;
  * a bfloat16 store is the float32 store rounded to bfloat16, bit for bit; TP=2 equals TP=1
    as transformers does;
  * `lens_corpus` against the per-prompt lens of the same documents (the same reductions,
    summed on the client instead of the ranks): KL and entropy within 1e-6, agreement and
    accuracy exactly; against transformers' logits within 1e-4;
  * a killed collection, rerun, gives the store an uninterrupted one gives, bit for bit.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import residual_streams, stream_logits, sublayer_streams
from seeded import seeded_tuned_lens

import envoykit as ek
from envoykit.analyses.tuned import offline_texts

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4
DOCS = [
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "One, two, three, four, five, six, seven.",
    "Monday, Tuesday, Wednesday",
    "The quick brown fox jumps over the lazy dog. A lazy dog sleeps in the warm sun.",
    "Paris",
]


def corpus(n: int, chars: int = 300) -> list[str]:
    """``n`` documents of English text, about ``chars`` characters each."""
    texts = offline_texts()[0]
    return [texts[i % len(texts)][:chars] for i in range(n)]


def assert_stream_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within `TOL` of the largest magnitude in ``expected``."""
    assert got.shape == expected.shape
    scale = float(expected.abs().max())
    assert float((got.float() - expected).abs().max()) <= TOL * max(scale, 1.0), scale


def ids_of(engine: ek.Engine, text: str) -> list[int]:
    return engine.tokenizer(text)["input_ids"]


@pytest.mark.parametrize("tp", [1, 2])
def test_collect_equals_transformers_streams(tiny_engines, tp, tmp_path):
    engine = tiny_engines[tp]
    n = engine.info.n_layers
    store = engine.collect(
        DOCS, out=tmp_path / "s", layers=["embed", "all"], dtype="float32", progress=False
    )
    assert store.complete and store.n_documents == len(DOCS)
    assert store.layers == list(range(n + 1)) and store.sites == ["resid"]
    every = [ids_of(engine, doc) for doc in DOCS]
    np.testing.assert_array_equal(store.token_ids, np.concatenate(every))
    np.testing.assert_array_equal(
        store.documents, np.repeat(np.arange(len(DOCS)), [len(i) for i in every])
    )
    np.testing.assert_array_equal(
        store.positions, np.concatenate([np.arange(len(i)) for i in every])
    )
    for doc, ids in enumerate(every):
        expected = residual_streams(engine.info.path, ids)
        for layer in range(n + 1):
            got = store.document(doc, layer)
            assert got.dtype == torch.float32
            assert_stream_close(got, expected[layer])


def test_collect_sites_equal_transformers_hooks(tiny1, tmp_path):
    store = tiny1.collect(
        DOCS[:2],
        out=tmp_path / "s",
        sites=["attn", "resid_mid", "mlp"],
        dtype="float32",
        progress=False,
    )
    for doc, text in enumerate(DOCS[:2]):
        expected = sublayer_streams(tiny1.info.path, text)
        for layer in store.layers:
            for site in ("attn", "resid_mid", "mlp"):
                assert_stream_close(store.document(doc, layer, site), expected[site][layer - 1])


def test_bfloat16_store_is_the_float32_store_rounded_and_tp2_equals_tp1(tiny_engines, tmp_path):
    full = tiny_engines[2].collect(
        DOCS, out=tmp_path / "f32", layers=[1, 3], dtype="float32", progress=False
    )
    half = tiny_engines[2].collect(DOCS, out=tmp_path / "bf16", layers=[1, 3], progress=False)
    one = tiny_engines[1].collect(
        DOCS, out=tmp_path / "tp1", layers=[1, 3], dtype="float32", progress=False
    )
    for layer in (1, 3):
        assert half.load(layer).dtype == torch.bfloat16
        assert torch.equal(half.load(layer), full.load(layer).bfloat16())
        assert_stream_close(full.load(layer), one.load(layer))


def test_store_opens_without_envoykit(tiny1, tmp_path):
    """The format's promise: safetensors and JSON, read here by a process that never
    imports envoykit."""
    store = tiny1.collect(DOCS, out=tmp_path / "s", layers=[2], dtype="float32", progress=False)
    code = textwrap.dedent(
        f"""
        import json, sys, torch
        from safetensors.torch import load_file
        index = json.load(open({str(tmp_path / "s" / "index.json")!r}))
        parts = [load_file({str(tmp_path / "s")!r} + "/" + s["file"]) for s in index["shards"]]
        x = torch.cat([p["resid.2"] for p in parts])
        print(json.dumps([list(x.shape), float(x.double().sum()), "envoykit" in sys.modules]))
        """
    )
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    shape, total, imported = json.loads(found.stdout)
    assert shape == list(store.load(2).shape) and not imported
    assert total == pytest.approx(float(store.load(2).double().sum()), rel=1e-12)


def test_long_document_is_cut_into_pieces_each_its_own_context(tiny1, tmp_path):
    text = DOCS[0] + " " + DOCS[3]
    ids = ids_of(tiny1, text)
    assert len(ids) > 20
    store = tiny1.collect(
        [text], out=tmp_path / "s", layers=[4], max_length=8, dtype="float32", progress=False
    )
    np.testing.assert_array_equal(store.positions, np.arange(len(ids)))
    np.testing.assert_array_equal(store.token_ids, ids)
    got = store.load(4)
    for start in range(0, len(ids), 8):
        piece = ids[start : start + 8]
        assert_stream_close(
            got[start : start + len(piece)], residual_streams(tiny1.info.path, piece)[4]
        )


def test_a_document_as_long_as_the_context_is_cut_where_a_trace_fits(tiny1, tmp_path):
    """Each trace generates one token, so a piece of the context's whole length does not
    fit: by default pieces are one token shorter, and every token is still collected."""
    ids = list(range(1, 301))  # tiny's context is 256
    store = tiny1.collect([ids], out=tmp_path / "s", layers=[1], progress=False)
    np.testing.assert_array_equal(store.token_ids, ids)
    lens = tiny1.lens_corpus([ids], progress=False, n_boot=10)
    assert lens.n_tokens == 300


def test_positions_are_picked_in_each_piece(tiny1, tmp_path):
    store = tiny1.collect(DOCS, out=tmp_path / "s", layers=[1], positions=[0, -1], progress=False)
    lengths = [len(ids_of(tiny1, doc)) for doc in DOCS]
    expected = [sorted({0, n - 1}) for n in lengths]
    np.testing.assert_array_equal(store.positions, np.concatenate(expected))
    np.testing.assert_array_equal(
        store.documents, np.repeat(np.arange(len(DOCS)), [len(e) for e in expected])
    )


def per_prompt_statistics(results: list[ek.LensResult], top_k: int) -> dict[str, np.ndarray]:
    """The corpus statistics from per-prompt lens results, summed here."""
    kl = np.concatenate([r.kl for r in results], axis=1)
    entropy = np.concatenate([r.entropy for r in results], axis=1)
    agree = np.concatenate(
        [(r.top_ids[:, :, :top_k] == r.top_ids[-1:, :, :1]).any(-1) for r in results], axis=1
    )
    hits = np.concatenate(
        [(r.top_ids[:, :-1, :top_k] == r.token_ids[None, 1:, None]).any(-1) for r in results],
        axis=1,
    )
    return {
        "kl": kl.mean(1),
        "entropy": entropy.mean(1),
        "agreement": agree.mean(1),
        "accuracy": hits.mean(1),
    }


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("top_k", [1, 3])
def test_lens_corpus_equals_the_per_prompt_lens(tiny_engines, tp, top_k):
    engine = tiny_engines[tp]
    texts = corpus(12, 200)
    res = engine.lens_corpus(
        texts, layers=["embed", "all"], top_k=top_k, batch_tokens=256, progress=False
    )
    per_prompt = engine.lens(texts, layers=["embed", "all"], top_k=top_k)
    expected = per_prompt_statistics(per_prompt, top_k)
    assert res.n_documents == len(texts) and res.n_tokens == sum(
        len(r.token_ids) for r in per_prompt
    )
    np.testing.assert_allclose(res.kl, expected["kl"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(res.entropy, expected["entropy"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(res.agreement, expected["agreement"])
    np.testing.assert_array_equal(res.accuracy, expected["accuracy"])
    for name in ("kl", "entropy", "agreement", "accuracy"):
        low, high = getattr(res, f"{name}_ci").T
        mean = getattr(res, name)
        assert (low <= mean + 1e-12).all() and (mean <= high + 1e-12).all()


def test_lens_corpus_against_transformers(tiny1):
    path = tiny1.info.path
    kl, agree, hits, tokens, following = 0.0, 0.0, 0.0, 0, 0
    for text in DOCS:
        ids = ids_of(tiny1, text)
        logp = torch.log_softmax(stream_logits(path, residual_streams(path, ids)).double(), -1)
        final = logp[-1]
        kl = kl + (final.exp() * (final - logp)).sum(-1).sum(-1)
        top = logp.argmax(-1)
        agree = agree + (top == top[-1]).double().sum(-1)
        hits = hits + (top[:, :-1] == torch.tensor(ids[1:])).double().sum(-1)
        tokens, following = tokens + len(ids), following + len(ids) - 1
    res = tiny1.lens_corpus(DOCS, layers=["embed", "all"], progress=False)
    np.testing.assert_allclose(res.kl, (kl / tokens).numpy(), atol=TOL)
    np.testing.assert_allclose(res.agreement, (agree / tokens).numpy(), atol=1e-12)
    np.testing.assert_allclose(res.accuracy, (hits / following).numpy(), atol=1e-12)


@pytest.mark.skipif(not shutil.which("g++"), reason="no C++ compiler for torch's inductor")
def test_the_ranks_reduce_a_corpus_with_compiled_loops(tiny2):
    """The rank's eager stance (`envoykit.ranks.cpu`) must not turn the corpus lens's compiled
    reductions (`envoykit.ranks.fused`) back into torch's passes: the first rank compiled
    their graphs."""
    import nnsight

    tiny2.lens_corpus(DOCS[:2], progress=False)
    with tiny2.trace(DOCS[0]):
        from torch._dynamo.utils import counters

        compiled = nnsight.save(counters["stats"]["unique_graphs"])
    assert compiled >= 2  # final_sums and layer_sums


def test_tuned_lens_corpus_equals_the_per_prompt_tuned_lens(tiny2):
    tuned = seeded_tuned_lens(tiny2)
    texts = corpus(4, 200)
    res = tiny2.lens_corpus(texts, layers=["embed", "all"], translator=tuned, progress=False)
    assert res.meta["lens"] == "tuned"
    per_prompt = [tiny2.lens(text, layers=["embed", "all"], translator=tuned) for text in texts]
    expected = per_prompt_statistics(per_prompt, 1)
    np.testing.assert_allclose(res.kl, expected["kl"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(res.agreement, expected["agreement"])
    plain = tiny2.lens_corpus(texts, layers=["embed", "all"], progress=False)
    assert not np.allclose(plain.kl[:-1], res.kl[:-1], atol=1e-3)


KILLED_COLLECT = """
import envoykit as ek
if __name__ == "__main__":
    texts = {texts!r}
    with ek.Engine("tiny", 1, progress=False) as engine:
        print("STARTED", flush=True)
        engine.collect(texts, out={out!r}, layers=[1, 3], batch_tokens=64, progress=False)
"""


def test_a_killed_collection_resumes_to_the_uninterrupted_store(tiny1, tmp_path):
    texts = corpus(150, 200)
    out = tmp_path / "killed"
    script = KILLED_COLLECT.format(texts=texts, out=str(out))
    process = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    )
    try:
        assert process.stdout.readline().strip() == "STARTED"
        deadline = time.monotonic() + 300
        while not _shards_written(out, 3):
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
    finally:
        process.kill()
        process.wait()
    partial = ek.Activations.open(out)
    assert not partial.complete and 0 < partial.n_documents < len(texts)
    resumed = tiny1.collect(texts, out=out, layers=[1, 3], batch_tokens=64, progress=False)
    whole = tiny1.collect(
        texts, out=tmp_path / "whole", layers=[1, 3], batch_tokens=64, progress=False
    )
    assert resumed.complete and resumed.n_documents == len(texts) == whole.n_documents
    assert not list(out.glob("*.tmp"))
    for layer in (1, 3):
        assert torch.equal(resumed.load(layer), whole.load(layer))
    np.testing.assert_array_equal(resumed.documents, whole.documents)
    np.testing.assert_array_equal(resumed.positions, whole.positions)


def _shards_written(out: Path, n: int) -> bool:
    try:
        return len(json.loads((out / "index.json").read_text())["shards"]) >= n
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def test_a_rerun_of_a_complete_store_computes_nothing_and_changes_nothing(tiny1, tmp_path):
    store = tiny1.collect(DOCS, out=tmp_path / "s", layers=[1], progress=False)
    before = {p.name: p.stat().st_mtime_ns for p in store.shard_files}
    again = tiny1.collect(DOCS, out=tmp_path / "s", layers=[1], progress=False)
    assert {p.name: p.stat().st_mtime_ns for p in again.shard_files} == before
    assert torch.equal(again.load(1), store.load(1))


def unchanged(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_another_models_or_corpus_or_settings_store_is_refused_untouched(tiny1, demo3, tmp_path):
    out = tmp_path / "s"
    tiny1.collect(DOCS, out=out, layers=[1], progress=False)
    before = unchanged(out)
    with pytest.raises(ek.InvalidRequest, match="collected on 'tiny'"):
        demo3.collect(DOCS, out=out, layers=[1], progress=False)
    with pytest.raises(ek.InvalidRequest, match="other settings: rows"):
        tiny1.collect(DOCS, out=out, layers=[2], progress=False)
    with pytest.raises(ek.InvalidRequest, match="not this corpus's"):
        tiny1.collect(list(reversed(DOCS)), out=out, layers=[1], progress=False)
    with pytest.raises(ek.InvalidRequest, match="more than this corpus's"):
        tiny1.collect(DOCS[:2], out=out, layers=[1], progress=False)
    assert unchanged(out) == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ek.InvalidRequest, match="holds no activation store"):
        tiny1.collect(DOCS, out=tmp_path / "other", progress=False)
    assert unchanged(tmp_path / "other") == {"notes.txt": b"mine"}
    with pytest.raises(ek.InvalidRequest, match="no activation store"):
        ek.Activations.open(tmp_path / "other")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"texts": []}, "corpus is empty"),
        ({"texts": iter(())}, "corpus is empty"),
        ({"texts": "one string"}, "not one string"),
        ({"texts": ["ok", 3]}, "document 1 is a int"),
        ({"texts": [[1, 2, 10**9]]}, "outside the vocabulary"),
        ({"texts": DOCS, "max_length": 10**6}, "exceeds 255, the engine's max_model_len=256"),
        ({"texts": DOCS, "max_length": 256}, "less the one token each trace generates"),
        ({"texts": DOCS, "dtype": "int8"}, "dtype must be one of"),
        ({"texts": DOCS, "positions": ["last"]}, "positions are integers"),
        ({"texts": DOCS, "layers": [99]}, "does not exist"),
        ({"texts": DOCS, "batch_tokens": 0}, "batch_tokens must be"),
    ],
)
def test_bad_collect_requests_are_refused_and_the_engine_answers(tiny1, tmp_path, kwargs, match):
    texts = kwargs.pop("texts")
    with pytest.raises(ek.InvalidRequest, match=match):
        tiny1.collect(texts, out=tmp_path / "s", progress=False, **kwargs)
    # Refused before the store exists, but a bad document found on the way (the store holds
    # what came before it).
    assert not (tmp_path / "s" / "index.json").exists() or "document" in match or "vocab" in match
    assert tiny1.lens("Paris", top_k=1).top_ids.shape[0] == tiny1.info.n_layers


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"texts": []}, "corpus is empty"),
        ({"texts": [""]}, "no tokens"),
        ({"texts": DOCS, "top_k": 0}, "top_k must be"),
        ({"texts": DOCS, "confidence": 1.5}, "confidence"),
    ],
)
def test_bad_lens_corpus_requests_are_refused(tiny1, kwargs, match):
    texts = kwargs.pop("texts")
    if texts == [""] and tiny1.tokenizer("")["input_ids"]:
        pytest.skip("this tokenizer gives an empty text a token")
    with pytest.raises(ek.InvalidRequest, match=match):
        tiny1.lens_corpus(texts, progress=False, **kwargs)


def test_a_full_disk_is_a_clear_error_and_keeps_the_shards_written(tiny1, small_disk):
    out = small_disk / "s"
    texts = corpus(60, 300)  # tiny: 128 floats a token; about 4 MiB in float32
    with pytest.raises(ek.StoreWriteError, match=r"the disk is full.*intact; free space"):
        tiny1.collect(
            texts, out=out, layers=[1, 2], dtype="float32", batch_tokens=256, progress=False
        )
    kept = ek.Activations.open(out)
    assert len(kept.shard_files) >= 1 and not kept.complete and not list(out.glob("*.tmp"))
    first = kept.load(1)
    assert first.shape[0] == len(kept)
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    resumed = tiny1.collect(
        texts, out=out, layers=[1, 2], dtype="float32", batch_tokens=256, progress=False
    )
    assert resumed.complete and torch.equal(resumed.load(1)[: first.shape[0]], first)


def test_demo_tp3_collect_and_lens_corpus_equal_per_prompt_traces(demo3, tmp_path):
    texts = corpus(12, 400)
    store = demo3.collect(
        texts, out=tmp_path / "s", layers=[10, 30], dtype="float32", progress=False
    )
    model = demo3.model
    for doc in (0, 5, 11):
        with demo3.trace(texts[doc]):
            mid = model.model.layers[9].output
            last = model.model.layers[29].output
            mid = (mid[0] + mid[1]).save()
            last = (last[0] + last[1]).save()
        # A document prefilled among others rounds differently in float32 from the same
        # document alone (other GEMM shapes; vLLM may split a prefill over two steps): seen
        # up to 7e-4 apart. So `TOL` of the stream's largest value, as elsewhere here.
        assert_stream_close(store.document(doc, 10), mid)
        assert_stream_close(store.document(doc, 30), last)
    res = demo3.lens_corpus(texts, progress=False)
    expected = per_prompt_statistics(demo3.lens(texts, top_k=1), 1)
    np.testing.assert_allclose(res.kl, expected["kl"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(res.agreement, expected["agreement"])
    np.testing.assert_array_equal(res.accuracy, expected["accuracy"])
    assert res.accuracy[-1] > 0.2  # a real model predicts English text
    assert res.kl[0] > res.kl[-2] > 0


def test_memory_does_not_grow_with_the_corpus(demo3, tmp_path):
    """Bounded memory: the peak memory of this process, the engine core and every rank while
    collecting four times the corpus exceeds their peak for the corpus once by less than a
    quarter of what the larger store holds (batches are the same size; what is left is the
    allocators' slack: measured on demo, a rank's resident size rose 52 MB over ten
    collections of 212 MB each, by 1-2 MB a collection at the end)."""
    texts = corpus(16, 400)

    def collect(name: str, docs: list[str]) -> None:
        demo3.collect(docs, out=tmp_path / name, layers="all", batch_tokens=512, progress=False)

    collect("warm", texts * 4)  # the first batches size the allocators
    once = peak_memory(demo3, lambda: collect("once", texts))
    four = peak_memory(demo3, lambda: collect("four", texts * 4))
    stored = sum(f.stat().st_size for f in (tmp_path / "four").iterdir())
    grown = [b - a for a, b in zip(once, four)]
    assert max(grown) < stored / 4, (grown, stored)


def peak_memory(engine: ek.Engine, work) -> list[int]:
    """The largest resident size of this process and each engine process while ``work`` runs."""
    import threading

    import psutil

    processes = [psutil.Process(), *engine.processes]
    peaks = [p.memory_info().rss for p in processes]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            for i, process in enumerate(processes):
                peaks[i] = max(peaks[i], process.memory_info().rss)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return peaks


def test_corpus_panel_runs_cancels_and_escapes(tiny2):
    pytest.importorskip("ipywidgets")
    from envoykit.explorer import CorpusPanel, LensExplorer

    texts = ["<b>bold</b> & more text here", *DOCS]
    panel = CorpusPanel(tiny2, texts=texts)
    assert panel.start()
    assert panel.wait(120)
    res = panel.result
    expected = tiny2.lens_corpus(texts, layers=["embed", "all"], progress=False)
    np.testing.assert_allclose(res.kl, expected.kl, atol=1e-9)
    assert panel.figure is not None and panel.view.outputs[0]["data"]["image/png"]
    assert f"{expected.n_documents} documents, {expected.n_tokens} tokens" in panel.header.value
    assert panel.progress.value == panel.progress.max and not panel.button.disabled
    # Cancel between batches: the panel says so, and the engine answers at once.
    panel.texts.value = "\n".join(corpus(400, 300))
    assert panel.start()
    deadline = time.monotonic() + 120
    while "tokens/s" not in panel.header.value:  # the first batch is done
        assert time.monotonic() < deadline
        time.sleep(0.01)
    panel.cancel_button.click()
    assert panel.wait(120) and "cancelled after" in panel.header.value
    assert panel.progress.value < panel.progress.max
    assert panel.result is None and not panel.button.disabled and panel.cancel_button.disabled
    assert tiny2.lens("Paris", top_k=1).top_ids.shape[0] == tiny2.info.n_layers
    panel.texts.value = "  \n "
    assert panel.run() is None and "no documents" in panel.header.value
    explorer = LensExplorer(tiny2, prompt="Paris")
    assert explorer.corpus_panel in explorer.panels.children
