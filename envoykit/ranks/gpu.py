"""nnsight's GPU worker with envoykit's fragment rules (the CUDA counterpart of
`envoykit.ranks.cpu`)."""

from __future__ import annotations

from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker
from vllm.v1.worker.gpu_worker import Worker

from envoykit.model.checkpoint_order import InstallFragments
from envoykit.ranks.sae import SAEStore
from envoykit.ranks.translators import TranslatorStore


class EnvoykitGPUModelRunner(InstallFragments, NNsightGPUModelRunner):
    """nnsight's GPU runner whose envoy tree uses envoykit's fragment rules."""


class EnvoykitGPUWorker(TranslatorStore, SAEStore, NNsightGPUWorker):
    """nnsight's GPU worker, with the runner class that installs envoykit's fragment rules
    (and envoykit's RPC that installs tuned-lens translators)."""

    def init_device(self) -> None:
        # vLLM's own init_device builds the runner through `_make_model_runner` (below);
        # nnsight's would re-class that runner in place to its own.
        Worker.init_device(self)

    def _make_model_runner(self) -> EnvoykitGPUModelRunner:
        if self.use_v2_model_runner:
            raise NotImplementedError(
                "nnsight instruments vLLM's first GPU model runner: unset "
                "VLLM_USE_V2_MODEL_RUNNER to trace"
            )
        return EnvoykitGPUModelRunner(self.vllm_config, self.device)
