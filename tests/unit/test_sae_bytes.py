"""`SAE.to_bytes` / `SAE.from_bytes`, what a connection sends a server: the same SAE back
(its key, tensors and fields), and anything else refused before it could reach a rank."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

import envoykit as ek
from envoykit.errors import InvalidRequest

DATA = Path(__file__).resolve().parents[1] / "data" / "sae"
TENSORS = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")


@pytest.mark.parametrize(
    ("name", "options"),
    [("saelens_jumprelu", {}), ("saelens_topk", {}), ("gemma_scope", {"layer": 3})],
)
def test_round_trip_keeps_key_tensors_and_fields(name, options):
    sae = ek.SAE.load(DATA / name, **options)
    back = ek.SAE.from_bytes(sae.to_bytes())
    assert back.key == sae.key
    for field in dataclasses.fields(sae):
        mine, theirs = getattr(sae, field.name), getattr(back, field.name)
        if isinstance(mine, torch.Tensor):
            assert torch.equal(mine, theirs), field.name
        else:
            assert mine == theirs, field.name
    assert back.threshold is None if name == "saelens_topk" else back.threshold is not None


def bad_blobs() -> dict[str, tuple[bytes, str]]:
    """Bodies that are not an SAE envoykit sent, each with what its refusal says."""
    sae = ek.SAE.load(DATA / "saelens_jumprelu")
    blob = sae.to_bytes()
    _, tensors = sae.to_wire()
    header = int.from_bytes(blob[:8], "little")
    meta = json.loads(blob[8 : 8 + header])["__metadata__"]
    fields = json.loads(meta["envoykit.sae"])
    named = {n: getattr(sae, n) for n in TENSORS}

    def with_fields(**changed) -> bytes:
        return save(named, metadata={"envoykit.sae": json.dumps({**fields, **changed})})

    return {
        "truncated": (blob[: len(blob) // 2], "not an SAE sent by envoykit"),
        "header only": (blob[: 8 + header], "not an SAE sent by envoykit"),
        "empty": (b"", "not an SAE sent by envoykit"),
        "pickle": (b"\x80\x04K\x01.", "not an SAE sent by envoykit"),
        "no config": (tensors, "not an SAE sent by envoykit"),
        "missing field": (
            save(named, metadata={"envoykit.sae": json.dumps({"k": None})}),
            "its fields are",
        ),
        "bool k": (with_fields(k=True), "its k is True"),
        "text layer": (with_fields(layer="3"), "its layer is '3'"),
        "bad site": (with_fields(site="logits"), "site is one of"),
        "no threshold": (
            save({n: named[n] for n in TENSORS[:4]}, metadata=meta),
            "needs its threshold",
        ),
        "other tensors": (save({"x": torch.zeros(1)}, metadata=meta), "holds W_enc, b_enc"),
    }


@pytest.mark.parametrize("case", list(bad_blobs()))
def test_bad_blobs_are_refused(case):
    body, message = bad_blobs()[case]
    with pytest.raises(InvalidRequest, match=message):
        ek.SAE.from_bytes(body)
