"""Where an engine start spends its time, part by part, beside a plain ``vllm.LLM`` start.

Each start runs in a fresh Python process (so every import is paid as a user pays it), one
after the other: envoykit at TP=1, envoykit at ``--tp N`` when asked, and a plain
``vllm.LLM`` of the same checkpoint with the settings envoykit passes (path from
``envoykit.runtime.models.resolve``, float32, envoykit's ``max_model_len`` and KV-cache bytes, the
CPU variables of ``platform.rank_environment``, chunked prefill and prefix caching off, eager),
but vLLM's own worker and without envoykit's vLLM plugin (``envoykit_vllm_plugin``, which
vLLM loads in every process of any engine on this machine, where outside envoykit's engines
it does nothing). The parts come from three clocks that agree (wall time since the epoch):
the owner's own clock around each step (timing wrappers installed in the bench process,
envoykit's code unchanged), the start time of
each engine-core and rank process (psutil ``create_time()``), and the timestamps of vLLM's log
lines (``engine.log_file``; the plain start writes the same format to a file of its own).
Consecutive parts add up to the start; a part whose marks are missing (no engine-core process
when the core runs in the owner, no rank process at TP=1 in-process) is shown as ``-`` and its
time falls into the next part.

    python bench/startup.py --model demo --tp 3 --repeat 3 --wait-load 1.5
    python bench/startup.py --model demo --tp 3 --plain-tp --env VLLM_ENABLE_V1_MULTIPROCESSING=0
    python bench/startup.py --model tiny --no-plain --kwarg 'distributed_executor_backend="mp"'
    python bench/startup.py --imports            # import cost of each process's modules

``--env`` and ``--kwarg`` (a JSON value) apply to every start, envoykit's and the plain one,
so a vLLM lever is measured on both sides; ``--json`` keeps every run's marks and its lens
(last position) for comparing results across levers. Reports the median over ``--repeat``
runs (the starts of one repeat run one after the other, repeats interleaved, so a change in
the machine's load falls on all of them), the first lens (plain: one greedy token), the close,
and each run's start with the load average it began under. Run it on a quiet machine
(``--wait-load`` waits for one before each start): two cores shared with another engine
double every part, and a run that was paused or starved shows up as one inflated part.
"""

from __future__ import annotations

# Only the standard library at module level: spawned engine processes re-import this file
# as their __main__, and a plain start must not pay for envoykit's imports.
import argparse
import inspect
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime

PROMPT = "The capital of France is"
TARGET = " Paris"
MARK = "STARTUP-RESULT "
# vLLM's own general plugins; leaving envoykit's out makes a plain start what it is on a
# machine without envoykit.
VLLM_OWN_PLUGINS = "lora_filesystem_resolver,lora_hf_hub_resolver"
# nnsight asks vLLM for its V1 model runner in every envoykit start.
NNSIGHT_ENV = {"VLLM_USE_V2_MODEL_RUNNER": "0"}

# (anchor, the part that ends at it), in the order they happen in a start.
PARTS = [
    ("gloo_done", "owner: import vLLM, nnsight's single-rank gloo group"),
    ("meta_done", "owner: nnsight meta tree + tokenizer"),
    ("llm_enter", "owner: rest before vllm.LLM()"),
    ("core_created", "owner: LLM() config + tokenizer, spawn core"),
    ("core_logged", "engine core: spawn + imports"),
    ("rank_created", "engine core: executor set-up"),
    ("ranks_imported", "ranks: start (fork or spawn) + imports, last"),
    ("load_started", "ranks: device + distributed init"),
    ("kv_started", "ranks: model load (weights, repack, ready)"),
    ("kv_done", "KV cache, profiling, warm-up"),
    ("llm_exit", "owner: core ready -> LLM() returns"),
    ("tree_done", "owner: nnsight envoy tree"),
    ("check_started", "owner: envoykit bookkeeping (procs, janitor)"),
    ("ready", "owner: self-check (validate=True)"),
]
EXTRA = [
    ("import_envoykit", "owner: import envoykit (before start)"),
    ("import_vllm", "owner: from vllm import LLM (plain, before)"),
    ("start", "START (Engine() / LLM())"),
    ("total", "TOTAL python start -> ready"),
    ("weights_logged", "  of which 'Loading weights took' (rank 0)"),
    ("kv_logged", "  'init engine (profile, kv, warm-up) took'"),
    ("first_lens", "first lens (plain: 1 greedy token)"),
    ("close", "close"),
]


# -- one start, in a fresh process ----------------------------------------------------------


def _log_time(line: str) -> tuple[float, int, str] | None:
    """(epoch seconds, pid, message) of a log line in envoykit's format, else None."""
    match = re.match(
        r"[A-Z]+ (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) \[pid (\d+)\] [\w.]+: (.*)", line
    )
    if not match:
        return None
    stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
    return stamp + int(match.group(2)) / 1000, int(match.group(3)), match.group(4)


def parse_log(path: str, owner: int, core: int | None, ranks: list[int], after: float) -> dict:
    """The anchors vLLM's log gives: core's first line, ranks' init, load, KV cache."""
    lines = []
    with open(path, errors="replace") as log:
        for line in log:
            parsed = _log_time(line)
            if parsed and parsed[0] >= after - 0.01:
                lines.append(parsed)
    core_pid = core or owner
    rank_pids = set(ranks) or {owner}
    found: dict = {}

    def last(pids: set[int], text: str) -> float | None:
        # Every rank logs it; the part ends when the last rank is there.
        times = [t for t, pid, msg in lines if pid in pids and text in msg]
        return max(times) if times else None

    first_core = [t for t, pid, msg in lines if pid == core_pid and "Initializing a V1" in msg]
    found["core_logged"] = first_core[0] if first_core and core else None
    found["ranks_imported"] = last(rank_pids, "world_size=") if ranks else None
    found["load_started"] = last(rank_pids, "Starting to load model")
    for t, _pid, msg in lines:
        weights = re.search(r"Loading weights took ([\d.]+) seconds", msg)
        if weights and "weights_logged" not in found:
            found["weights_logged"] = float(weights.group(1))
        kv = re.search(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)", msg)
        if kv and "kv_done" not in found:
            found["kv_done"] = t
            found["kv_logged"] = float(kv.group(1))
            found["kv_started"] = t - float(kv.group(1))
    args = [msg for _t, _pid, msg in lines if msg.startswith("non-default args:")]
    found["non_default_args"] = args[-1] if args else None
    return found


def _processes(owner: int) -> tuple[int | None, list[tuple[int, float]], float | None]:
    """(engine-core pid, [(rank pid, created)], core created) among this process's children."""
    import psutil

    core, core_created, ranks = None, None, []
    for process in psutil.Process(owner).children(recursive=True):
        try:
            name = " ".join([process.name(), *process.cmdline()])
            created = process.create_time()
        except psutil.Error:
            continue
        if "EngineCore" in name:
            core, core_created = process.pid, created
        elif "Worker" in name:
            ranks.append((process.pid, created))
    return core, sorted(ranks), core_created


def _create_time_offset() -> float:
    """What to add to psutil's ``create_time()`` to get ``time.time()``.

    psutil counts a process's start from the boot time, which Linux gives in whole seconds:
    its start times are off the wall clock by up to a second (0.5 s here), the same for
    every process. Measured on a process started now: the smallest of a few tries.
    """
    import psutil

    offsets = []
    for _ in range(5):
        before = time.time()
        process = subprocess.Popen(["sleep", "0"])
        offsets.append(before - psutil.Process(process.pid).create_time())
        process.wait()
    # The fork happened after ``before``; ticks are 10 ms: the largest is the closest.
    return max(offsets)


class _Clock:
    """Wall-clock marks set by timing wrappers around functions of a loaded module."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}

    def wrap(self, owner: object, name: str, enter: str | None, leave: str | None) -> None:
        original = inspect.getattr_static(owner, name)
        raw = original.__func__ if isinstance(original, staticmethod) else original
        marks = self.marks

        def timed(*args, **kwargs):
            if enter:
                marks.setdefault(enter, time.time())
            try:
                return raw(*args, **kwargs)
            finally:
                if leave:
                    marks[leave] = time.time()

        setattr(owner, name, staticmethod(timed) if isinstance(original, staticmethod) else timed)


def _logging_config(path: str) -> str:
    """A vLLM logging config in envoykit's format (INFO and up to ``path``, errors on screen).

    A copy of `envoykit.runtime.logs.configure`'s, not a call to it: importing envoykit loads torch,
    which the plain start would then not pay for in its own timed imports.
    """
    fmt = "%(levelname)s %(asctime)s [pid %(process)d] %(name)s: %(message)s"
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": fmt}},
        "handlers": {
            "file": {
                "class": "logging.FileHandler",
                "filename": path,
                "formatter": "plain",
                "level": "INFO",
            },
            "screen": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": "plain",
                "level": "ERROR",
            },
        },
        "loggers": {"vllm": {"handlers": ["file", "screen"], "level": "INFO", "propagate": False}},
    }
    config_path = path + ".logging.json"
    with open(config_path, "w") as out:
        json.dump(config, out)
    return config_path


def run_envoykit(spec: dict, clock: _Clock) -> dict:
    marks = clock.marks
    began = time.time()
    import envoykit as ek

    # A user's ``ek.Engine(...)`` looks the name up first, which imports the engine (and
    # starts the engine core's imports beside it, `envoykit.runtime.forkserver.start_early`).
    engine_class = ek.Engine
    marks["import_envoykit_done"] = time.time()
    marks["import_envoykit"] = marks["import_envoykit_done"] - began
    from nnsight.modeling.vllm.vllm import VLLM

    from envoykit.model import envoys

    init_distributed = inspect.getattr_static(VLLM, "_init_distributed").__func__

    def timed_init_distributed():
        init_distributed()
        marks["gloo_done"] = time.time()
        # vLLM's client is imported by now: wrap the steps of its start.
        import vllm

        clock.wrap(vllm.LLM, "__init__", "llm_enter", "llm_exit")

    VLLM._init_distributed = staticmethod(timed_init_distributed)
    clock.wrap(envoys.EnvoykitVLLM, "_load_meta", None, "meta_done")
    clock.wrap(envoys.EnvoykitVLLM, "__init__", None, "tree_done")
    from envoykit.analyses import selfcheck

    clock.wrap(selfcheck, "run", "check_started", None)
    marks["call"] = time.time()
    engine = engine_class(
        spec["model"], tensor_parallel_size=spec["tp"], progress=False, **spec["kwargs"]
    )
    marks["ready"] = time.time()
    core, ranks, core_created = _processes(os.getpid())
    log = parse_log(
        str(engine.log_file), os.getpid(), core, [pid for pid, _ in ranks], marks["llm_enter"]
    )
    started = time.time()
    res = engine.lens(PROMPT, targets=[TARGET])
    marks["first_lens"] = time.time() - started
    lens = {
        "top_ids": res.top_ids[:, -1].tolist(),
        "top_probs": res.top_probs[:, -1].tolist(),
        "target_prob": res.target(TARGET).prob[:, -1].tolist(),
    }
    started = time.time()
    engine.close()
    marks["close"] = time.time() - started
    return {
        "log": log,
        "core": core,
        "core_created": core_created,
        "ranks": ranks,
        "lens": lens,
        "load_seconds": engine.load_seconds,
    }


def run_plain(spec: dict, clock: _Clock) -> dict:
    marks = clock.marks
    log_file = os.path.join(spec["scratch"], f"plain-{os.getpid()}.log")
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = _logging_config(log_file)
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    began = time.time()
    import vllm
    from vllm import LLM, SamplingParams

    marks["import_vllm"] = time.time() - began
    clock.wrap(vllm.LLM, "__init__", "llm_enter", "llm_exit")
    marks["call"] = time.time()
    llm = LLM(spec["path"], **spec["plain_kwargs"], **spec["kwargs"])
    marks["ready"] = time.time()
    core, ranks, core_created = _processes(os.getpid())
    log = parse_log(log_file, os.getpid(), core, [pid for pid, _ in ranks], marks["llm_enter"])
    started = time.time()
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([PROMPT], params, use_tqdm=False)
    marks["first_lens"] = time.time() - started
    started = time.time()
    llm.llm_engine.engine_core.shutdown()
    marks["close"] = time.time() - started
    return {"log": log, "core": core, "core_created": core_created, "ranks": ranks}


def child(spec: dict) -> None:
    """One start; prints its marks as one JSON line."""
    born = time.time()
    os.environ.update(spec["env"])
    clock = _Clock()
    found = (run_envoykit if spec["kind"] == "envoykit" else run_plain)(spec, clock)
    import psutil

    marks = clock.marks
    offset = _create_time_offset()
    marks["born"] = psutil.Process().create_time() + offset
    marks["core_created"] = found["core_created"] and found["core_created"] + offset
    marks["rank_created"] = found["ranks"][0][1] + offset if found["ranks"] else None
    log = found.pop("log")
    for key in ("core_logged", "ranks_imported", "load_started", "kv_started", "kv_done"):
        marks[key] = log.get(key)
    marks["weights_logged"] = log.get("weights_logged")
    marks["kv_logged"] = log.get("kv_logged")
    found["non_default_args"] = log.get("non_default_args")
    found["marks"] = marks
    found["python_overhead"] = born - marks["born"]
    print(MARK + json.dumps(found), flush=True)


# -- the table -------------------------------------------------------------------------------


def parts(result: dict) -> dict[str, float | None]:
    """Seconds of each part of one start, from its marks."""
    marks = result["marks"]
    out: dict[str, float | None] = {}
    previous = marks["call"]
    for anchor, _label in PARTS:
        at = marks.get(anchor)
        if at is None or at < previous - 0.05:  # missing, or out of order: merge forward
            out[anchor] = None
            continue
        out[anchor] = max(0.0, at - previous)
        previous = at
    out["start"] = marks["ready"] - marks["call"]
    out["total"] = marks["ready"] - marks["born"]
    for key in ("import_envoykit", "import_vllm", "weights_logged", "kv_logged"):
        out[key] = marks.get(key)
    out["first_lens"], out["close"] = marks["first_lens"], marks["close"]
    return out


def median_parts(results: list[dict]) -> dict[str, float | None]:
    each = [parts(r) for r in results]
    out = {}
    for key in [anchor for anchor, _ in PARTS] + [key for key, _ in EXTRA]:
        values = [p[key] for p in each if p.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def print_table(columns: dict[str, list[dict]], ratio: tuple[str, str] | None) -> None:
    names = list(columns)
    medians = {name: median_parts(results) for name, results in columns.items()}
    head = f"{'part (seconds, median of ' + str(len(columns[names[0]])) + ')':46s}"
    head += "".join(f"{name:>16s}" for name in names)
    if ratio:
        head += f"{'ratio':>8s}"
    print(head)
    print("-" * len(head))

    def cell(value):
        return f"{value:16.2f}" if value is not None else f"{'-':>16s}"

    rows = [(key, label) for key, label in EXTRA[:2]] + PARTS + EXTRA[2:]
    for key, label in rows:
        line = f"{label:46s}" + "".join(cell(medians[name][key]) for name in names)
        if ratio:
            a, b = medians[ratio[0]][key], medians[ratio[1]][key]
            line += f"{a / b:8.2f}" if a and b and b > 0.05 else f"{'':8s}"
        print(line)


def start_once(kind: str, tp: int, base: dict, args) -> dict:
    spec = {**base, "kind": kind, "tp": tp, "env": dict(base["env"])}
    spec["plain_kwargs"] = {**base["plain_kwargs"], "tensor_parallel_size": tp}
    if kind == "plain":  # what envoykit sets for its own start (platform, nnsight)
        spec["env"] = {**base["rank_env"][str(tp)], **NNSIGHT_ENV, **base["env"]}
        spec["env"].setdefault("VLLM_PLUGINS", VLLM_OWN_PLUGINS)
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=args.timeout,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"{kind} TP={tp} start failed (exit {done.returncode})")
    return json.loads(lines[-1][len(MARK) :])


def wait_for_quiet(below: float | None, most: float) -> float:
    """Wait (up to ``most`` seconds) for the 1-minute load average to drop below ``below``;
    return the load average the start begins under."""
    deadline = time.monotonic() + most
    while below is not None and os.getloadavg()[0] >= below and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def settings(model: str, tps: list[int]) -> dict:
    """What envoykit passes to vLLM for ``model``, for the plain start to pass too."""
    from envoykit.model.config import read_config
    from envoykit.runtime import models, platform
    from envoykit.runtime.info import MAX_MODEL_LEN_CAP

    source = models.resolve(model)
    config = read_config(source.path)
    limit = config.get("max_position_embeddings") or MAX_MODEL_LEN_CAP
    return {
        "model": model,
        "path": source.path,
        "rank_env": {str(tp): platform.rank_environment("cpu", tp) for tp in tps},
        "plain_kwargs": {
            "dtype": "float32",
            "max_model_len": min(limit, MAX_MODEL_LEN_CAP),
            **platform.engine_defaults("cpu", config),
            "enforce_eager": True,
            "enable_chunked_prefill": False,
            "enable_prefix_caching": False,
            "use_tqdm_on_load": False,
        },
    }


# -- imports in fresh interpreters -------------------------------------------------------------


def import_costs(modules: list[str], top: int) -> None:
    """Wall time of importing each module in a fresh interpreter, and where it goes."""
    print(f"{'import (fresh interpreter)':40s}{'wall s':>8s}   largest self time by package")
    for module in modules:
        began = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", f"import {module}"],
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - began
        by_package: dict[str, int] = {}
        for line in done.stderr.splitlines():
            match = re.match(r"import time:\s+(\d+) \|\s+\d+ \|\s*(\S+)", line)
            if match:
                package = match.group(2).split(".")[0]
                by_package[package] = by_package.get(package, 0) + int(match.group(1))
        largest = sorted(by_package.items(), key=lambda kv: -kv[1])[:top]
        shown = ", ".join(f"{name} {us / 1e6:.2f}" for name, us in largest)
        print(f"{module:40s}{wall:8.2f}   {shown}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--tp", type=int, default=None, help="also start envoykit at TP=N")
    parser.add_argument("--plain-tp", action="store_true", help="and plain vLLM at TP=N")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain vLLM start")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--kwarg", action="append", default=[], metavar="KEY=JSON")
    parser.add_argument("--json", help="write every run's marks and lens here")
    parser.add_argument("--imports", action="store_true", help="import costs only")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--wait-load", type=float, help="before each start, wait for the load average < this"
    )
    parser.add_argument("--wait-max", type=float, default=600, help="...for at most this long")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if args.imports:
        modules = [
            "envoykit",
            "envoykit.engine",  # what the first lookup of ek.Engine imports
            "vllm",
            "nnsight",
            "vllm.v1.engine.core",
            "vllm.v1.executor.multiproc_executor",
            "vllm.v1.worker.cpu_worker",
            "envoykit.ranks.cpu",
        ]
        import_costs(modules, top=6)
        return
    tps = [1] + ([args.tp] if args.tp and args.tp != 1 else [])
    base = settings(args.model, tps)
    base["env"] = dict(item.split("=", 1) for item in args.env)
    base["kwargs"] = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.kwarg)}
    base["scratch"] = tempfile.mkdtemp(prefix="bench-startup-")
    plan = [("envoykit", 1)]
    plan += [("envoykit", tp) for tp in tps[1:]]
    if not args.no_plain:
        plan += [("plain", 1)] + ([("plain", tp) for tp in tps[1:]] if args.plain_tp else [])
    columns: dict[str, list[dict]] = {f"{kind} TP={tp}": [] for kind, tp in plan}
    loads = []
    try:
        for _ in range(args.repeat):
            for kind, tp in plan:
                loads.append(wait_for_quiet(args.wait_load, args.wait_max))
                columns[f"{kind} TP={tp}"].append(start_once(kind, tp, base, args))
    finally:
        shutil.rmtree(base["scratch"], ignore_errors=True)
    print(
        f"{args.model}, float32; env {base['env'] or '{}'}, kwargs {base['kwargs'] or '{}'}; "
        f"1-min load average at each start: {min(loads):.2f}-{max(loads):.2f}"
    )
    ratio = ("envoykit TP=1", "plain TP=1") if not args.no_plain else None
    print_table(columns, ratio)
    at = iter(loads)
    each = {name: [] for name in columns}
    for index in range(args.repeat):
        for kind, tp in plan:
            name = f"{kind} TP={tp}"
            start = parts(columns[name][index])["start"]
            each[name].append(f"{start:.1f} ({next(at):.1f})")
    for name, runs in each.items():
        print(f"{name}: start per run (load at its start): {', '.join(runs)}")
    for name, results in columns.items():
        print(f"{name}: vLLM non-default args: {results[-1]['non_default_args']}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"settings": base, "loads": loads, "runs": columns}, out, indent=1)


if __name__ == "__main__":
    main()
