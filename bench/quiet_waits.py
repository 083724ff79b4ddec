"""The engine's processes waiting for each other's messages asleep, against vLLM's spinning
readers (``ENVOYKIT_QUIET_WAITS=0``), engine by engine in one run.

vLLM's reader of its shared-memory queues yields the core in a loop for 1 s after each
message; `envoykit.runtime.lifeline.wait_quietly` has it sleep on the writer's notification
instead (`envoykit._compat.wait_without_spinning`). Per setting, alternating, each in a fresh
engine: the lens's median and slowest call at two prompt lengths, the engine core's CPU per
lens, the engine's CPU in the second after a lens, and a 32-token greedy generation.

    python bench/quiet_waits.py --tp 1 --engines 2 --calls 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from core_priority import prompt

QUIET = "ENVOYKIT_QUIET_WAITS"


def cpu_seconds(processes: list) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in processes)


def measure(ek, model: str, tp: int, calls: int) -> dict:
    row = {}
    with ek.Engine(model, tp, progress=False) as engine:
        core = [p for p in engine.processes if p.name() == "VLLM::EngineCore"]
        for tokens in (15, 64):
            engine.lens(prompt(tokens), top_k=10, targets=[" Paris"])
        for tokens in (15, 64):
            times, used = [], cpu_seconds(core)
            for _ in range(calls):
                started = time.perf_counter()
                engine.lens(prompt(tokens), top_k=10, targets=[" Paris"])
                times.append(time.perf_counter() - started)
            row[f"lens {tokens} median ms"] = statistics.median(times) * 1000
            row[f"lens {tokens} slowest ms"] = max(times) * 1000
            row[f"core CPU per lens {tokens}, ms"] = (cpu_seconds(core) - used) / calls * 1000
        engine.lens(prompt(15))
        time.sleep(0.05)
        used = cpu_seconds(engine.processes)
        time.sleep(1.0)
        row["engine CPU in the second after, ms"] = (cpu_seconds(engine.processes) - used) * 1000
        started = time.perf_counter()
        engine.generate("The capital of France is", max_tokens=32)
        row["generate 32 tokens, ms"] = (time.perf_counter() - started) * 1000
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--engines", type=int, default=2, help="engines per setting")
    parser.add_argument("--calls", type=int, default=20, help="lenses per length per engine")
    args = parser.parse_args()
    import envoykit as ek

    rows: dict[str, list[dict]] = {"asleep": [], "spinning": []}
    for _ in range(args.engines):
        for setting, value in (("asleep", "1"), ("spinning", "0")):
            os.environ[QUIET] = value  # read as each engine starts
            rows[setting].append(measure(ek, args.model, args.tp, args.calls))
            print(setting, {k: round(v) for k, v in rows[setting][-1].items()}, flush=True)
    os.environ.pop(QUIET)
    print(
        f"\n{args.model}, TP={args.tp}, {args.engines} engines per setting, alternating; "
        f"{args.calls} lenses per length each; medians over the engines"
    )
    print(f"{'':38} {'asleep':>8} {'spinning':>9} {'ratio':>6}")
    for key in rows["asleep"][0]:
        asleep = statistics.median(r[key] for r in rows["asleep"])
        spinning = statistics.median(r[key] for r in rows["spinning"])
        ratio = asleep / spinning if spinning else float("nan")
        print(f"{key:38} {asleep:8.0f} {spinning:9.0f} {ratio:6.2f}")


if __name__ == "__main__":
    main()
