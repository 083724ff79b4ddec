"""nnsight's GPU worker with envoykit's fragment rules (the CUDA counterpart of
`envoykit.ranks.cpu`)."""

from __future__ import annotations

from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker

from envoykit.model.envoys import InstallFragments
from envoykit.ranks.translators import TranslatorStore

WORKER_CLS = "envoykit.ranks.gpu.EnvoykitGPUWorker"


class EnvoykitGPUModelRunner(InstallFragments, NNsightGPUModelRunner):
    """nnsight's GPU runner whose envoy tree uses envoykit's fragment rules."""


class EnvoykitGPUWorker(TranslatorStore, NNsightGPUWorker):
    """nnsight's GPU worker, with the runner class that installs envoykit's fragment rules
    (and envoykit's RPC that installs tuned-lens translators)."""

    def init_device(self) -> None:
        # nnsight's worker already re-classes vLLM's runner to its own (it adds behaviour,
        # no state); ours only adds `InstallFragments.load_model` on top.
        super().init_device()
        self.model_runner.__class__ = EnvoykitGPUModelRunner


def prepare_client() -> None:
    """Nothing to prepare: a CUDA client answers accelerator calls itself."""
