"""What the machine can host: the platform, its ranks, and the environment vLLM reads.

The one place CPU and GPU differ (besides the worker class): how many ranks fit, and on CPU
which cores each rank binds to. Derived from this process's CPU affinity, so a container or
``taskset`` limit is respected, and applied only to variables the user has not set.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

# Each core hosts at most 1.5 ranks on average: three ranks on two cores (the demo model's
# natural split) run, but more sharing only adds context switches to every collective.
_RANKS_PER_CORE = 1.5


def platform_name() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def max_ranks(platform: str) -> int:
    if platform == "cuda":
        import torch

        return torch.cuda.device_count()
    return max(1, int(len(usable_cpus()) * _RANKS_PER_CORE))


def worker_module(platform: str):
    """The module holding this platform's worker class and client preparation."""
    if platform == "cuda":
        from envoykit import gpu

        return gpu
    from envoykit import cpu

    return cpu


def rank_environment(platform: str, tp: int) -> dict[str, str]:
    """vLLM's CPU settings for ``tp`` ranks: one core per rank, shared round-robin.

    vLLM's ``auto`` binding asserts one NUMA node per rank, so the binding is spelled out
    (``"0|1"``, or ``"0|1|0"`` for three ranks on two cores). Measured on two cores, one rank
    given both cores was 3.5x slower than one core: the engine-core process needs CPU too.
    """
    if platform != "cpu":
        return {}
    cpus = usable_cpus()
    return {
        "VLLM_CPU_OMP_THREADS_BIND": "|".join(str(cpus[r % len(cpus)]) for r in range(tp)),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        # Deprecation notices from torch and vLLM internals (every all-gather warns once per
        # rank and call site) and torch's C++ NUMA notices say nothing a user can act on;
        # in a notebook they bury the output.
        "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
    }


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set the variables the user has not set, for the spawn only; restore afterwards.

    Spawned processes copy the environment when they start, so the values only need to live
    while the engine starts; removing them keeps a second engine (another TP size) from
    inheriting the first one's core binding.
    """
    added = {key: value for key, value in values.items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)
