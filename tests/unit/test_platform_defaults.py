"""The vLLM arguments a platform adds for a checkpoint (the matrix's MLA engines need them)."""

import pytest

from envoykit.errors import InvalidRequest
from envoykit.runtime import platform


def test_mla_on_cpu_asks_for_the_reference_backend_that_runs_every_dtype():
    mla = {"model_type": "deepseek_v2", "kv_lora_rank": 512}
    assert platform.engine_defaults("cpu", mla)["attention_backend"] == "CPU_MLA"


def test_a_gpu_gets_vllm_own_defaults_and_cpu_a_fixed_kv_cache():
    """On CUDA, vLLM's gpu_memory_utilization sizes the KV cache: a fixed CPU-sized cache
    would starve a real model."""
    kv = {"kv_cache_memory_bytes": platform.CPU_KV_CACHE_BYTES}
    assert platform.engine_defaults("cpu", {"model_type": "llama"}) == kv
    assert platform.engine_defaults("cpu", {"kv_lora_rank": None}) == kv
    assert platform.engine_defaults("cuda", {"kv_lora_rank": 512}) == {}


def test_mla_with_plain_rope_on_cpu_is_refused_with_the_reason():
    plain = {"model_type": "deepseek_v2", "kv_lora_rank": 512, "rope_scaling": None}
    with pytest.raises(InvalidRequest, match="'default' RoPE, which vLLM's CPU backend"):
        platform.refuse_known_wrong("cpu", plain)
    linear = {**plain, "rope_scaling": {"type": "linear", "factor": 2.0}}
    with pytest.raises(InvalidRequest, match="'linear' RoPE"):
        platform.refuse_known_wrong("cpu", linear)
    for yarn in ({"rope_parameters": {"rope_type": "yarn"}}, {"rope_scaling": {"type": "yarn"}}):
        platform.refuse_known_wrong("cpu", {**plain, **yarn})
    platform.refuse_known_wrong("cuda", plain)
    platform.refuse_known_wrong("cpu", {"model_type": "llama", "rope_scaling": None})


@pytest.mark.parametrize("name, base", [("cpu", "CPUWorker"), ("cuda", "Worker")])
def test_the_worker_class_named_for_each_platform_is_vllms_worker_with_nnsights_rpcs(name, base):
    """The owner passes the worker class by name (its module is the ranks' import, not the
    owner's); the name resolves, in a rank as here, to a subclass of vLLM's worker for that
    platform that answers nnsight's RPCs."""
    import importlib

    module, _, cls = platform.worker_class(name).rpartition(".")
    worker = getattr(importlib.import_module(module), cls)
    assert base in [ancestor.__name__ for ancestor in worker.__mro__]
    assert callable(worker.collect_nnsight)
