"""vllm-lens (PyPI, a vLLM plugin) capturing the residual stream, against plain vLLM prefill on
the same engine: run by ``bench/dataset.py --vllm-lens`` in a throwaway environment, with
vllm-lens installed without its dependencies beside this machine's vLLM.

vllm-lens registers itself as a vLLM general plugin; a request asks for activations with
``SamplingParams(extra_args={"output_residual_stream": [layer, ...]})`` (0-based decoder
layers) and gets ``output.activations["residual_stream"]`` ``[layers, tokens, d_model]``.
Prints one line ``SUMMARY {json}``: seconds of each (median of ``--repeats`` after a warm-up
on a few documents), and the largest difference from transformers' stream on two documents.

    PYTHONPATH=SITE python bench/vllm_lens_capture.py --path CHECKPOINT --docs 256 --tokens 128
    PYTHONPATH=SITE python bench/vllm_lens_capture.py --path CHECKPOINT --tp 3 --binding "0|1|0"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", required=True)
    parser.add_argument("--docs", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--layers", default="9,19", help="0-based decoder layers")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument(
        "--binding",
        help="VLLM_CPU_OMP_THREADS_BIND, as envoykit binds its ranks "
        "(bench/dataset.py passes envoykit.runtime.platform.core_binding); default: every "
        "usable core to one rank",
    )
    args = parser.parse_args()
    if args.binding is None and args.tp > 1:
        parser.error("--tp above 1 needs --binding")
    # Set before vLLM is imported. (envoykit itself is not imported here: it would put
    # nnsight into this process, which vllm-lens's worker refuses.)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.binding or ",".join(
        str(core) for core in sorted(os.sched_getaffinity(0))
    )
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    layers = [int(x) for x in args.layers.split(",")]

    from pydoc_data.topics import topics

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tokenizer = AutoTokenizer.from_pretrained(args.path)
    text = "\n\n".join(topics[name] for name in sorted(topics))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    docs = [ids[i * args.tokens : (i + 1) * args.tokens] for i in range(args.docs)]
    prompts = [TokensPrompt(prompt_token_ids=d) for d in docs]
    with open(os.path.join(args.path, "config.json")) as handle:
        config = json.load(handle)
    llm = LLM(
        args.path,
        tensor_parallel_size=args.tp,
        dtype="float32",
        max_model_len=min(1024, config.get("max_position_embeddings", 1024)),
        kv_cache_memory_bytes=256 * 2**20,
        enable_prefix_caching=False,  # vllm-lens skips the prefix cache; plain runs must too
        seed=0,
    )
    plain = SamplingParams(max_tokens=1, temperature=0)
    capture = SamplingParams(
        max_tokens=1, temperature=0, extra_args={"output_residual_stream": layers}
    )

    def median_of(params) -> tuple[float, list]:
        llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
        times, out = [], []
        for _ in range(args.repeats):
            began = time.perf_counter()
            out = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - began)
        return statistics.median(times), out

    t_plain, _ = median_of(plain)
    t_lens, outputs = median_of(capture)
    found = [o.activations["residual_stream"] for o in outputs]
    assert {tuple(a.shape) for a in found} == {(len(layers), args.tokens, found[0].shape[-1])}
    model = AutoModelForCausalLM.from_pretrained(args.path, dtype=torch.float32).eval()
    error = 0.0
    with torch.no_grad():
        for i in range(2):
            states = model(torch.tensor([docs[i]]), output_hidden_states=True).hidden_states
            reference = torch.stack([states[layer + 1][0] for layer in layers])
            scale = reference.abs().max().item()
            error = max(error, (found[i].float() - reference).abs().max().item() / scale)
    summary = {"plain_s": t_plain, "lens_s": t_lens, "relative_error": error}
    print("SUMMARY", json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
