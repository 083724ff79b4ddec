"""nnsight's worker and model runner on vLLM's CPU backend.

Stock nnsight names its GPU worker as vLLM's ``worker_cls``; vLLM's CPU platform only
substitutes its own worker when ``worker_cls == "auto"``, and nnsight's worker refuses any
runner that is not exactly ``GPUModelRunner``. vLLM's ``CPUWorker`` and ``CPUModelRunner``
subclass the GPU ones and nnsight's runner is written with cooperative ``super()``, so mixing
nnsight's runner into ``CPUModelRunner`` gives a runner that interleaves interventions on
CPU, and a ``CPUWorker`` subclass that builds it and answers nnsight's four RPCs is the whole
worker. This module is imported by the spawned rank processes through its dotted path.
"""

from __future__ import annotations

from typing import Any

import torch
from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from envoykit.model.checkpoint_order import InstallFragments
from envoykit.model.loader_calls import no_collections
from envoykit.ranks.sae import SAEStore
from envoykit.ranks.translators import TranslatorStore


class NNsightCPUModelRunner(InstallFragments, NNsightGPUModelRunner, CPUModelRunner):
    """vLLM's CPU runner with nnsight's interleaving and envoykit's fragment rules."""


class NNsightCPUWorker(TranslatorStore, SAEStore, CPUWorker):
    """vLLM's CPU worker building `NNsightCPUModelRunner` and serving nnsight's RPCs (and
    envoykit's, which installs tuned-lens translators)."""

    model_runner: Any  # CPUWorker's, replaced in init_device

    def init_device(self) -> None:
        if self.vllm_config.model_config.enforce_eager:
            _compile_nothing()
        super().init_device()
        # CPUWorker.init_device ends by building its runner by a hard-coded class; the runner
        # holds no weights yet (they load later, in load_model), so the runner that
        # interleaves nnsight's interventions replaces it, built the same way.
        if type(self.model_runner) is not CPUModelRunner:
            raise NotImplementedError(
                f"vLLM built {type(self.model_runner).__name__}, which nnsight does not "
                "instrument; unset VLLM_USE_V2_MODEL_RUNNER"
            )
        self.model_runner = NNsightCPUModelRunner(self.vllm_config, torch.device("cpu"))

    def shutdown(self) -> None:
        # The rank exits next: collecting its heap whole frees nothing that matters.
        with no_collections():
            super().shutdown()

    collect_nnsight = NNsightGPUWorker.collect_nnsight
    nnsight_request_count = NNsightGPUWorker.nnsight_request_count
    nnsight_register = NNsightGPUWorker.nnsight_register
    nnsight_clear_registered = NNsightGPUWorker.nnsight_clear_registered


def _compile_nothing() -> None:
    """Run vLLM's few ``torch.compile``d helpers as plain Python in this rank.

    An eager engine still compiles those: with more than one rank, the first forward
    compiles the vocabulary-shard mask of the embedding (``get_masked_input_and_mask``) to
    C++ in every rank, 10-12 s of the first lens of ``demo`` at TP=3 on two cores, for four
    element-wise operations on the prompt's token ids. The stance is the process's (dynamo's
    ``config.disable`` would hold for this thread only, not for nnsight's intervention
    threads that make ad-hoc calls); set here, in the rank, it leaves the owner's
    ``torch.compile`` alone.
    """
    torch.compiler.set_stance("force_eager")
