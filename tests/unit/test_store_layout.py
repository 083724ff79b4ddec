"""A shard laid out before its rows exist (`StoreWriter.open_shard`) and written row by row at
its offsets (`write_rows`, as a collection's ranks write it: each its share of the rows, in
any order) holds what safetensors' own writer writes for the same tensors, read back with
safetensors' reader (which checks that the header's offsets cover the data exactly)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, load_file, save

import envoykit as ek
from envoykit.results.activations import FORMAT, PLACES, StoreWriter
from envoykit.results.shard_file import write_rows

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
    firsts = [sum(sizes[:i]) for i in range(len(sizes))]
    places = {key: torch.arange(sum(sizes)) * (i + 2) for i, key in enumerate(PLACES)}
    writer = open_writer(tmp_path / "store", d_model, dtype)
    shard = writer.open_shard(KEYS, sum(sizes), d_model, dtype)
    for rank in (1, 0):  # two ranks, each every other row of every piece, the second first
        for piece, first in zip(pieces, firsts):
            mine = range(rank, len(KEYS), 2)
            write_rows(
                str(shard.path),
                [shard.offsets(KEYS, first)[i] for i in mine],
                [piece[i] for i in mine],
                piece.shape[1] * shard.token_bytes,
            )
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
    assert len(store) == sum(sizes) and store.n_documents == 4
    assert not list((tmp_path / "store").glob("*.tmp"))


def test_a_row_of_another_size_than_laid_out_is_refused_before_it_is_written(tmp_path):
    writer = open_writer(tmp_path / "store", 4, "float32")
    shard = writer.open_shard(KEYS, 2, 4, "float32")
    before = shard.path.read_bytes()
    with pytest.raises(ValueError, match="is 40 bytes; the shard laid out 32"):
        write_rows(str(shard.path), shard.offsets(KEYS, 0)[:1], [torch.ones(2, 5)], 32)
    assert shard.path.read_bytes() == before


def test_shards_are_numbered_in_turn_whichever_writer_wrote_them(tmp_path):
    writer = open_writer(tmp_path / "store", 4, "float32")
    tensors = {
        **{key: torch.full((2, 4), 1.0) for key in KEYS},
        **{key: torch.zeros(2, dtype=torch.int64) for key in PLACES},
    }
    writer.add_shard(tensors, 1, "a")
    shard = writer.open_shard(KEYS, 1, 4, "float32")
    rows = [torch.full((1, 4), 2.0)] * len(KEYS)
    write_rows(str(shard.path), shard.offsets(KEYS, 0), rows, shard.token_bytes)
    writer.close_shard(shard, {key: torch.ones(1, dtype=torch.int64) for key in PLACES}, 2, "b")
    store = ek.Activations.open(tmp_path / "store")
    assert [f.name for f in store.shard_files] == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]
    assert store.load(3).tolist() == [[1.0] * 4] * 2 + [[2.0] * 4]
    assert store.documents.tolist() == [0, 0, 1]
