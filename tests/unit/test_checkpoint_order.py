"""Merged column layers in checkpoint order, and the fragment rules every worker installs.

No engine: the layers are vLLM's own classes made without their constructor (which needs a
distributed group), given the four attributes the reordering reads. Each rank's piece is
cut from a checkpoint-order tensor by vLLM's sharding rule, written out here on its own: a
rank holds its share of the query heads, and of the KV heads — or, with more ranks than KV
heads, one KV head shared by ``num_kv_head_replicas`` neighbouring ranks.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

from envoykit.model.checkpoint_order import (
    CheckpointOrderFragments,
    rank_piece,
    to_checkpoint_order,
)

TOKENS = 3


def qkv_layer(n_heads: int, n_kv: int, head_dim: int, tp: int, rank: int) -> QKVParallelLinear:
    layer = QKVParallelLinear.__new__(QKVParallelLinear)
    kv_per_rank = max(1, n_kv // tp)
    layer.output_partition_sizes = [n_heads // tp * head_dim] + [kv_per_rank * head_dim] * 2
    layer.num_kv_head_replicas = max(1, tp // n_kv)
    layer.tp_size, layer.tp_rank = tp, rank
    return layer


def merged_layer(sizes: list[int], tp: int, rank: int) -> MergedColumnParallelLinear:
    layer = MergedColumnParallelLinear.__new__(MergedColumnParallelLinear)
    layer.output_partition_sizes = [size // tp for size in sizes]
    layer.tp_size, layer.tp_rank = tp, rank
    return layer


def checkpoint_tensor(width: int) -> torch.Tensor:
    """``[tokens, width]`` of distinct values, so any misplaced column shows."""
    return torch.arange(TOKENS * width, dtype=torch.float32).reshape(TOKENS, width)


def qkv_piece(whole: torch.Tensor, n_heads: int, n_kv: int, head_dim: int, tp: int, rank: int):
    """Rank ``rank``'s ``[q_r | k_r | v_r]`` of a checkpoint-order ``[q | k | v]``."""
    q, k, v = whole.split([n_heads * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)
    q_heads = n_heads // tp
    kv_heads = max(1, n_kv // tp)
    kv_shard = rank // max(1, tp // n_kv)
    return torch.cat(
        [
            q[:, rank * q_heads * head_dim : (rank + 1) * q_heads * head_dim],
            k[:, kv_shard * kv_heads * head_dim : (kv_shard + 1) * kv_heads * head_dim],
            v[:, kv_shard * kv_heads * head_dim : (kv_shard + 1) * kv_heads * head_dim],
        ],
        dim=-1,
    )


def merged_piece(whole: torch.Tensor, sizes: list[int], tp: int, rank: int) -> torch.Tensor:
    parts = whole.split(sizes, dim=-1)
    return torch.cat(
        [p[:, rank * (s // tp) : (rank + 1) * (s // tp)] for p, s in zip(parts, sizes)], -1
    )


QKV_SHAPES = [  # (query heads, KV heads, head width, TP)
    (4, 4, 8, 1),
    (4, 4, 8, 2),  # tiny at TP=2
    (4, 2, 8, 2),  # grouped-query attention
    (9, 3, 4, 3),  # demo at TP=3
    (4, 2, 8, 4),  # each KV head on two ranks
    (8, 1, 4, 4),  # one KV head on every rank
]


@pytest.mark.parametrize(
    "shape", QKV_SHAPES, ids=[f"h{s[0]}-kv{s[1]}-tp{s[3]}" for s in QKV_SHAPES]
)
class TestQKV:
    def test_gathered_pieces_in_checkpoint_order(self, shape):
        n_heads, n_kv, head_dim, tp = shape
        whole = checkpoint_tensor((n_heads + 2 * n_kv) * head_dim)
        gathered = torch.cat([qkv_piece(whole, *shape, rank) for rank in range(tp)], dim=-1)
        for rank in range(tp):  # every rank reorders alike
            assert torch.equal(to_checkpoint_order(qkv_layer(*shape, rank), gathered), whole)

    def test_each_rank_cuts_its_own_piece(self, shape):
        n_heads, n_kv, head_dim, tp = shape
        whole = checkpoint_tensor((n_heads + 2 * n_kv) * head_dim)
        for rank in range(tp):
            assert torch.equal(
                rank_piece(qkv_layer(*shape, rank), whole), qkv_piece(whole, *shape, rank)
            )


@pytest.mark.parametrize(
    ("sizes", "tp"), [([16, 16], 2), ([16, 16], 4), ([8, 24], 2), ([6, 6, 12], 3)]
)
def test_merged_column_round_trip(sizes, tp):
    whole = checkpoint_tensor(sum(sizes))
    pieces = [merged_piece(whole, sizes, tp, rank) for rank in range(tp)]
    gathered = torch.cat(pieces, dim=-1)
    assert torch.equal(to_checkpoint_order(merged_layer(sizes, tp, 0), gathered), whole)
    for rank in range(tp):
        assert torch.equal(rank_piece(merged_layer(sizes, tp, rank), whole), pieces[rank])


def test_values_of_another_width_pass_unchanged():
    """Only a value as wide as the whole layer is reordered; a rank's own piece is not."""
    layer = qkv_layer(4, 2, 8, 2, 1)
    piece = checkpoint_tensor(sum(layer.output_partition_sizes))
    assert to_checkpoint_order(layer, piece) is piece
    assert rank_piece(layer, piece) is piece


def gpu_runner() -> object:
    """The runner `EnvoykitGPUWorker` builds (through vLLM's ``_make_model_runner`` hook);
    its constructor, which needs CUDA, is stood in for."""
    from envoykit.ranks.gpu import EnvoykitGPUModelRunner, EnvoykitGPUWorker

    worker = EnvoykitGPUWorker.__new__(EnvoykitGPUWorker)
    worker.use_v2_model_runner, worker.vllm_config, worker.device = False, None, None
    with mock.patch.object(EnvoykitGPUModelRunner, "__init__", lambda self, *args: None):
        runner = worker._make_model_runner()
    assert type(runner) is EnvoykitGPUModelRunner
    return runner


def cpu_runner() -> object:
    from envoykit.ranks.cpu import NNsightCPUModelRunner

    return NNsightCPUModelRunner.__new__(NNsightCPUModelRunner)


@pytest.mark.parametrize("make_runner", [gpu_runner, cpu_runner], ids=["gpu", "cpu"])
def test_runner_loads_with_checkpoint_order_fragments(make_runner):
    """After nnsight's ``load_model`` built the interleaver with ``VLLMFragments`` (and the
    tree recorded its rules in it), the runner each worker builds holds the same rules in a
    `CheckpointOrderFragments`."""
    from nnsight.modeling.vllm.fragments import VLLMFragments
    from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner

    def nnsight_load_model(runner, *args, **kwargs):
        fragments = VLLMFragments()
        fragments.enabled, fragments.rules = True, {"model.layers.0.mlp.act_fn": ("m", "out")}
        runner.nnsight_model = SimpleNamespace(interleaver=SimpleNamespace(fragments=fragments))

    runner = make_runner()
    with mock.patch.object(NNsightGPUModelRunner, "load_model", nnsight_load_model):
        runner.load_model()
    fragments = runner.nnsight_model.interleaver.fragments
    assert type(fragments) is CheckpointOrderFragments
    assert fragments.enabled and fragments.rules == {"model.layers.0.mlp.act_fn": ("m", "out")}


def test_envoys_map_is_platform_neutral():
    """The map, the fragment rules and the GPU worker import nothing CPU-specific."""
    code = (
        "import sys, envoykit.model.envoys as e; e.envoys_map(); import envoykit.ranks.gpu; "
        "print(sorted(m for m in sys.modules if m.startswith('envoykit') or 'cpu_worker' in m))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "'envoykit.ranks.gpu'" in out.stdout
    assert "envoykit.ranks.cpu" not in out.stdout
    assert "cpu_worker" not in out.stdout
