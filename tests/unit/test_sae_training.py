"""`ek.train_sae` on synthetic activations with a known sparse structure, no engine.

The data: ``x = codes @ D + offset + noise``, ``D`` 64 unit atoms in 32 dimensions, two
atoms active per token (values in [1, 5]), a constant offset and noise of 0.01 per
dimension. References and thresholds:
  * a TopK SAE trained on it explains at least 90% of the held-out rows' variance; a
    random SAE of the same initialisation (unit random decoder, encoder its transpose,
    ``b_dec`` the mean) explains at most 50% (about 30% measured);
  * a store and the same rows in memory train the same SAE bit for bit, whatever the shards'
    sizes, in float32 and in bfloat16; two runs with one seed are equal, two seeds differ;
  * the input scale is folded into the weights: training on ``4 x`` gives the SAE of ``x``
    with the encoder divided by 4 and the decoder times 4, exactly (a power of two);
  * SAELens 6.54.12 encodes the SAE envoykit saved (tests/data/sae/trained_topk, made by
    make_trained.py) as envoykit does, within 1e-6.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import envoykit as ek
from envoykit.errors import InvalidRequest
from envoykit.results.activations import StoreWriter, as_rows, row_key, text_chain

DATA = Path(__file__).resolve().parents[1] / "data" / "sae"
LAYER = 3
# Shards of uneven sizes, one smaller than a batch: their boundaries fall anywhere.
SHARDS = (1500, 37, 2600, 463, 3400)
# A small TopK run: 128 latents, k=4, 256 tokens a step, 100k tokens (about 390 steps).
RUN = {"layer": LAYER, "d_sae": 128, "k": 4, "batch_size": 256, "progress": False}


def synthetic(n: int = sum(SHARDS), d: int = 32, atoms: int = 64, active: int = 2) -> torch.Tensor:
    """``[n, d]`` activations made of ``active`` of ``atoms`` unit directions per row."""
    generator = torch.Generator().manual_seed(1234)
    dictionary = torch.nn.functional.normalize(torch.randn(atoms, d, generator=generator), dim=-1)
    picked = torch.rand(n, atoms, generator=generator).argsort(1)[:, :active]
    values = torch.rand(n, active, generator=generator) * 4 + 1
    codes = torch.zeros(n, atoms).scatter(1, picked, values)
    offset = 0.5 * torch.randn(d, generator=generator)
    return codes @ dictionary + offset + 0.01 * torch.randn(n, d, generator=generator)


X = synthetic()


def write_store(
    path: Path, x: torch.Tensor, sizes=SHARDS, dtype: str = "float32", layer: int = LAYER
) -> ek.Activations:
    """A store laid out as ``engine.collect`` writes one: one shard per size, each its own
    document."""
    settings = {
        "model": {"name": "synthetic", "d_model": x.shape[1]},
        "rows": as_rows([(layer, "resid")]),
        "positions": None,
        "dtype": dtype,
        "max_length": 4096,
    }
    writer = StoreWriter.open(path, settings)
    start, chain = 0, ""
    for doc, size in enumerate(sizes):
        chain = text_chain(chain, str(doc))
        rows = x[start : start + size]
        tensors = {
            row_key(layer, "resid"): rows.to(getattr(torch, dtype)).contiguous(),
            "token_ids": torch.zeros(size, dtype=torch.int64),
            "document": torch.full((size,), doc, dtype=torch.int64),
            "position": torch.arange(size, dtype=torch.int64),
        }
        writer.add_shard(tensors, doc + 1, chain)
        start += size
    writer.finish(len(sizes), chain)
    return ek.Activations.open(path)


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> ek.Activations:
    return write_store(tmp_path_factory.mktemp("store") / "acts", X)


def held_out(x: torch.Tensor) -> torch.Tensor:
    """The rows train_sae keeps out: the last tenth (at most 4096)."""
    return x[-min(4096, round(0.1 * len(x))) :]


def variance_explained(sae: ek.SAE, x: torch.Tensor) -> float:
    recon = sae.decode(sae.encode(x))
    return 1.0 - float((x - recon).pow(2).sum() / (x - x.mean(0)).pow(2).sum())


def same(a: ek.SAE, b: ek.SAE) -> bool:
    return all(
        torch.equal(getattr(a, n), getattr(b, n)) for n in ("W_enc", "b_enc", "W_dec", "b_dec")
    )


def log_of(out: Path) -> dict:
    return json.loads((out / "training_log.json").read_text())


class TestLearnsTheDictionary:
    """Training recovers the sparse structure far beyond a random SAE of its initialisation."""

    def test_topk(self, store, tmp_path):
        sae = ek.train_sae(store, **RUN, max_tokens=100_000, out=tmp_path / "sae")
        generator = torch.Generator().manual_seed(7)
        directions = torch.randn(128, X.shape[1], generator=generator)
        decoder = torch.nn.functional.normalize(directions, dim=-1)
        floor = ek.SAE("topk", decoder.T.clone(), torch.zeros(128), decoder, X.mean(0), 3, k=4)
        trained, random = (
            variance_explained(sae, held_out(X)),
            variance_explained(floor, held_out(X)),
        )
        assert trained >= 0.9 and random <= 0.5, (trained, random)
        assert torch.equal((sae.encode(X) > 0).sum(-1), torch.full((len(X),), 4))
        # The log's first record is the initial SAE: the same kind of floor.
        assert log_of(tmp_path / "sae")["records"][0]["held_out_variance_explained"] <= 0.5

    def test_relu(self, store):
        relu = {**RUN, "architecture": "relu", "k": None, "l1_coefficient": 1.0, "lr": 3e-3}
        sae = ek.train_sae(store, **relu, max_tokens=60_000)
        acts = sae.encode(held_out(X))
        assert sae.architecture == "relu" and sae.k is None
        assert variance_explained(sae, held_out(X)) >= 0.8
        assert float((acts > 0).sum(-1).float().mean()) <= 128 / 4


class TestDeterminism:
    """One seed, one SAE: from a store or from memory, bit for bit; another seed, another."""

    @pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
    def test_store_equals_memory_bit_for_bit(self, tmp_path, dtype):
        store = write_store(tmp_path / "acts", X, dtype=dtype)
        # A buffer of four batches: it is refilled many times, and a pass ends mid-buffer.
        run = {**RUN, "max_tokens": 12_000, "buffer_tokens": 1024}
        from_store = ek.train_sae(store, **run)
        from_path = ek.train_sae(str(tmp_path / "acts"), **run)
        from_memory = ek.train_sae(store.load(LAYER), **run)
        assert same(from_store, from_memory) and same(from_store, from_path)
        if dtype == "float32":
            assert same(from_store, ek.train_sae(X, **run))

    def test_shard_sizes_do_not_matter(self, store, tmp_path):
        other = write_store(tmp_path / "acts", X, sizes=(4000, 4000))
        run = {**RUN, "max_tokens": 6000, "buffer_tokens": 1024}
        assert same(ek.train_sae(store, **run), ek.train_sae(other, **run))

    def test_seeds(self, store):
        run = {**RUN, "max_tokens": 6000}
        first, again = ek.train_sae(store, **run, seed=1), ek.train_sae(store, **run, seed=1)
        other = ek.train_sae(store, **run, seed=2)
        assert same(first, again) and not torch.equal(first.W_dec, other.W_dec)


class TestBudget:
    """A run ends at its budget and returns the best SAE on the held-out rows."""

    def test_tokens(self, store, tmp_path):
        sae = ek.train_sae(store, **RUN, max_tokens=5000, out=tmp_path / "sae")
        log = log_of(tmp_path / "sae")
        assert log["stopped"] == "max_tokens" and log["records"][-1]["tokens"] == 5000
        best = max(r["held_out_variance_explained"] for r in log["records"])
        assert log["best"]["held_out_variance_explained"] == best
        assert math.isclose(variance_explained(sae, held_out(X)), best, abs_tol=1e-5)

    def test_one_pass_without_a_budget(self, store, tmp_path):
        ek.train_sae(store, **RUN, out=tmp_path / "sae")
        log = log_of(tmp_path / "sae")
        rows = log["settings"]["training_rows"]
        assert log["stopped"] == "one pass" and log["records"][-1]["tokens"] == rows
        assert rows + log["settings"]["held_out_rows"] == len(X)

    def test_seconds(self, store, tmp_path):
        sae = ek.train_sae(store, **RUN, max_seconds=1.0, out=tmp_path / "sae")
        log = log_of(tmp_path / "sae")
        assert log["stopped"] == "max_seconds" and log["records"][-1]["step"] >= 1
        best = max(r["held_out_variance_explained"] for r in log["records"])
        assert math.isclose(variance_explained(sae, held_out(X)), best, abs_tol=1e-5)


class TestSavedSAE:
    """What `out` holds is an SAELens SAE of raw activations, named after the store."""

    def test_files_reload_and_encode_identically(self, store, tmp_path):
        sae = ek.train_sae(store, **RUN, max_tokens=3000, seed=5, out=tmp_path / "sae")
        assert sorted(p.name for p in (tmp_path / "sae").iterdir()) == [
            "cfg.json",
            "sae_weights.safetensors",
            "training_log.json",
        ]
        again = ek.SAE.load(tmp_path / "sae")
        assert again.key == sae.key and torch.equal(again.encode(X), sae.encode(X))
        assert (again.layer, again.site, again.model_name) == (LAYER, "resid", "synthetic")
        cfg = json.loads((tmp_path / "sae" / "cfg.json").read_text())
        assert cfg["normalize_activations"] == "none" and cfg["architecture"] == "topk"
        assert cfg["metadata"]["hook_name"] == f"blocks.{LAYER - 1}.hook_resid_post"
        settings = log_of(tmp_path / "sae")["settings"]
        assert (settings["seed"], settings["k"], settings["d_sae"]) == (5, 4, 128)

    def test_the_input_scale_is_folded(self):
        run = {**RUN, "max_tokens": 3000}
        plain, scaled = ek.train_sae(X, **run), ek.train_sae(X * 4, **run)
        assert torch.equal(scaled.W_enc, plain.W_enc / 4)
        assert torch.equal(scaled.W_dec, plain.W_dec * 4)
        assert torch.equal(scaled.b_dec, plain.b_dec * 4)
        assert torch.equal(scaled.encode(X * 4), plain.encode(X))

    def test_saelens_encodes_it_as_envoykit_does(self):
        """SAELens's own loader and encode, run by make_trained.py, on envoykit's files."""
        sae = ek.SAE.load(DATA / "trained_topk")
        expected = load_file(DATA / "trained_topk" / "saelens_expected.safetensors")
        acts = sae.encode(expected["x"])
        assert torch.equal(acts > 0, expected["acts"] > 0)
        assert float((acts - expected["acts"]).abs().max()) <= 1e-6
        recon = sae.decode(acts)
        assert float((recon - expected["recon"]).abs().max()) <= 1e-6 * max(
            1.0, float(expected["recon"].abs().max())
        )


def test_nothing_but_the_tensor_is_an_engine():
    with pytest.raises(InvalidRequest, match="not list"):
        ek.train_sae([[1.0, 2.0]], layer=1)


class FakeEngine:
    def collect(self, *args, **kwargs):  # pragma: no cover - never reached
        raise AssertionError("collect ran for a refused request")


BAD = [
    ({"layer": 2}, r"holds no \(2, 'resid'\) activations: it holds \[\(3, 'resid'\)\]"),
    ({"site": "mlp"}, r"holds no \(3, 'mlp'\)"),
    ({"site": "logits"}, "site is one of"),
    ({"layer": -1}, "layer must be an integer >= 0"),
    ({"d_sae": 0}, "d_sae must be an integer >= 1"),
    ({"k": 0}, "k must be an integer >= 1"),
    ({"k": 129}, r"k is at most d_sae \(128\)"),
    ({"k": True}, "k must be an integer"),
    ({"max_seconds": 0}, "max_seconds must be a finite number > 0"),
    ({"max_seconds": -3.0}, "max_seconds must be a finite number > 0"),
    ({"max_seconds": math.nan}, "max_seconds must be a finite number > 0"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"max_tokens": -100}, "max_tokens must be an integer >= 1"),
    ({"batch_size": 0}, "batch_size must be an integer >= 1"),
    ({"lr": 0.0}, "lr must be a finite number > 0"),
    ({"expansion": -1}, "expansion must be a finite number > 0"),
    ({"architecture": "jumprelu"}, "training a JumpReLU SAE is not supported"),
    ({"architecture": "gated"}, "trains architecture 'topk' or 'relu'"),
    ({"architecture": "relu", "k": 8}, "k is TopK's"),
    ({"l1_coefficient": 1.0}, "l1_coefficient is ReLU's"),
    ({"architecture": "relu", "k": None, "l1_coefficient": -1.0}, "l1_coefficient must be"),
    ({"texts": ["a text"]}, "texts= is what an engine source collects"),
    ({"seed": 1.5}, "seed must be an integer"),
]


class TestRefusals:
    """Every bad request is an InvalidRequest saying what to do, before any training."""

    @pytest.mark.parametrize(("change", "message"), BAD, ids=[str(c) for c, _ in BAD])
    def test_bad_arguments(self, store, tmp_path, change, message):
        request = {**RUN, "out": tmp_path / "sae", **change}
        with pytest.raises(InvalidRequest, match=message):
            ek.train_sae(store, **request)
        assert not (tmp_path / "sae").exists()

    def test_an_empty_store(self, tmp_path):
        empty = write_store(tmp_path / "acts", X[:0], sizes=())
        with pytest.raises(InvalidRequest, match="holds 0 tokens: an SAE needs at least 3"):
            ek.train_sae(empty, **RUN)

    def test_a_path_without_a_store(self, tmp_path):
        with pytest.raises(InvalidRequest, match="holds no activation store"):
            ek.train_sae(tmp_path, **RUN)

    def test_a_non_finite_activation(self, tmp_path):
        bad = X.clone()
        bad[4321, 7] = math.inf
        store = write_store(tmp_path / "acts", bad)
        with pytest.raises(InvalidRequest, match=r"row 4321 of the store at .* holds NaN or inf"):
            ek.train_sae(store, **RUN, out=tmp_path / "sae")
        assert not (tmp_path / "sae").exists()
        bad[4321, 7] = math.nan
        with pytest.raises(InvalidRequest, match="row 4321 of the tensor holds NaN"):
            ek.train_sae(bad, **RUN)

    def test_constant_rows(self):
        with pytest.raises(InvalidRequest, match="are all the same vector"):
            ek.train_sae(torch.ones(100, 8), **RUN)

    def test_a_tensor_that_is_not_rows(self):
        with pytest.raises(InvalidRequest, match=r"\[tokens, d_in\] floating point"):
            ek.train_sae(torch.ones(10), **RUN)
        with pytest.raises(InvalidRequest, match=r"\[tokens, d_in\] floating point"):
            ek.train_sae(torch.ones(10, 4, dtype=torch.int64), **RUN)

    def test_an_engine_without_texts(self):
        with pytest.raises(InvalidRequest, match="texts= is what an engine source collects"):
            ek.train_sae(FakeEngine(), **RUN)

    def test_an_engine_with_bad_arguments_collects_nothing(self):
        with pytest.raises(InvalidRequest, match="k must be an integer >= 1"):
            ek.train_sae(FakeEngine(), texts=["a text"], **{**RUN, "k": 0})

    def test_out_is_a_file(self, store, tmp_path):
        (tmp_path / "file").write_text("")
        with pytest.raises(InvalidRequest, match="is a file: give a directory"):
            ek.train_sae(store, **RUN, out=tmp_path / "file")


def test_the_command_line_trains_and_saves_without_an_engine(store, tmp_path, capsys):
    from envoykit import cli

    out = tmp_path / "sae"
    argv = ["train-sae", str(store.path), "--layer", str(LAYER), "--out", str(out), "--max-tokens"]
    assert cli.main([*argv, "4096", "--d-sae", "64", "--k", "4", "--batch-size", "512"]) == 0
    log = log_of(out)
    printed = capsys.readouterr().out
    assert f"{log['best']['held_out_variance_explained']:.4f}" in printed
    assert ek.SAE.load(out).d_sae == 64
    assert cli.main(["train-sae", str(store.path), "--layer", "9", "--out", str(out)]) == 2
    assert "(9, 'resid')" in capsys.readouterr().err
