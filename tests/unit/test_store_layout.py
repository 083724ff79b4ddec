"""A shard laid out before its rows exist (`StoreWriter.open_shard`) and written piece by
piece at its offsets (`write_rows`, as a collection's first rank writes it) holds what
safetensors' own writer writes for the same tensors, read back with safetensors' reader (which
checks the header's offsets cover the data exactly)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, load_file, save

import envoykit as ek
from envoykit.results.activations import FORMAT, PLACES, StoreWriter, write_rows

KEYS = ["resid.3", "mlp.7", "attn.0"]


def open_writer(path, d_model: int, dtype: str) -> StoreWriter:
    rows = [[int(key.split(".")[1]), key.split(".")[0]] for key in KEYS]
    settings = {"model": {"d_model": d_model}, "rows": rows, "positions": None, "dtype": dtype}
    return StoreWriter.open(path, {**settings, "max_length": 64})


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("d_model", [5, 64])  # 5: rows that do not end 8-byte aligned
def test_a_shard_written_at_its_offsets_equals_safetensors_own(tmp_path, dtype, d_model):
    generator = torch.Generator().manual_seed(d_model)
    sizes = [3, 0, 4, 1]  # tokens kept per piece; a piece may keep none
    pieces = [
        torch.randn(len(KEYS), n, d_model, generator=generator).to(getattr(torch, dtype))
        for n in sizes
    ]
    places = {key: torch.arange(sum(sizes)) * (i + 2) for i, key in enumerate(PLACES)}
    writer = open_writer(tmp_path / "store", d_model, dtype)
    shard = writer.open_shard(KEYS, sum(sizes), d_model, dtype)
    written, first = 0, 0
    for piece in pieces:  # in the order of the trace's invokes, as the first rank writes them
        written += write_rows(str(shard.path), shard.offsets(KEYS, first), list(piece))
        first += piece.shape[1]
    assert written == shard.row_bytes
    writer.close_shard(shard, places, documents=4, chain="c")

    file = tmp_path / "store" / "shard-00000.safetensors"
    expected = {key: torch.cat([piece[i] for piece in pieces]) for i, key in enumerate(KEYS)}
    reference = save({**expected, **places}, metadata={"format": FORMAT})
    got, want = load_file(str(file)), load(reference)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    with safe_open(str(file), "pt") as handle:
        assert handle.metadata() == {"format": FORMAT}
    assert file.stat().st_size == len(reference)  # the same bytes of data, no gap, no tail
    store = ek.Activations.open(tmp_path / "store")
    assert (
        len(store) == sum(sizes)
        and store.n_documents == 4
        and not list((tmp_path / "store").glob("*.tmp"))
    )


def test_shards_are_numbered_in_turn_whichever_writer_wrote_them(tmp_path):
    writer = open_writer(tmp_path / "store", 4, "float32")
    tensors = {
        "resid.3": torch.ones(2, 4),
        **{key: torch.zeros(2, dtype=torch.int64) for key in PLACES},
    }
    writer.add_shard(tensors, 1, "a")
    shard = writer.open_shard(["resid.3"], 1, 4, "float32")
    write_rows(str(shard.path), shard.offsets(["resid.3"], 0), [torch.full((1, 4), 2.0)])
    writer.close_shard(shard, {key: torch.ones(1, dtype=torch.int64) for key in PLACES}, 2, "b")
    store = ek.Activations.open(tmp_path / "store")
    assert [f.name for f in store.shard_files] == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]
    assert store.load(3).tolist() == [[1.0] * 4] * 2 + [[2.0] * 4]
    assert store.documents.tolist() == [0, 0, 1]
