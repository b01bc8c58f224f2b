"""``fedbr-bench``: seconds per round of the Flower simulation against a bare PyTorch loop that does
the same local steps (same algorithm class, data, seeds) and the same aggregation in one process, for
both engines (``engine=clients``: a Flower node per client; ``engine=cohort``: a node per cohort).

    fedbr-bench --suite                          # FedAvg, FedBR, DisTrans on the three shapes below
    fedbr-bench --scale                          # 100 clients at 10%, 1000 at 1%, engine=cohort
    fedbr-bench --startup 3                      # where a whole fedbr-run's seconds go, per phase
    fedbr-bench --sweep-startup 2                # the fixed seconds of each run of a 3-run sweep
    fedbr-bench --suite num-clients=10 local-steps=50 precision=bf16   # the paper's round, on a GPU
    fedbr-bench experiments/fedavg_rotmnist5k.yaml --rounds 3          # one config
    fedbr-bench --step batch-size=64                # one FedBR / DisTrans local step / one FedAvg step
    fedbr-bench --step dataset=cifar10 model=vgg11  # synthetic inputs of the dataset's shape
    fedbr-bench --cohort-step experiments/fedavg_rotmnist5k.yaml model=cnn-small   # a cohort: loop vs vmap
    fedbr-bench --levers dataset=mnist num-clients=10 local-steps=50 batch-size=64  # GPU levers vs strict fp32
    fedbr-bench --kernels dataset=mnist num-clients=10 local-steps=50 batch-size=64  # where a round's time goes

Round 1 is a warm-up on both sides (Flower: Ray and actor start, data loading, compilation) and is
not timed. Evaluation and checkpoints are off on both sides except Flower's final evaluation, which
is not timed either. Besides seconds, it reports each client process's peak memory (GPU memory
reserved by torch on CUDA, host RSS on CPU), the bytes of Flower's fit messages per round, and the
achieved TFLOP/s: the FLOPs of a round (one client's fit counted by torch's FlopCounterMode, times the
clients a round samples) over its seconds, beside the device's peak where it is known.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence, cast

import numpy as np
import torch

from ..app.raycluster import requested_address
from ..core.algorithm import client_class
from ..core.config import ConfigError, common, resolved_model
from ..core.errors import OneLineParser, quiet_when_its_reader_leaves
from ..core.model import SplitModel
from ..core.training import autocast, use_device
from ..data.catalog import INFO
from ..data.dataset import load_client_data, load_cohort_data
from ..launch.launcher import RunFailed, run_flower
from ..launch.plan import build_config, size_for_runtime, size_resources
from ..launch.protocol import RunPlan
from ..runfiles.metrics import read_jsonl
from ..server.recording import node_key
from .bare import BareServer, bare_loop_round_seconds, round_configs, synchronize


def step_seconds(cfg: dict, steps: int, repeats: int = 3) -> dict[str, float]:
    """Seconds per local step of FedAvg, FedBR and DisTrans on the same backbone, batch and device, on
    synthetic inputs of the dataset's shape, with the config's precision and compile switches. They are
    timed in alternation and the median repeat is kept."""
    run = common(cfg)
    from clients.distrans import DisTransClient, DisTransStep, Offset
    from clients.fedavg import SupervisedStep
    from clients.fedbr import FedBRClient, FedBRStep

    device = use_device(cfg)
    info = INFO[run.dataset]
    fedbr_cfg = {**cfg, "strategy": "fedbr"}
    torch.manual_seed(run.seed)
    fedbr_modules = {k: m.to(device) for k, m in FedBRClient.build_modules(fedbr_cfg, run.compile).items()}
    model, head = cast(SplitModel, fedbr_modules["model"]), fedbr_modules.get("head")
    shape = (run.batch_size, *info.image_shape)
    x, x_p = torch.randn(shape, device=device), torch.randn(shape, device=device)
    y = torch.randint(0, info.num_classes, (run.batch_size,), device=device)
    y_p = torch.full((run.batch_size, info.num_classes), 1.0 / info.num_classes, device=device)
    distrans_model = DisTransClient.build_model(copy.deepcopy(model), cfg).to(device)
    algorithms = {
        "fedavg": SupervisedStep(model, cfg),
        "fedbr": FedBRStep(
            model, fedbr_cfg, FedBRClient.Settings.from_config(fedbr_cfg), head, x_p, y_p, (x, y), seed=run.seed
        ),
        "distrans": DisTransStep(
            distrans_model, Offset(info.image_shape).to(device), cfg, DisTransClient.Settings.from_config(cfg)
        ),
    }
    model.train()
    distrans_model.train()

    def timed(algorithm, n):
        synchronize(device)
        start = time.perf_counter()
        with autocast(device, common(cfg).precision):
            for _ in range(n):
                algorithm.update(x, y)
        synchronize(device)
        return (time.perf_counter() - start) / n

    for algorithm in algorithms.values():
        timed(algorithm, 3)  # warm-up: allocator, kernels
    times: dict[str, list[float]] = {name: [] for name in algorithms}
    for _ in range(repeats):
        for name, algorithm in algorithms.items():
            times[name].append(timed(algorithm, steps))
    return {name: statistics.median(t) for name, t in times.items()}


def step_main(cfg: dict, steps: int, threads: int, json_path: Path | None) -> int:
    from clients.distrans import DisTransSettings

    run = common(cfg)
    t = step_seconds(cfg, steps)
    device = _device_name(cfg, threads)
    print(
        f"fedbr-bench --step: {resolved_model(cfg)} on {run.dataset}-shaped inputs, batch {run.batch_size}, "
        f"{device}, {steps} steps x 3 repeats, precision {run.precision}, compile {run.compile}\n"
    )
    print_ratio_table(
        "local step",
        "step",
        4,
        [
            ("FedAvg", t["fedavg"]),
            (f"FedBR ({_fedbr_label(cfg)})", t["fedbr"]),
            (f"DisTrans ({DisTransSettings.from_config(cfg).update})", t["distrans"]),
        ],
    )
    write_json(
        json_path,
        {
            "device": device,
            "model": resolved_model(cfg),
            "batch_size": run.batch_size,
            "fedavg_s_per_step": t["fedavg"],
            "fedbr_s_per_step": t["fedbr"],
            "ratio": t["fedbr"] / t["fedavg"],
            "distrans_s_per_step": t["distrans"],
            "distrans_ratio": t["distrans"] / t["fedavg"],
        },
    )
    return 0


def print_ratio_table(what: str, unit: str, digits: int, rows: list[tuple[str, float]]) -> None:
    """A markdown table of (label, seconds a ``unit``) rows, each with its ratio to the first row's seconds."""
    print(f"| {what} | s/{unit} (median) | ratio |\n|---|---|---|")
    for label, seconds in rows:
        print(f"| {label} | {seconds:.{digits}f} | {seconds / rows[0][1]:.2f} |")


def write_json(path: Path | None, payload: dict) -> None:
    if path:
        path.write_text(json.dumps(payload, indent=2) + "\n")


def _fedbr_label(cfg: dict) -> str:
    from clients.fedbr import FedBRSettings

    own = FedBRSettings.from_config(cfg)
    parts = [own.pseudo_data]
    if not own.balance:
        parts.append("no component 1")
    if not own.contrastive:
        parts.append("no component 2")
    elif not own.max_step:
        parts.append("no max step")
    return ", ".join(parts)


def cohort_header(mode: str, cfg: dict, device: str) -> str:
    """The first line of a mode that runs one cohort in process: what it runs, and where."""
    run = common(cfg)
    return (
        f"fedbr-bench --{mode}: {run.strategy}, {resolved_model(cfg)} on {run.dataset}, one cohort of "
        f"{run.num_clients} clients x {run.local_steps} steps x batch {run.batch_size}, {device}"
    )


def _device_name(cfg: dict, threads: int) -> str:
    if torch.cuda.is_available() and common(cfg).device != "cpu":
        return torch.cuda.get_device_name(0)
    return f"CPU x{threads}"


def flower_round_seconds(cfg: dict, rounds: int, out_dir: Path) -> tuple[list[dict], float]:
    """The timed rounds' records of a Flower simulation (rounds.jsonl: seconds, bytes, client memory),
    and the whole run's seconds including start-up."""
    cfg = {
        **cfg,
        "num-rounds": rounds + 1,
        "eval-every": rounds + 1,
        "global-test": False,
        "checkpoint-every": 0,
        "output-dir": str(out_dir),
    }
    start = time.perf_counter()
    run_flower(RunPlan.of(cfg), echo="none")
    total = time.perf_counter() - start
    return [r for r in read_jsonl(out_dir / "rounds.jsonl") if r["round"] > 1], total


def compare(cfg: dict, rounds: int) -> dict:
    """Bare loop and both Flower engines on one config: seconds per round (medians), their ratios, the
    achieved TFLOP/s, the clients' peak memory and the bytes Flower's fit messages carry per round."""
    run = common(cfg)
    bare, bare_memory = bare_loop_round_seconds(cfg, rounds)
    with tempfile.TemporaryDirectory(prefix="fedbr-bench-") as tmp:
        records, flower_total = flower_round_seconds(cfg, rounds, Path(tmp))
    with tempfile.TemporaryDirectory(prefix="fedbr-bench-") as tmp:
        cohort_records, _ = flower_round_seconds(cohort_config(cfg), rounds, Path(tmp))
    bare_s = statistics.median(bare)
    flower_s = statistics.median(r["seconds"] for r in records)
    cohort_s = statistics.median(r["seconds"] for r in cohort_records)
    flops = fit_flops(cfg) * statistics.median(r["clients"] for r in records)
    memory_key = "client_peak_gpu_mb" if any("client_peak_gpu_mb" in r for r in records) else "client_peak_rss_mb"
    return {
        "strategy": run.strategy,
        "dataset": run.dataset,
        "model": resolved_model(cfg),
        "clients": run.num_clients,
        "local_steps": run.local_steps,
        "batch_size": run.batch_size,
        "precision": run.precision,
        "tf32": run.tf32,
        "compile": run.compile,
        "bare_s_per_round": bare_s,
        "flower_s_per_round": flower_s,
        "ratio": flower_s / bare_s,
        "cohort_s_per_round": cohort_s,
        "cohort_ratio": cohort_s / bare_s,
        "flops_per_round": flops,
        "tflops": {
            "bare": flops / bare_s / 1e12,
            "clients": flops / flower_s / 1e12,
            "cohort": flops / cohort_s / 1e12,
        },
        "flower_total_s_incl_startup": flower_total,
        "bare_peak_mb": bare_memory,
        "client_peak_mb": max(r.get(memory_key, 0.0) for r in records),
        "cohort_peak_mb": max(r.get(memory_key, 0.0) for r in cohort_records),
        "memory": "GPU (torch reserved)" if memory_key == "client_peak_gpu_mb" else "host RSS",
        "bytes_per_round": statistics.median(r["bytes_down"] + r["bytes_up"] for r in records),
        "flower_setup": f"{run.num_clients} simulated clients, {run.client_cpus} CPU / {run.client_gpus:g} GPU each",
    }


def cohort_config(cfg: dict) -> dict:
    """The same run on the cohort engine, sized as ``fedbr-run engine=cohort`` sizes it on this machine (or on
    the Ray cluster it joins: ``ray-address``)."""
    plain = {**cfg, "engine": "cohort", "cohorts": 0, "client-cpus": 1, "client-gpus": 0.0}
    if requested_address(common(plain).ray_address):
        return size_for_runtime(plain)
    return size_resources(plain, torch.cuda.is_available(), os.cpu_count() or 1, torch.cuda.device_count())


def fit_flops(cfg: dict) -> float:
    """FLOPs of one client's fit in round 1 (all its local steps, forward and backward), counted by torch: the
    fit of client 0 sent what the strategy sends it in round 1 (``BareServer``)."""
    from .flops import FitFlopCounter

    device = use_device(cfg)
    client = client_class(common(cfg).strategy)(cfg, load_client_data(cfg, 0, device), device)
    server = BareServer(cfg)
    server.connect([client])
    arrays, config = server.messages(1, server.initial_arrays())[client.pid]
    counter = FitFlopCounter()
    with counter:
        client.fit(arrays, config)
    return float(counter.get_total_flops())


def bench_cohort(cfg: dict, device: torch.device) -> tuple[Any, list[int], Callable[..., dict], dict]:
    """One cohort holding every client of ``cfg`` on ``device`` in this process (no Flower): the cohort, its
    members' ids, the fit config of a round (``config_of(server_round, pid)``), and the arrays the strategy sends
    every client in round 1 (the server's initial weights, and SCAFFOLD's control variate, FedCM's direction)."""
    run = common(cfg)
    from ..app.node import CohortClient

    members, packed = load_cohort_data(cfg, list(range(run.num_clients)), device)
    cohort = CohortClient(client_class(run.strategy)(cfg, members[0], device), members, packed)
    server = BareServer(cfg)

    # what the strategy asks the clients (the RSM means); member(pid) rebinds the one algorithm, so it is asked per call
    asked = {pid: SimpleNamespace(answer=lambda config, pid=pid: cohort.member(pid).answer(config)) for pid in members}
    server.connect(asked)
    initial = server.initial_arrays()
    arrays = {**initial, **server.strategy.round_arrays(1, initial)}
    return cohort, list(members), round_configs(server), arrays


# The GPU speed levers, each against strict fp32. Besides config keys, a lever may set "step" (the cohort's step
# on a GPU: graph, or vmap), "deterministic" (torch's deterministic algorithms) and "nudge" (start from the global
# model moved by one rounding: how far the local steps carry a difference as small as a kernel's rounding, on
# any device), and an "again" row is measured against the row before it: how far two runs of the same thing
# land apart.
STRICT = {"tf32": False, "cudnn-autotune": False}
LEVERS: dict[str, dict[str, Any]] = {
    "strict fp32": STRICT,
    "strict fp32, again": STRICT,
    "tf32": {"tf32": True, "cudnn-autotune": False},
    "cudnn autotune": {"tf32": False, "cudnn-autotune": True},
    "tf32 + autotune (the defaults)": {"tf32": True, "cudnn-autotune": True},
    "bf16 + autotune": {"tf32": True, "cudnn-autotune": True, "precision": "bf16"},
    "tf32 + autotune, compiled step": {"tf32": True, "cudnn-autotune": True, "compile": True},
    "tf32 + autotune, compiled step, vmap": {"tf32": True, "cudnn-autotune": True, "compile": True, "step": "vmap"},
    "strict fp32, matmul convolutions": {**STRICT, "cohort-conv": "matmul"},
    "tf32 + autotune, matmul convolutions": {"tf32": True, "cudnn-autotune": True, "cohort-conv": "matmul"},
    "strict fp32, vmap step": {**STRICT, "step": "vmap"},
    "strict fp32, vmap step, again": {**STRICT, "step": "vmap"},
    "strict fp32, deterministic algorithms": {**STRICT, "deterministic": True},
    "strict fp32, deterministic algorithms, again": {**STRICT, "deterministic": True},
    "strict fp32, deterministic algorithms, nudged by one rounding": {**STRICT, "deterministic": True, "nudge": True},
}
NOT_CONFIG = ("step", "deterministic", "nudge")
FROM_THE_ROW_BEFORE = (", again", ", nudged by one rounding")


def nudged_by_one_rounding(arrays: dict, seed: int = 0) -> dict:
    """The arrays with each float element moved up or down (at random, seeded) by the gap to the next float."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, value in arrays.items():
        value = np.asarray(value)
        if value.dtype.kind == "f":
            value = value + rng.choice(np.array([-1, 1], dtype=value.dtype), size=value.shape) * np.spacing(value)
        out[name] = value
    return out


def lever_rows(cfg: dict, rounds: int) -> list[dict]:
    """Each of ``LEVERS`` on one cohort of every client (the cohort's own step: graph on a GPU, else vmap): the
    median seconds of ``rounds`` rounds after a warm-up one (whose seconds are kept: a compiled step compiles in
    it), and how far its first round's updates land from strict fp32's, or for an "again" or "nudged" row from
    the row before's (the norm of the difference over the norm of the reference update, all clients' arrays
    together). A lever that raises is a row with its error."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic cuBLAS asks for
    reference: list[np.ndarray] = []
    previous: list[np.ndarray] = []
    rows = []
    for name, lever in LEVERS.items():
        try:
            times, first = time_lever(cfg, lever, rounds)
        except Exception as error:  # a lever this machine cannot run is a row that says why, not the end
            why = f"{type(error).__name__}: {next(iter(str(error).splitlines()), '')}"
            rows.append({"lever": name, **lever, "error": why})
            print(f"| {name} | failed: {why} | | |", flush=True)
            continue
        reference = reference or first
        against = previous if name.endswith(FROM_THE_ROW_BEFORE) else reference
        rows.append(
            {
                "lever": name,
                **lever,
                "s_per_round": statistics.median(times[1:]),
                "first_round_s": times[0],
                "update_distance": relative_distance(first, against),
            }
        )
        previous = first
        row = rows[-1]
        print(f"| {name} | {row['s_per_round']:.3f} | {times[0]:.1f} | {row['update_distance']:.2e} |", flush=True)
    torch.use_deterministic_algorithms(False)
    return rows


def time_lever(cfg: dict, lever: dict, rounds: int) -> tuple[list[float], list[np.ndarray]]:
    """One lever on one cohort of every client: the seconds of a warm-up round and ``rounds`` more, and every
    client's updates of the first round."""
    run_cfg = {**cfg, **{k: v for k, v in lever.items() if k not in NOT_CONFIG}}
    torch.use_deterministic_algorithms(lever.get("deterministic", False), warn_only=True)
    device = use_device(run_cfg)
    cohort, members, config_of, arrays = bench_cohort(run_cfg, device)
    start_from = nudged_by_one_rounding(arrays) if lever.get("nudge") else arrays
    graph = device.type == "cuda" and lever.get("step", "graph") == "graph"
    times: list[float] = []
    first: list[np.ndarray] = []
    for server_round in range(1, rounds + 2):
        parts = [(pid, start_from, config_of(server_round, pid)) for pid in members]
        synchronize(device)
        start = time.perf_counter()
        results = cohort.fit_together(parts, graph=graph)
        synchronize(device)
        times.append(time.perf_counter() - start)
        first = first or updates_of(results, start_from)
    return times, first


def updates_of(results: list, global_arrays: dict) -> list[np.ndarray]:
    """Every client's float update (its arrays minus the global ones), in the order of the results."""
    return [
        np.asarray(arrays[name], dtype=np.float64) - np.asarray(global_arrays[name], dtype=np.float64)
        for _, arrays, _, _ in results
        for name in sorted(arrays)
        if name in global_arrays and np.asarray(arrays[name]).dtype.kind == "f"
    ]


def relative_distance(updates: list[np.ndarray], reference: list[np.ndarray]) -> float:
    difference = sum(float(np.sum((u - r) ** 2)) for u, r in zip(updates, reference, strict=True))
    size = sum(float(np.sum(r**2)) for r in reference)
    return (difference / size) ** 0.5 if size else 0.0


def levers_main(cfg: dict, rounds: int, threads: int, json_path: Path | None) -> int:
    run = common(cfg)
    device = _device_name(cfg, threads)
    print(f"{cohort_header('levers', cfg, device)}, {rounds} timed rounds\n")
    print(
        "| lever | s/round (median) | first round, a warm-up (s) | update's distance from strict fp32 (again, nudged: "
        "from the row before) |\n|---|---|---|---|",
        flush=True,
    )
    rows = lever_rows(cfg, rounds)
    write_json(json_path, {"device": device, "strategy": run.strategy, "model": resolved_model(cfg), "rows": rows})
    return 0


KERNEL_ROWS = 15  # the operators listed by --kernels; the rest are summed in one row
# What a round's device time is spent on, by kernel name (lower case; the first family that matches): cuDNN's,
# cuBLAS's and torch's kernels on a GPU, torch's operators on a CPU
KERNEL_FAMILIES = (
    ("NCHW <-> NHWC transposes", ("nchwtonhwc", "nhwctonchw")),
    ("im2col, col2im", ("im2col", "col2im")),
    ("copies", ("direct_copy", "aten::copy_", "aten::clone")),
    ("convolution and matrix arithmetic", ("conv", "gemm", "cutlass", "xmma", "aten::mm", "aten::bmm", "addmm")),
    ("reductions", ("reduce_kernel", "aten::sum", "aten::mean")),
    ("other elementwise", ("elementwise", "aten::add", "aten::mul", "aten::div", "aten::relu", "threshold")),
)


def kernel_family(name: str) -> str:
    lowered = name.lower()
    return next((family for family, marks in KERNEL_FAMILIES if any(m in lowered for m in marks)), "other")


def kernel_rows(cfg: dict) -> tuple[list[dict], dict[str, float], float, float]:
    """Where one round's device time goes: one cohort of every client in process, with the ``vmap`` step (the
    graph step's kernels are the same, but a replayed graph is not traced kernel by kernel), a warm-up round,
    then one round under torch's profiler. The operators by their own time on the device (on a GPU the
    kernels, on a CPU the operators' CPU time), most first; the seconds of each ``KERNEL_FAMILIES`` family
    over all of them, most first; the round's wall seconds and the device's busy seconds (the sum of those
    times)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    device = use_device(cfg)
    cohort, members, config_of, arrays = bench_cohort(cfg, device)
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
    cohort.fit_together([(pid, arrays, config_of(1, pid)) for pid in members], graph=False)
    synchronize(device)
    start = time.perf_counter()
    with profile(activities=activities) as profiler:
        cohort.fit_together([(pid, arrays, config_of(2, pid)) for pid in members], graph=False)
        synchronize(device)
    wall = time.perf_counter() - start
    # on a GPU only the device's own events (kernels, copies): an operator's "self" device time may repeat
    # its kernels' (pytorch issue 60783)
    events = [
        (event.key, event.count, (event.self_device_time_total if on_gpu else event.self_cpu_time_total) / 1e6)
        for event in profiler.key_averages()
        if not on_gpu or (event.device_type == DeviceType.CUDA and not event.is_user_annotation)
    ]
    events = sorted((e for e in events if e[2] > 0), key=lambda e: e[2], reverse=True)
    busy = sum(seconds for _, _, seconds in events)
    families: dict[str, float] = {}
    for key, _, seconds in events:
        family = kernel_family(key)
        families[family] = families.get(family, 0.0) + seconds
    families = dict(sorted(families.items(), key=lambda item: item[1], reverse=True))
    rows = [{"operator": key, "calls": calls, "seconds": seconds} for key, calls, seconds in events[:KERNEL_ROWS]]
    rest = events[KERNEL_ROWS:]
    if rest:
        rows.append(
            {
                "operator": f"the other {len(rest)}",
                "calls": sum(e[1] for e in rest),
                "seconds": sum(e[2] for e in rest),
            }
        )
    return rows, families, wall, busy


def kernels_main(cfg: dict, threads: int, json_path: Path | None) -> int:
    run = common(cfg)
    device = _device_name(cfg, threads)
    rows, families, wall, busy = kernel_rows(cfg)
    if not rows:
        print(
            "fedbr-bench: error: the profiler recorded no time on the device (on a GPU: is CUPTI there?)",
            file=sys.stderr,
        )
        return 1
    print(
        f"{cohort_header('kernels', cfg, device)}, vmap step, cohort-conv={run.cohort_conv}\n"
        f"one round under the profiler: {wall:.3f} s of wall time, the device busy {busy:.3f} s of it "
        f"({busy / wall:.0%})\n\n"
        "| operator or kernel (its own device time) | calls | seconds | share of the busy time |\n|---|---|---|---|"
    )
    for row in rows:
        print(f"| {row['operator'][:90]} | {row['calls']} | {row['seconds']:.4f} | {row['seconds'] / busy:.1%} |")
    print("\n| kernel family (by name) | seconds | share of the busy time |\n|---|---|---|")
    for family, seconds in families.items():
        print(f"| {family} | {seconds:.4f} | {seconds / busy:.1%} |")
    write_json(
        json_path,
        {
            "device": device,
            "strategy": run.strategy,
            "model": resolved_model(cfg),
            "wall_s": wall,
            "busy_s": busy,
            "rows": rows,
            "families": families,
        },
    )
    return 0


def cohort_step_seconds(cfg: dict, rounds: int) -> dict[str, float]:
    """One cohort holding all the clients, in this process (no Flower): seconds per round of fitting every
    client with ``cohort-step=loop`` (one after another), with ``vmap`` (all at once) and, on CUDA, with
    ``graph`` (vmap, the step replayed as a CUDA graph), timed in alternation after a warm-up round of each;
    medians."""
    device = use_device(cfg)
    cohort, members, config_of, arrays = bench_cohort(cfg, device)

    def loop(parts):
        for pid, own_arrays, config in parts:
            cohort.member(pid).fit(own_arrays, config)

    ways = {"loop": loop, "vmap": lambda parts: cohort.fit_together(parts, graph=False)}
    if device.type == "cuda":
        ways["graph"] = lambda parts: cohort.fit_together(parts, graph=True)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for server_round in range(1, rounds + 2):
        parts = [(pid, arrays, config_of(server_round, pid)) for pid in members]
        for name, fit in ways.items():
            synchronize(device)
            start = time.perf_counter()
            fit(parts)
            synchronize(device)
            if server_round > 1:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def cohort_step_main(cfg: dict, rounds: int, threads: int, json_path: Path | None) -> int:
    run = common(cfg)
    t = cohort_step_seconds(cfg, rounds)
    device = _device_name(cfg, threads)
    print(f"{cohort_header('cohort-step', cfg, device)}, {rounds} timed rounds\n")
    labels = {
        "loop": "loop (clients one after another)",
        "vmap": "vmap (all clients at once)",
        "graph": "graph (vmap replayed as a CUDA graph)",
    }
    print_ratio_table("cohort-step", "round", 3, [(labels[name], seconds) for name, seconds in t.items()])
    write_json(
        json_path,
        {
            "device": device,
            "strategy": run.strategy,
            "model": resolved_model(cfg),
            "clients": run.num_clients,
            **{f"{name}_s_per_round": v for name, v in t.items()},
        },
    )
    return 0


# dense peak TFLOP/s of the cards we measure on (vendor figures, half the sparse ones), by the arithmetic the
# convolutions and matrix products run in: fp32 without tensor cores, tf32 (fp32 runs with tf32=true, the
# default) and bf16. A card's name picks its longest entry: the PCIe and NVL parts are slower than the SXM ones.
PEAK_TFLOPS = {
    "H100": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.0},
    "H100 PCIe": {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0},
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5},
    "H200": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.0},
    "H200 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0},
}


def arithmetic(row: dict) -> str:
    """What a bench row's convolutions and matrix products ran in: bf16, tf32 (fp32 with tf32=true) or fp32."""
    return "tf32" if row["precision"] == "fp32" and row.get("tf32") else row["precision"]


def peak_tflops(device: str, arithmetic: str) -> float | None:
    names = [name for name in PEAK_TFLOPS if name in device]
    return PEAK_TFLOPS[max(names, key=len)][arithmetic] if names else None


# The shapes: RotatedMNIST's CNN at batch 64, and CIFAR-size VGG11 and CCT at batch 32 on
# synthetic data (no CIFAR files needed). Each runs FedAvg, FedBR and DisTrans.
SUITE = {
    "rotmnist-cnn": {"dataset": "mnist5k", "model": "cnn", "batch-size": 64},
    "cifar-vgg11": {"dataset": "synthetic", "model": "vgg11", "batch-size": 32},
    "cifar-cct": {"dataset": "synthetic", "model": "cct", "batch-size": 32},
}
SUITE_STRATEGIES = ("fedavg", "fedbr", "distrans")


def suite_configs(
    items: list[str], shapes: list[str], strategies: Sequence[str] = SUITE_STRATEGIES
) -> list[tuple[str, dict]]:
    """(shape, config) for every shape and strategy; the user's items come after the shape's settings."""
    unknown = sorted(set(shapes) - set(SUITE)) + sorted(set(strategies) - set(SUITE_STRATEGIES))
    if unknown:
        raise ConfigError(
            f"unknown shape(s) or strategies {', '.join(unknown)}; valid: {', '.join(SUITE)}; "
            f"{', '.join(SUITE_STRATEGIES)}"
        )
    out = []
    for shape in shapes:
        for strategy in strategies:
            preset = [f"{k}={v}" for k, v in {**SUITE[shape], "strategy": strategy}.items()]
            out.append((shape, build_config(preset + items)))
    return out


def suite_main(
    items: list[str],
    shapes: list[str],
    strategies: list[str],
    rounds: int,
    steps: int,
    threads: int,
    json_path: Path | None,
) -> int:
    configs = [
        (shape, size_resources(cfg, torch.cuda.is_available(), threads))
        for shape, cfg in suite_configs(items, shapes, strategies)
    ]
    device = _device_name(configs[0][1], threads)
    first = common(configs[0][1])
    print(
        f"fedbr-bench --suite on {device}: {first.num_clients} clients x {first.local_steps} local steps, "
        f"{rounds} timed rounds after one warm-up, precision {first.precision}, compile {first.compile}",
        flush=True,
    )
    rows = []
    for shape, cfg in configs:
        strategy = common(cfg).strategy
        print(f"  {shape} {strategy} ...", flush=True)
        try:
            row = compare(cfg, rounds)
        except RunFailed as exc:
            print(f"fedbr-bench: error: {shape} {strategy}: {exc}", file=sys.stderr)
            return 1
        if strategy == strategies[0]:  # once per shape: FedAvg, FedBR and DisTrans steps on it
            row["step_s"] = step_seconds(cfg, steps=steps)
        rows.append({"shape": shape, **row})
    print_suite_table(rows, device)
    write_json(json_path, {"device": device, "rows": rows})
    return 0


def print_suite_table(rows: list[dict], device: str) -> None:
    memory = rows[0]["memory"]
    peak = peak_tflops(device, arithmetic(rows[0]))
    print(
        f"\n| shape | strategy | batch | bare s/round | engine=clients s/round (/ bare) | engine=cohort s/round "
        f"(/ bare) | TFLOP/s bare / clients / cohort | peak {memory} MB per client process, cohort process "
        f"(bare loop: whole process) | MB moved per round |\n|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        t = r["tflops"]
        print(
            f"| {r['shape']} | {r['strategy']} | {r['batch_size']} | {r['bare_s_per_round']:.3f} | "
            f"{r['flower_s_per_round']:.3f} ({r['ratio']:.2f}) | {r['cohort_s_per_round']:.3f} "
            f"({r['cohort_ratio']:.2f}) | {t['bare']:.3g} / {t['clients']:.3g} / {t['cohort']:.3g} | "
            f"{r['client_peak_mb']:.0f}, {r['cohort_peak_mb']:.0f} ({r['bare_peak_mb']:.0f}) | "
            f"{r['bytes_per_round'] / 1e6:.1f} |"
        )
    peak_text = f"{peak:g} TFLOP/s ({arithmetic(rows[0])}, dense)" if peak else "unknown (not in PEAK_TFLOPS)"
    print(f"\ndevice peak: {peak_text}")
    print(
        "\n| shape | FedAvg s/step | FedBR s/step | DisTrans s/step | FedBR / FedAvg step | FedBR / FedAvg round "
        "(bare) |\n|---|---|---|---|---|---|"
    )
    by_shape: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_shape.setdefault(r["shape"], {})[r["strategy"]] = r
    for shape, pair in by_shape.items():
        t = next(r["step_s"] for r in pair.values() if "step_s" in r)
        rounds = (
            f"{pair['fedbr']['bare_s_per_round'] / pair['fedavg']['bare_s_per_round']:.2f}"
            if {"fedbr", "fedavg"} <= set(pair)
            else "-"
        )
        print(
            f"| {shape} | {t['fedavg']:.4f} | {t['fedbr']:.4f} | {t['distrans']:.4f} | "
            f"{t['fedbr'] / t['fedavg']:.2f} "
            f"| {rounds} |"
        )
    for r in rows:
        if r["strategy"] == "fedbr" and r["shape"] == "rotmnist-cnn":
            best = min(r["flower_s_per_round"], r["cohort_s_per_round"])
            print(
                f"\nFedBR RotatedMNIST, {r['clients']} clients x {r['local_steps']} steps: 1000 rounds at the "
                f"faster engine's s/round = {1000 * best / 60:.1f} min (training rounds only, without evaluation)"
            )
    print(f"device: {device}")


SCALE = (
    ("100 clients, 10% a round", ["num-clients=100", "fraction-fit=0.1"]),
    ("1000 clients, 1% a round", ["num-clients=1000", "fraction-fit=0.01"]),
)


def peak_by_node(records: list[dict], key: str) -> dict[str, float]:
    """Each node's largest peak memory over the rounds (``key``: client_peak_rss_mb or client_peak_gpu_mb), when
    the clients ran on more than one node (a Ray cluster)."""
    peaks: dict[str, float] = {}
    for record in records:
        for node, mb in record.get(node_key(key), {}).items():
            peaks[node] = max(peaks.get(node, 0.0), mb)
    return peaks


def scale_main(items: list[str], rounds: int, threads: int, json_path: Path | None) -> int:
    """Many clients on one machine with engine=cohort: seconds per round and the cohort's peak memory."""
    rows = []
    for label, preset in SCALE:
        cfg = cohort_config(build_config(["engine=cohort", *preset, *items]))  # so that cohort-step=... is valid
        run = common(cfg)
        print(f"  {label}: {run.strategy}, {run.cohorts} cohort(s) ...", flush=True)
        with tempfile.TemporaryDirectory(prefix="fedbr-bench-") as tmp:
            try:
                records, total = flower_round_seconds(cfg, rounds, Path(tmp))
            except RunFailed as exc:
                print(f"fedbr-bench: error: {label}: {exc}", file=sys.stderr)
                return 1
        key = "client_peak_gpu_mb" if any("client_peak_gpu_mb" in r for r in records) else "client_peak_rss_mb"
        rows.append(
            {
                "case": label,
                "strategy": run.strategy,
                "cohorts": run.cohorts,
                "s_per_round": statistics.median(r["seconds"] for r in records),
                "peak_mb": max(r.get(key, 0.0) for r in records),
                "memory": key,
                "peak_mb_by_node": peak_by_node(records, key),
                "total_s_incl_startup": total,
            }
        )
    device = _device_name(cfg, threads)
    print(
        f"\n| case | strategy | cohorts | s/round (median) | peak MB ({rows[0]['memory']}) | peak MB by node "
        "| run incl. start-up s |\n|---|---|---|---|---|---|---|"
    )
    for r in rows:
        by_node = ", ".join(f"{node[:8]}: {mb:.0f}" for node, mb in sorted(r["peak_mb_by_node"].items())) or "-"
        print(
            f"| {r['case']} | {r['strategy']} | {r['cohorts']} | {r['s_per_round']:.3f} | {r['peak_mb']:.0f} | "
            f"{by_node} | {r['total_s_incl_startup']:.1f} |"
        )
    print(f"device: {device}")
    write_json(json_path, {"device": device, "rows": rows})
    return 0


# fedbr-bench's options in --help's order with their help; an option that is not a switch: its arguments in OPTIONS
HELP = {
    "--rounds": "timed rounds (after one warm-up round)",
    "--json": "also write the figures to this JSON file",
    "--report": "also write what the command prints, with its command, commit, machine, date and wall time, as "
    "its section of this markdown page (the same command on the same machine replaces its section)",
    "--step": "time one FedBR and one DisTrans local step against one FedAvg step instead of whole rounds",
    "--steps": "steps per timing repeat (--step, and --suite's step table)",
    "--suite": "bare loop against both Flower engines for FedAvg, FedBR and DisTrans on each shape "
    f"({', '.join(SUITE)}); the items apply to every case",
    "--shapes": "comma-separated shapes for --suite",
    "--strategies": "comma-separated strategies for --suite",
    "--cohort-step": "one cohort holding all clients, in process: cohort-step=loop against vmap (and graph on CUDA), "
    "s/round",
    "--levers": "one cohort holding all clients, in process: the GPU speed levers (tf32, cudnn-autotune, bf16, "
    "compile, cohort-conv=matmul) against strict fp32, s/round and how far each moves the update",
    "--kernels": "one cohort holding all clients, in process, one round under torch's profiler: the operators (on a "
    "GPU the kernels) that take the device's time, that time by kind of kernel, and how busy the device is",
    "--scale": "engine=cohort with 100 clients at fraction-fit 0.1 and 1000 at 0.01: s/round and peak memory",
    "--startup": "N whole processes per variant (fedbr-run per engine, with --superlink, the bare loop, pfl-research "
    "where it is installed), interleaved, on a fixed workload (the items apply on top): seconds per phase, from the "
    "command's start to its end (fedbr_flwr/bench/startup.py)",
    "--round-profile": "one default fedbr-run of that workload under py-spy (every thread, idle ones too): the "
    "simulation process's thread-seconds by part of a round (clients' training, messages, server, waits)",
    "--sweep-startup": "N 3-run fedbr-sweeps of that workload in one simulation process (the default) and with "
    "--isolated, interleaved: the fixed seconds (start-up, shut-down) of the first and the later runs",
}
OPTIONS: dict[str, dict[str, Any]] = {
    "--rounds": {"type": int, "default": 5},
    "--json": {"type": Path},
    "--report": {"type": Path, "metavar": "PAGE"},
    "--steps": {"type": int, "default": 20},
    "--shapes": {"default": ",".join(SUITE)},
    "--strategies": {"default": ",".join(SUITE_STRATEGIES)},
    "--startup": {"type": int, "metavar": "N"},
    "--sweep-startup": {"type": int, "metavar": "N"},
}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fedbr-bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("items", nargs="*", help="experiment YAML files and key=value overrides")
    for flag, help in HELP.items():
        parser.add_argument(flag, help=help, **OPTIONS.get(flag, {"action": "store_true"}))
    return parser


@quiet_when_its_reader_leaves
def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_intermixed_args(argv)
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    try:
        check_arguments(args, argv)
        return run_mode(args, threads) if args.report is None else run_and_report(args, argv, threads)
    except ConfigError as exc:  # a bad key, or a dataset that is not in data-dir
        print(f"fedbr-bench: error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"fedbr-bench: error: {exc}", file=sys.stderr)
        return 1


def check_arguments(args: argparse.Namespace, argv: list[str]) -> None:
    """A count below one, two modes, and a --json file or --report page that cannot be written stop the command
    before it measures, not after (a mode given 0 ran another mode, or raised at its end with its figures lost)."""
    for flag in [flag for flag, kwargs in OPTIONS.items() if kwargs.get("type") is int]:  # the counts
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: give 1 or more")
    modes = [flag for flag in HELP if flag not in OPTIONS or flag in ("--startup", "--sweep-startup")]
    if len(given := [flag for flag in modes if getattr(args, flag[2:].replace("-", "_"))]) > 1:  # one ran, unsaid
        raise ConfigError(f"{', '.join(given)}: give one of these modes")
    if args.json is not None:
        folder = args.json.expanduser().absolute().parent
        if args.json.is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
            raise ConfigError(f"--json {args.json}: not a file that can be written in an existing folder")
    if args.report is not None:
        from .page import check_page

        check_page(args.report, argv)


def run_and_report(args: argparse.Namespace, argv: list[str], threads: int) -> int:
    """``run_mode``, then what it printed as this command's section of the --report page, where it succeeded."""
    from .page import printed_and_kept, write_bench_report

    start = time.perf_counter()
    with printed_and_kept() as printed:
        code = run_mode(args, threads)
    if code == 0:
        write_bench_report(args.report, argv, printed.getvalue(), time.perf_counter() - start)
        print(f"report: this command's section of {args.report}")
    return code


def run_mode(args: argparse.Namespace, threads: int) -> int:
    if args.suite:
        return suite_main(
            args.items, args.shapes.split(","), args.strategies.split(","), args.rounds, args.steps, threads, args.json
        )
    if args.scale:
        return scale_main(args.items, args.rounds, threads, args.json)
    from .startup import default_variants, round_profile_main, startup_main, sweep_main

    cfg = build_config(args.items)  # a bad key stops here, not in the first run
    if args.sweep_startup:
        return sweep_main(args.items, args.sweep_startup, args.json)
    if args.round_profile:
        return round_profile_main(args.items, args.json)
    if args.startup:
        return startup_main(args.items, args.startup, default_variants(), args.json)
    cfg = size_resources(cfg, torch.cuda.is_available(), threads)
    if args.step:  # reads no files (synthetic inputs of the dataset's shapes)
        return step_main(cfg, args.steps, threads, args.json)
    if args.cohort_step:
        return cohort_step_main(cfg, args.rounds, threads, args.json)
    if args.levers:
        return levers_main(cfg, args.rounds, threads, args.json)
    if args.kernels:
        return kernels_main(cfg, threads, args.json)
    return compare_main(cfg, args.rounds, threads, args.json)


def compare_main(cfg: dict, rounds: int, threads: int, json_path: Path | None) -> int:
    run = common(cfg)
    print(
        f"fedbr-bench: {run.strategy} on {run.dataset}, {run.num_clients} clients x "
        f"{run.local_steps} steps x batch {run.batch_size}, {rounds} timed rounds",
        flush=True,
    )
    result = compare(cfg, rounds)
    device = _device_name(cfg, threads)
    result = {
        "device": device,
        **result,
        "bare_setup": f"one process, {threads} torch threads, clients one after another",
    }
    print("\n| path | s/round (median) | ratio |\n|---|---|---|")
    print(f"| bare PyTorch loop ({result['bare_setup']}) | {result['bare_s_per_round']:.3f} | 1.00 |")
    print(
        f"| Flower simulation, engine={run.engine} ({result['flower_setup']}) | {result['flower_s_per_round']:.3f} | "
        f"{result['ratio']:.2f} |"
    )
    print(
        "| Flower simulation, engine=cohort (nodes and cores as fedbr-run engine=cohort sizes them) | "
        f"{result['cohort_s_per_round']:.3f} | {result['cohort_ratio']:.2f} |"
    )
    print(
        f"\ndevice: {device}; Flower run incl. start-up and final evaluation: "
        f"{result['flower_total_s_incl_startup']:.1f} s; peak {result['memory']} per client process "
        f"{result['client_peak_mb']:.0f} MB; fit messages {result['bytes_per_round'] / 1e6:.2f} MB per round"
    )
    write_json(json_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
