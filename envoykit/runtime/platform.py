"""What the machine can host: the platform, its ranks, and the environment vLLM reads.

The one place CPU and GPU differ (besides the worker class): how many ranks fit, and on CPU
which cores each rank binds to. Derived from this process's CPU affinity, so a container or
``taskset`` limit is respected, and applied only to variables the user has not set.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

from envoykit.errors import InvalidRequest
from envoykit.runtime import lifeline

# Each core hosts at most 1.5 ranks on average: three ranks on two cores (the demo model's
# natural split) run when asked for, but more sharing only adds context switches to every
# collective. Unasked, a CPU engine gets no more ranks than cores (`default_ranks`).
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


def default_ranks(platform: str) -> int:
    """How many ranks an engine gets when no size is asked for: every GPU, or one rank per
    core. Ranks sharing cores are slower than fewer ranks on all of them (demo on two cores,
    measured before the lens reduced vocab-parallel: the lens took 1766 ms at TP=3 against
    643 ms at TP=1, and the start 10 s longer), and on a CPU more ranks bring no memory a
    rank lacks: they all share the machine's."""
    if platform == "cuda":
        return max_ranks(platform)
    return len(usable_cpus())


def worker_class(platform: str) -> str:
    """This platform's worker class, by the dotted name vLLM imports it from in each rank.

    A name, not the class: its module imports vLLM's worker and model runner (0.5 s), which
    the owner of an engine never runs.
    """
    if platform == "cuda":
        return "envoykit.ranks.gpu.EnvoykitGPUWorker"
    return "envoykit.ranks.cpu.NNsightCPUWorker"


def ranks_share_cores(tp: int) -> bool:
    """Whether ``tp`` ranks outnumber the usable cores, so some share one."""
    return tp > len(usable_cpus())


def rank_environment(platform: str, tp: int) -> dict[str, str]:
    """vLLM's CPU settings for ``tp`` ranks: every usable core bound to some rank.

    vLLM's ``auto`` binding asserts one NUMA node per rank, so the binding is spelled out.
    With at least as many cores as ranks each rank gets its own contiguous share (``"0,1"``
    for one rank on two cores, ``"0|1"`` for two); with fewer, vLLM is told the round-robin
    binding it asks for (``"0|1|0"`` for three ranks on two cores), but each rank runs one
    thread unbound (`envoykit.runtime.lifeline.UNBOUND_RANKS`). Measured on two cores with
    the demo model, one rank on both cores ran the lens 1.6x faster than on one, and
    generation no slower.
    """
    if platform != "cpu":
        return {}
    cpus = usable_cpus()
    return {
        "VLLM_CPU_OMP_THREADS_BIND": core_binding(cpus, tp),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        # The engine core forks its ranks rather than spawning them (see
        # `envoykit.runtime.lifeline.fork_ranks`): "0" spawns them as vLLM does.
        lifeline.FORK_RANKS: "1",
        # Ranks that share cores run one thread each, unbound ("0" binds them round-robin).
        lifeline.UNBOUND_RANKS: "1" if ranks_share_cores(tp) else "0",
        # Processes that wait for each other's messages asleep, not spinning.
        lifeline.QUIET_WAITS: "1",
        # Deprecation notices from torch and vLLM internals (every all-gather warns once per
        # rank and call site) and torch's C++ NUMA notices say nothing a user can act on;
        # in a notebook they bury the output.
        "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning",
        "TORCH_CPP_LOG_LEVEL": "ERROR",
        # Large tensors on transparent huge pages: the lens's full-vocab temporaries are
        # fresh allocations each call, and faulting them in 4 KiB at a time cost as much as
        # computing them (log-softmax of 480 x 49152 floats: 100 ms, 45 ms on huge pages).
        "THP_MEM_ALLOC_ENABLE": "1",
        # ... and faulted in once. glibc serves allocations past 32 MiB (a lens's logits are
        # ~90 MiB) from fresh mappings and unmaps them on free, so every call faulted its
        # temporaries in again, and on huge pages the kernel compacted memory to find them:
        # the reductions of a 16-token demo lens took 140-580 ms a call, 80-90 ms with freed
        # memory kept in the heap for the next call. The price: a rank keeps its working
        # memory between calls (demo at TP=1: ~940 MiB over its idle RSS, the same from 64 to
        # 768 tokens).
        "MALLOC_MMAP_MAX_": "0",
        "MALLOC_TRIM_THRESHOLD_": str(2**62),
    }


# The KV cache a CPU engine gets unless the user gives kv_cache_memory_bytes.
CPU_KV_CACHE_BYTES = 256 * 2**20


def engine_defaults(platform: str, config: dict) -> dict[str, Any]:
    """vLLM arguments this platform needs for this checkpoint, before the user's own.

    The KV cache on CPU: a fixed size, enough for a few prompts of the context's length on
    the built-in models (vLLM's CPU default takes a share of the machine's memory per rank).

    Multi-head latent attention on CPU: where the cores have AMX tiles vLLM picks its AMX MLA
    backend, which runs only bfloat16 and packs ``kv_b_proj`` with a kernel that has no meta
    implementation, so the model cannot be built on the meta device the client's envoys need
    (and float32, the CPU default, is not supported there). vLLM's reference CPU MLA backend
    runs every dtype and the same numerics with or without AMX.
    """
    if platform != "cpu":  # on a GPU vLLM sizes its KV cache by gpu_memory_utilization
        return {}
    defaults: dict[str, Any] = {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}
    if config.get("kv_lora_rank"):
        defaults["attention_backend"] = "CPU_MLA"
    return defaults


# The engine core's main thread's niceness where the ranks own their cores (`yield_to_ranks`).
CORE_NICENESS = 5


def yield_to_ranks(platform: str, tp: int, processes: list[Any]) -> None:
    """Put the engine core's main thread below the ranks (`CORE_NICENESS`) where each CPU
    rank has cores of its own.

    While a rank computes, the engine core's main thread waits for its answer by spinning
    (vLLM's shared-memory queue yields the CPU in a loop), and on a CPU engine the spin took
    a share of the cores the rank's threads need. Below the ranks it spins on what they
    leave. (It now waits asleep on the CPU, `envoykit.runtime.lifeline.wait_quietly`; the
    figures here were measured while it spun.) Measured on two cores, ``demo`` at TP=1
    (`bench/core_priority.py`, niceness 0, 5, 10 and 19 side by side): a lens of 256 tokens
    took 2034, 1802, 1759 and 1755 ms on a
    quiet machine, of 64 tokens 573, 549, 470 and 470 ms. But the core also does its own
    work at that priority, and the lowest (19, as before) starved it whenever anything else
    wanted the cores: beside two busy processes ``close()`` took 0.97, 2.02, 4.12 and 7.16 s,
    the last because vLLM gave up on the core after 5 s and killed it, and single lenses
    took up to 3.3 s. Niceness 5 keeps part of the gain (most of it at 256 tokens) and a
    close well within vLLM's grace. Ranks that share cores spin in their own collectives,
    where the core's turn then came later (TP=3: lens 521 -> 533 ms), so they are left as
    they are.

    Only the main thread: on Linux a process id's priority is its main thread's, so the
    core's socket threads keep theirs; and only once the ranks run, since a rank forked
    from the core would inherit it. The engine core is the one process of ``processes``
    (``psutil.Process``) whose parent is not among them.
    """
    import psutil

    if platform != "cpu" or ranks_share_cores(tp):
        return
    pids = {process.pid for process in processes}
    for process in processes:
        # (gone already: the engine's watch reports it)
        with contextlib.suppress(OSError, psutil.NoSuchProcess):
            if process.ppid() not in pids:
                os.setpriority(os.PRIO_PROCESS, process.pid, CORE_NICENESS)


def refuse_known_wrong(platform: str, config: dict) -> None:
    """Refuse a checkpoint this platform is known to run wrongly, saying why.

    Multi-head latent attention with plain RoPE on CPU: vLLM's C++ rotary kernel rotates
    MLA's ``[tokens, heads, rope_dim]`` query view wrongly, so every output after the first
    token differs from transformers (top-1 agreement 8-17% measured on a DeepSeek-V2
    checkpoint). With YaRN scaling, as DeepSeek's released checkpoints use, vLLM rotates in
    PyTorch and the outputs are exact.
    """
    if platform != "cpu" or not config.get("kv_lora_rank"):
        return
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "yarn":
        raise InvalidRequest(
            f"this checkpoint uses multi-head latent attention with {kind!r} RoPE, which "
            "vLLM's CPU backend computes wrongly (its rotary kernel misreads MLA's query "
            "layout: outputs differ from the second token on); MLA runs exactly on CPU with "
            "YaRN rope scaling, or on a GPU"
        )


def core_binding(cpus: list[int], tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` ranks on ``cpus``.

    >>> core_binding([0, 1], 1), core_binding([0, 1], 2), core_binding([0, 1], 3)
    ('0,1', '0|1', '0|1|0')
    >>> core_binding([0, 1, 2, 3, 4], 2)
    '0,1,2|3,4'
    """
    if tp > len(cpus):
        return "|".join(str(cpus[r % len(cpus)]) for r in range(tp))
    share, extra = divmod(len(cpus), tp)
    groups, start = [], 0
    for rank in range(tp):
        end = start + share + (rank < extra)
        groups.append(",".join(str(cpu) for cpu in cpus[start:end]))
        start = end
    return "|".join(groups)


@contextlib.contextmanager
def environment(values: dict[str, str], forced: dict[str, str]) -> Iterator[None]:
    """Set ``values`` the user has not set, and ``forced`` over whatever is set, for the
    spawn only; restore afterwards.

    Spawned processes copy the environment when they start, so the values only need to live
    while the engine starts; removing them keeps a second engine (another TP size) from
    inheriting the first one's core binding.
    """
    saved = {key: os.environ.get(key) for key in forced}
    added = {key: value for key, value in values.items() if key not in os.environ}
    os.environ.update(added)
    os.environ.update(forced)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def refuse_unguarded_script() -> None:
    """Refuse an engine started by a script's top-level code outside an
    ``if __name__ == "__main__":`` block, before any process starts.

    The CPU platform starts the engine's processes with ``spawn`` (or from a fork server),
    which runs the script again in each new process: the engine start there fails deep in
    multiprocessing's bootstrap check, and vLLM then reports only "Engine core
    initialization failed". A notebook, ``python -c`` or an imported module is not affected.
    """
    import inspect

    main = sys.modules.get("__main__")
    script = getattr(main, "__file__", None)
    if script is None or getattr(main, "__name__", None) != "__main__":
        return
    frame = inspect.currentframe()
    while frame is not None and not (
        frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"
    ):
        frame = frame.f_back
    if frame is None or _guarded(script, frame.f_lineno):
        return
    raise InvalidRequest(
        f"{os.path.basename(script)} starts an engine in its top-level code (line "
        f"{frame.f_lineno}): the engine's processes run the script again when they start. "
        'Put the engine start under `if __name__ == "__main__":` (see docs/runtime.md, "From '
        'a script")'
    )


def _guarded(script: str, line: int) -> bool:
    """Whether ``line`` of ``script`` lies in an ``if __name__ == "__main__":`` block."""
    import ast

    try:
        with open(script) as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError):
        return True  # nothing to read: do not refuse on a guess
    return any(
        isinstance(node, ast.If)
        and {"__name__", "__main__"} <= set(ast.unparse(node.test).replace("'", " ").split())
        # ast.parse sets end_lineno on every statement (typed optional for hand-made nodes).
        and node.lineno <= line <= (node.end_lineno or node.lineno)
        for node in tree.body
    )
