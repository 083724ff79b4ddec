"""How the corpus lens groups its documents' lenses into one exchange per group: the rank's
waiting room (`envoykit.ranks.grouped`) and the client's grouping of a batch
(`envoykit.analyses.corpus_lens`)."""

from __future__ import annotations

import torch

from envoykit.analyses import corpus_lens
from envoykit.analyses.corpus import Piece
from envoykit.ranks import grouped


def test_the_invoke_that_completes_a_group_gets_it_in_order_whatever_the_arrival():
    assert grouped.arrive("a", 2, 3, "third") is None
    assert grouped.arrive("b", 0, 1, "alone") == ["alone"]
    assert grouped.arrive("a", 0, 3, "first") is None
    assert grouped.arrive("a", 1, 3, "second") == ["first", "second", "third"]
    assert "a" not in grouped._WAITING


def test_a_group_that_never_completes_is_pushed_out():
    for i in range(grouped._KEPT + 5):
        grouped.arrive(f"stale-{i}", 0, 2, i)
    assert len(grouped._WAITING) == grouped._KEPT
    assert "stale-0" not in grouped._WAITING
    grouped._WAITING.clear()


def pieces(*lengths: int) -> list[Piece]:
    return [Piece(doc=i, start=0, ids=tuple(range(n))) for i, n in enumerate(lengths)]


def test_consecutive_pieces_up_to_the_group_size_a_long_one_alone(monkeypatch):
    monkeypatch.setattr(corpus_lens, "GROUP_POSITIONS", 10)
    groups = corpus_lens._groups(pieces(4, 6, 3, 12, 2, 2))
    keys = [key for key, _, _ in groups]
    assert keys[0] == keys[1] != keys[2]
    assert keys[2] != keys[3] != keys[4] and keys[4] == keys[5]
    assert [(index, size) for _, index, size in groups] == [
        (0, 2), (1, 2), (0, 1), (0, 1), (0, 2), (1, 2)
    ]  # fmt: skip
    assert len(set(keys)) == 4 and corpus_lens._groups(pieces(4))[0][0] not in keys


def test_each_piece_gets_its_sums_from_whichever_invoke_completed_its_group():
    groups = [("g0", 0, 2), ("g0", 1, 2), ("g1", 0, 1)]
    empty = torch.empty(0, 4, 3)
    g0, g1 = torch.rand(2, 4, 3), torch.rand(1, 4, 3)
    by_piece = corpus_lens._by_piece([g0, empty, g1], groups)
    assert torch.equal(by_piece[0], g0[0]) and torch.equal(by_piece[1], g0[1])
    assert torch.equal(by_piece[2], g1[0])
    by_piece = corpus_lens._by_piece([empty, g0, g1], groups)
    assert torch.equal(by_piece[1], g0[1])
