"""An engine behind `envoykit serve` against one in this process, measured side by side.

In one run, on the same model, TP size and prompt:
  * start: `envoykit serve` until its ready line, and `ek.Engine(...)` in this process;
  * connect: `ek.connect()` in a fresh Python process (imports included, as a new notebook
    kernel pays them), and again in this one once the imports are warm;
  * lens latency: the same lens (a 16-token prompt, every layer, top-10, one target) through
    the server and in process, alternating, median and best of ``--repeats``; the goal is
    <= 1.1x (the server logs what each trace cost it: build, run, answer);
  * concurrency: ``--clients`` client processes (kernels) each running ``--lenses`` lenses
    at once, against one client running them all one after the other; every concurrent
    result is checked against the serial one.

The two engines are never asked for work at the same time. Both sit on the same cores, so
an idle one costs the other only what vLLM's idle loops cost.

With ``--load``, the load client's lenses first run one after another on an engine in this
process (its throughput and p50/p95 are what a request is held to), then only the server
runs: 1, 2, 4 and 8 client processes at once (``--levels``),
each running ``--lenses`` lenses back to back, print the throughput, the p50 and p95 latency
of one lens, the errors (which must be 0), whether every result equals the serial one, and
the resident memory of the server process and of its engine's processes before and after
each level (which must stay flat).

    python bench/serve.py --model demo --repeats 5 --clients 2 --lenses 4
    python bench/serve.py --model demo --load --lenses 50
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

import envoykit as ek

PROMPT = "The capital of France is a city with a long history, and its name is"
TARGET = " Paris"

CLIENT = """
import json, sys, time
t = time.perf_counter()
import envoykit as ek
client = ek.connect({url!r})
print(json.dumps({{"connect": time.perf_counter() - t}}), flush=True)
prompts = {prompts!r}
sys.stdin.readline()  # go
t = time.perf_counter()
results = [client.lens(p, targets=[{target!r}]) for p in prompts]
elapsed = time.perf_counter() - t
print(json.dumps({{"elapsed": elapsed, "top_ids": [r.top_ids.tolist() for r in results],
                  "top_probs": [r.top_probs.tolist() for r in results]}}), flush=True)
"""


LOAD_CLIENT = """
import json, sys, time
import envoykit as ek
client = ek.connect({url!r})
print("READY", flush=True)
sys.stdin.readline()  # go
latencies, errors, top_ids = [], [], []
for i in range({lenses}):
    prompt = {prompts!r}[i % {n_prompts}]
    began = time.perf_counter()
    try:
        top_ids.append(client.lens(prompt, targets=[{target!r}], top_k=5).top_ids.tolist())
    except Exception as error:  # counted, not fatal: the load test reports errors
        errors.append(f"{{type(error).__name__}}: {{error}}")
        top_ids.append(None)
    latencies.append(time.perf_counter() - began)
print(json.dumps({{"latencies": latencies, "errors": errors, "top_ids": top_ids}}), flush=True)
"""


def start_server(model: str, tp: int | None) -> tuple[subprocess.Popen, str, float]:
    command = [sys.executable, "-m", "envoykit.cli", "serve", "--model", model, "--port", "0"]
    if tp is not None:
        command += ["--tp", str(tp)]
    began = time.perf_counter()
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = server.stdout.readline()
    found = re.search(r" at (http://\S+) \(", line)
    if not found:
        server.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    return server, found[1], time.perf_counter() - began


def client_process(url: str, prompts: list[str]) -> subprocess.Popen:
    code = CLIENT.format(url=url, prompts=prompts, target=TARGET)
    return subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )


class InFlight:
    """The most vLLM requests the server held at once while the block ran (its status,
    sampled every 250 ms from a thread)."""

    def __init__(self, client) -> None:
        self.client, self.most, self._stop = client, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.25):
            self.most = max(self.most, self.client.status()["in_flight"])

    def __enter__(self) -> InFlight:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def prompt_of(tokenizer, n_tokens: int) -> str:
    ids = tokenizer(PROMPT * 4)["input_ids"][:n_tokens]
    return tokenizer.decode(ids)


def concurrency(url: str, prompts: list[str], clients: int, serial) -> dict:
    """``clients`` kernels, each running ``prompts`` at once; results checked against
    ``serial`` (prompt -> the lens one client gets alone)."""
    procs = [client_process(url, prompts) for _ in range(clients)]
    connects = [json.loads(p.stdout.readline())["connect"] for p in procs]
    began = time.perf_counter()
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.flush()
    outputs = [json.loads(p.stdout.readline()) for p in procs]
    wall = time.perf_counter() - began
    for proc in procs:
        proc.wait()
    equal = all(
        np.array_equal(np.array(out["top_ids"][i]), serial[p].top_ids)
        and np.allclose(np.array(out["top_probs"][i]), serial[p].top_probs, atol=1e-5)
        for out in outputs
        for i, p in enumerate(prompts)
    )
    return {"wall": wall, "connects": connects, "equal": equal}


def served_memory(server: subprocess.Popen) -> tuple[int, int]:
    """Resident bytes of the server process, and of every process under it (engine core,
    ranks, their helpers): a request the server keeps shows in the first, an allocator's
    high water on a rank in the second."""
    import psutil

    root = psutil.Process(server.pid)
    return root.memory_info().rss, sum(p.memory_info().rss for p in root.children(recursive=True))


def in_process(args) -> tuple[list[str], list[float]]:
    """The load's prompts, and the latencies of one load client's lenses run one after
    another on an engine in this process (closed before the server starts): the latency a
    request is held to. In process a second thread's lens waits for the first (one trace at
    a time), so this is also its throughput at any number of threads."""
    with ek.Engine(args.model, args.tp, progress=False) as engine:
        prompts = [prompt_of(engine.tokenizer, args.tokens - i) for i in range(4)]
        for prompt in prompts:  # warm-up
            engine.lens(prompt, targets=[TARGET], top_k=5)
        latencies = []
        for i in range(args.lenses):
            began = time.perf_counter()
            engine.lens(prompts[i % len(prompts)], targets=[TARGET], top_k=5)
            latencies.append(time.perf_counter() - began)
    return prompts, latencies


def load(args) -> None:
    """The server alone under 1, 2, 4 and 8 concurrent client processes, after the same
    lenses in process."""
    prompts, local = in_process(args)
    local_p50, local_p95 = np.percentile(local, [50, 95])
    server, url, _ = start_server(args.model, args.tp)
    try:
        with ek.connect(url) as client:
            serial = {
                p: client.lens(p, targets=[TARGET], top_k=5).top_ids.tolist() for p in prompts
            }
        print(
            f"\nin process, {args.lenses} lenses one after another: "
            f"{len(local) / sum(local):.2f} lenses/s, p50 {local_p50:.3f} s, p95 {local_p95:.3f} s"
        )
        print(f"\n{args.model} behind `envoykit serve`, {args.lenses} lenses per client\n")
        print(
            f"| {'clients':>7} | {'lenses/s':>8} | {'p50 s':>6} | {'p95 s':>6} | {'errors':>6} "
            f"| {'equal':>5} | {'server MiB before -> after':>26} "
            f"| {'engine MiB before -> after':>26} |"
        )
        print(
            f"|{'-' * 9}|{'-' * 10}|{'-' * 8}|{'-' * 8}|{'-' * 8}|{'-' * 7}|{'-' * 28}|{'-' * 28}|"
        )
        for clients in args.levels:
            before = served_memory(server)
            code = LOAD_CLIENT.format(
                url=url, lenses=args.lenses, prompts=prompts, n_prompts=len(prompts), target=TARGET
            )
            procs = [
                subprocess.Popen(
                    [sys.executable, "-c", code],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                )
                for _ in range(clients)
            ]
            for proc in procs:
                assert proc.stdout.readline().strip() == "READY"
            began = time.perf_counter()
            for proc in procs:
                proc.stdin.write("go\n")
                proc.stdin.flush()
            outputs = [json.loads(proc.stdout.readline()) for proc in procs]
            wall = time.perf_counter() - began
            for proc in procs:
                proc.wait()
            after = served_memory(server)
            latencies = sorted(t for out in outputs for t in out["latencies"])
            errors = sum(len(out["errors"]) for out in outputs)
            equal = all(
                ids == serial[prompts[i % len(prompts)]]
                for out in outputs
                for i, ids in enumerate(out["top_ids"])
            )
            p50, p95 = np.percentile(latencies, [50, 95])
            if clients == 1:
                overhead = (
                    f"one client over in process: p50 {p50 / local_p50:.2f}x, "
                    f"p95 {p95 / local_p95:.2f}x"
                )
            print(
                f"| {clients:>7} | {len(latencies) / wall:8.2f} | {p50:6.3f} | {p95:6.3f} | "
                f"{errors:>6} | {equal!s:>5} | "
                f"{before[0] / 2**20:11.0f} -> {after[0] / 2**20:<11.0f} | "
                f"{before[1] / 2**20:11.0f} -> {after[1] / 2**20:<11.0f} |"
            )
        if 1 in args.levels:
            print(f"\n{overhead}")
    finally:
        server.terminate()
        server.wait(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=16, help="prompt length in tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--lenses", type=int, default=4, help="lenses per client")
    parser.add_argument("--load", action="store_true", help="the server alone under load")
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    if args.load:
        load(args)
        return

    began = time.perf_counter()
    engine = ek.Engine(args.model, args.tp, progress=False)
    engine_start = time.perf_counter() - began
    try:
        prompt = prompt_of(engine.tokenizer, args.tokens)
        alone = median_of(lambda: engine.lens(prompt, targets=[TARGET]), args.repeats)
        server, url, serve_start = start_server(args.model, args.tp)
        try:
            run(args, url, engine, prompt, alone, serve_start, engine_start)
        finally:
            server.terminate()
            server.wait(120)
    finally:
        engine.close()


def median_of(fn, repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(timed(fn) for _ in range(repeats))


def run(args, url, engine, prompt, alone, serve_start: float, engine_start: float) -> None:
    prompts = [prompt_of(engine.tokenizer, args.tokens - i) for i in range(args.lenses)]

    warm = [timed(lambda: ek.connect(url).close()) for _ in range(3)]
    client = ek.connect(url)

    def remote():
        return client.lens(prompt, targets=[TARGET])

    def local():
        return engine.lens(prompt, targets=[TARGET])

    remote(), local()  # warm-up
    times: dict[str, list[float]] = {"remote": [], "local": []}
    for _ in range(args.repeats):  # alternating: drift in the machine's load hits both
        times["remote"].append(timed(remote))
        times["local"].append(timed(local))
    r_lens, l_lens = statistics.median(times["remote"]), statistics.median(times["local"])
    # The least interfered-with run of each: on shared cores, a burst of someone else's load
    # moves a median of a few runs by more than the server's own cost.
    r_best, l_best = min(times["remote"]), min(times["local"])
    same = np.array_equal(remote().top_ids, local().top_ids)

    serial = {p: client.lens(p, targets=[TARGET]) for p in prompts}
    one = concurrency(url, prompts * args.clients, 1, serial)
    with InFlight(client) as in_flight:
        many = concurrency(url, prompts, args.clients, serial)
    cold = statistics.median(one["connects"] + many["connects"])
    client.close()

    info = engine.info
    total = args.lenses * args.clients
    print(
        f"\n{info.name}, TP={info.tp}, {info.dtype}, {len(engine.tokenizer(prompt)['input_ids'])}"
        f"-token prompt, {info.n_layers} layers, top-10, one target; {args.repeats} repeats\n"
    )
    rows = [
        ("engine start: `envoykit serve` until ready", serve_start, None),
        ("engine start: ek.Engine in process", engine_start, None),
        ("ek.connect(), fresh process (imports included)", cold, engine_start),
        ("ek.connect(), warm process", statistics.median(warm), engine_start),
        ("lens through the server", r_lens, l_lens),
        ("lens in process (beside the idle server)", l_lens, None),
        ("lens through the server, best run", r_best, l_best),
        ("lens in process, best run", l_best, None),
        ("lens in process, before the server started", alone, None),
        (f"{total} lenses, one client after another", one["wall"], None),
        (f"{total} lenses, {args.clients} clients at once", many["wall"], one["wall"]),
    ]
    print(f"| {'measure':<50} | {'seconds':>8} | {'ratio':>22} |")
    print(f"|{'-' * 52}|{'-' * 10}|{'-' * 24}|")
    for name, seconds, against in rows:
        ratio = "" if against is None else f"{seconds / against:.2f}x"
        print(f"| {name:<50} | {seconds:8.3f} | {ratio:>22} |")
    print(
        f"\nratios: connect / Engine start, server lens / in-process lens (goal <= 1.1), "
        f"concurrent / serial wall time (< 1: the server batches).\n"
        f"server lens equals in-process lens: {same}; concurrent results equal serial: "
        f"{many['equal'] and one['equal']}; throughput {total / one['wall']:.2f} lenses/s "
        f"serial, {total / many['wall']:.2f} lenses/s with {args.clients} clients; at most "
        f"{in_flight.most} vLLM requests in flight at once (more than one: batched)"
    )


if __name__ == "__main__":
    main()
