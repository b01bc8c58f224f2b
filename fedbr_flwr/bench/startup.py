"""``fedbr-bench --startup``: where the seconds of one ``fedbr-run`` go, from outside, as a user sees them.

Each repetition runs every variant as a new process: ``fedbr-run ITEMS --verbose`` with each engine, through
Flower's simulation entry point (the default: the clients in its process; and on Ray) and through ``flwr run`` on a
SuperLink (``--superlink``, on Ray), and the bare PyTorch loop (``python -m fedbr_flwr.bench.startup ITEMS``: the same
clients, local steps and averaging in one process, no Flower, no Ray). It stamps every line a process prints with
the time it arrived and reads the milestones from those lines (Flower's and the ServerApp's own log, the same lines
from the bare loop); the variants are interleaved. Per phase it reports the median over repetitions."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from ..app.flower_adapter import ENGINE_FRAMES
from ..core.config import common

# The workload: 10 clients, all every round, 20 rounds of 10 SGD steps of 32 at lr 0.02, the small
# CNN, the embedded data, one evaluation at the end.
WORKLOAD = [
    "num-clients=10",
    "num-rounds=20",
    "local-steps=10",
    "batch-size=32",
    "lr=0.02",
    "model=cnn-small",
    "eval-every=20",
    "global-test=false",
    "checkpoint-every=0",
]

# (phase, the line that ends it); a phase starts where the one before it ended (the first at the spawn)
MILESTONES = (
    ("command: imports, config, partition", re.compile(r"^(fedbr-run|bare loop|pfl-research): \S+ on ")),
    ("SuperLink up, `flwr run` connected", re.compile(r"Using SuperLink")),
    (
        "simulation process up (backend=ray: Ray too)",
        re.compile(r"Starting Flower Simulation|fedbr simulation: run \d+"),
    ),
    ("ServerApp started (its imports; --superlink: Ray too)", re.compile(r"Starting Flower ServerApp")),
    ("clients up, data loaded (discovery)", re.compile(r"\[(fedbr|bare|pfl)\] \d+ clients (found|built)")),
    ("rounds", re.compile(r"\[(fedbr|bare|pfl)\] round (\d+)/\2 ")),
    ("final evaluation, run files", re.compile(r"\[(fedbr\] run files in|(bare|pfl)\] evaluated) ")),
)
SHUTDOWN = "shut-down (to the end of the command)"


def timed_lines(command: list[str]) -> tuple[list[tuple[float, str]], float, int]:
    """Every line ``command`` prints with the seconds since its start when it arrived; its total seconds and
    exit code."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append((time.perf_counter() - start, line.rstrip("\n")))
    code = proc.wait()
    return lines, time.perf_counter() - start, code


def busy_cpu_seconds() -> float | None:
    """CPU seconds every process of this machine has used since boot (/proc/stat; None where there is none)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    ticks = [int(f) for f in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle and iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU seconds of this process's finished children (and theirs, where they waited for them)."""
    times = os.times()
    return times.children_user + times.children_system


def others_share(busy: float, ours: float, wall: float, cores: int) -> float:
    """The share of the machine's cores that other processes used over ``wall`` seconds in which the machine was
    busy for ``busy`` CPU seconds, ``ours`` of them the measured process's."""
    return max(0.0, busy - ours) / (wall * cores) if wall > 0 else 0.0


QUIET_SHARE = 0.10  # above this, other processes' use of the cores makes every ratio close toward 1


def quiet_line(shares: list[float], bare_round: float | None) -> str:
    """What the table's figures were measured on: the bare loop's own seconds a round, and how busy the machine
    was with other processes, with a warning when any run shared it."""
    bare = f"bare loop {bare_round:.3f} s a round; " if bare_round is not None else ""
    if not shares:
        return f"\n{bare}how busy the machine was is not known here (no /proc/stat)"
    worst = max(shares)
    line = (
        f"\n{bare}other processes used at most {worst:.0%} of the cores during a run (runs on Ray or a SuperLink aside)"
    )
    if worst > QUIET_SHARE:
        line += (
            f"\nwarning: the machine was not quiet (over {QUIET_SHARE:.0%} of its cores busy with other processes "
            "during a run): every ratio closes toward 1; measure again on a quiet machine"
        )
    return line


def failed(label: str, code: int, lines: list[tuple[float, str]]) -> int:
    """Say that a timed process failed, with the last lines it printed; the exit code for fedbr-bench."""
    tail = "\n".join(text for _, text in lines[-20:])
    print(f"fedbr-bench: error: {label} exited {code}:\n{tail}", file=sys.stderr)
    return 1


def phases(lines: list[tuple[float, str]], total: float) -> dict[str, float]:
    """Seconds of each phase of one run, from its stamped lines (a milestone not seen: the phase is absent)."""
    out, last = {}, 0.0
    for name, pattern in MILESTONES:
        seen = next((t for t, text in lines if pattern.search(text)), None)
        if seen is not None:
            out[name], last = seen - last, seen
    out[SHUTDOWN] = total - last
    return out


def steady_round_seconds(out_dir: Path) -> float:
    """The median seconds of the rounds after the first (rounds.jsonl)."""
    from ..runfiles.metrics import read_jsonl

    return steady_seconds(read_jsonl(out_dir / "rounds.jsonl"))


PFL = "pfl-research"  # the workload in pfl-research (fedbr_flwr/bench/startup_pfl.py), where pfl is installed
PFL_SKIPPED = (
    "fedbr-bench: the pfl-research column is skipped: pfl is not installed "
    "(pip install -e '.[pfl]', or pip install 'pfl[pytorch]==0.6.0')"
)


def default_variants(say: Callable[[str], object] = print) -> list[str]:
    """The variants ``fedbr-bench --startup`` runs: every one of ``VARIANTS``, pfl-research only where pfl is
    importable (else ``say`` says its column is skipped)."""
    if importlib.util.find_spec("pfl") is None:
        say(PFL_SKIPPED)
        return [v for v in VARIANTS if v != PFL]
    return list(VARIANTS)


VARIANTS = {  # label: (how the process starts, its own items)
    "engine=cohort": ("fedbr-run", ["engine=cohort"]),
    "engine=clients": ("fedbr-run", ["engine=clients"]),
    "engine=cohort, backend=ray": ("fedbr-run", ["engine=cohort", "backend=ray"]),
    "engine=clients, --superlink": ("fedbr-run", ["engine=clients", "--superlink"]),
    "bare loop": ("bare", []),
    PFL: ("pfl", []),
}
# variants whose runs start processes the command does not wait for (Ray's, the SuperLink's): their CPU time would
# count as other processes', so how quiet the machine was is read from the other variants' runs
DETACHED = ("engine=cohort, backend=ray", "engine=clients, --superlink")
MODULES = {
    "fedbr-run": "fedbr_flwr.commands.cli",
    "bare": "fedbr_flwr.bench.startup",
    "pfl": "fedbr_flwr.bench.startup_pfl",
}


def variant_command(variant: str, items: Sequence[str], out: Path) -> list[str]:
    how, own = VARIANTS[variant]
    extra = ["--verbose"] if how == "fedbr-run" else []
    return [sys.executable, "-m", MODULES[how], *WORKLOAD, *items, *own, f"output-dir={out}", *extra]


def startup_main(items: Sequence[str], repeats: int, variants: Sequence[str], json_path: Path | None) -> int:
    rows: dict[str, list[dict[str, float]]] = {variant: [] for variant in variants}
    shares: list[float] = []
    for i in range(repeats):
        for variant in variants:
            with tempfile.TemporaryDirectory(prefix="fedbr-startup-") as tmp:
                out = Path(tmp) / "run"
                busy, ours = busy_cpu_seconds(), children_cpu_seconds()
                lines, total, code = timed_lines(variant_command(variant, items, out))
                if code != 0:
                    return failed(f"{variant} run {i + 1}", code, lines)
                busy_after = busy_cpu_seconds()
                if busy is not None and busy_after is not None and variant not in DETACHED:
                    cores = os.cpu_count() or 1
                    shares.append(others_share(busy_after - busy, children_cpu_seconds() - ours, total, cores))
                row = {**phases(lines, total), "whole process": total, "per round, steady": steady_round_seconds(out)}
                rows[variant].append(row)
                print(f"  {variant} run {i + 1}/{repeats}: {total:.1f} s", flush=True)
    names = [name for name, _ in MILESTONES] + [SHUTDOWN, "whole process", "per round, steady"]
    medians = {
        v: {n: statistics.median(r[n] for r in rs if n in r) for n in names if any(n in r for r in rs)}
        for v, rs in rows.items()
    }
    print(f"\nmedian seconds over {repeats} run(s) of each variant, interleaved (-: no such phase):\n")
    print("| phase | " + " | ".join(variants) + " |")
    print("|---|" + "---|" * len(variants))
    for name in names:
        print(
            f"| {name} | "
            + " | ".join(f"{medians[v][name]:.2f}" if name in medians[v] else "-" for v in variants)
            + " |"
        )
    print(ratios_line(medians, variants))
    print(quiet_line(shares, medians.get("bare loop", {}).get("per round, steady")))
    if json_path:
        payload = {"workload": [*WORKLOAD, *items], "medians": medians, "runs": rows, "others_share": shares}
        json_path.write_text(json.dumps(payload, indent=2))
    return 0


def ratios_line(medians: dict[str, dict[str, float]], variants: Sequence[str]) -> str:
    """Each variant's whole process and steady round against the bare loop's (when it ran)."""
    if "bare loop" not in medians:
        return ""
    bare = medians["bare loop"]
    parts = [
        f"{v}: {medians[v]['whole process'] / bare['whole process']:.2f}x whole, "
        f"{medians[v]['per round, steady'] / bare['per round, steady']:.2f}x per round"
        for v in variants
        if v != "bare loop"
    ]
    return "\nagainst the bare loop: " + "; ".join(parts)


SWEEP_FILE = "sweep:\n  seeds: [0, 1, 2]\n  runs:\n    workload: {}\n"
SWEEP_MODES = {"one process (default)": [], "--isolated": ["--isolated"]}
SWEEP_RUNS = 3


def sweep_fixed_seconds(lines: list[tuple[float, str]]) -> list[dict[str, float]]:
    """Per run of a ``fedbr-sweep`` (its stamped lines), the phases of the single-run table outside its rounds:
    start-up (from the sweep's line naming the run to the ServerApp's line saying its clients are found, where
    the first round starts), shut-down (from its last round to the sweep's line saying how it ended) and
    their sum."""
    runs, current = [], {}
    for t, text in lines:
        if re.match(r"fedbr-sweep: \[\d+/\d+\] .* -> ", text):
            current = {"start": t}
        elif "found" not in current and re.search(r"\[fedbr\] \d+ clients found", text) and current:
            current["found"] = t
        elif re.search(r"round (\d+)/\1 ", text) and current:
            current["last"] = t
        elif re.match(r"fedbr-sweep: \[\d+/\d+\] .*: (ok|failed)", text) and {"found", "last"} <= set(current):
            start_up, shut_down = current["found"] - current["start"], t - current["last"]
            runs.append({"start-up": start_up, "shut-down": shut_down, "fixed": start_up + shut_down})
            current = {}
    return runs


def sweep_main(items: Sequence[str], repeats: int, json_path: Path | None) -> int:
    """A 3-run ``fedbr-sweep`` of the workload (seeds 0-2) in one simulation process (the default) and with
    ``--isolated`` (each run a process of its own), interleaved: the fixed seconds of each run."""
    rows: dict[str, list[list[dict[str, float]]]] = {mode: [] for mode in SWEEP_MODES}
    totals: dict[str, list[float]] = {mode: [] for mode in SWEEP_MODES}
    for i in range(repeats):
        for mode, flags in SWEEP_MODES.items():
            with tempfile.TemporaryDirectory(prefix="fedbr-startup-") as tmp:
                (Path(tmp) / "sweep.yaml").write_text(SWEEP_FILE)
                command = [sys.executable, "-m", "fedbr_flwr.commands.sweep", str(Path(tmp) / "sweep.yaml"), *WORKLOAD]
                command += [*items, "--out", str(Path(tmp) / "out"), *flags]
                lines, total, code = timed_lines(command)
                runs = sweep_fixed_seconds(lines)
                if code != 0 or len(runs) != SWEEP_RUNS:
                    return failed(f"sweep {mode} {i + 1}", code, lines)
                rows[mode].append(runs)
                totals[mode].append(total)
                print(f"  sweep, {mode}, {i + 1}/{repeats}: {total:.1f} s", flush=True)
    print(f"\nmedian seconds per run of a {SWEEP_RUNS}-run sweep over {repeats} sweep(s) of each mode, interleaved:\n")
    print(
        "| mode | run 1 start-up | run 1 shut-down | later runs' start-up | later runs' shut-down | "
        "later runs' fixed | "
        "whole sweep |"
    )
    print("|---|---|---|---|---|---|---|")
    medians: dict[str, dict] = {}
    for mode, sweeps in rows.items():
        first = [s[0] for s in sweeps]
        later = [r for s in sweeps for r in s[1:]]
        medians[mode] = {
            "first": {k: statistics.median(r[k] for r in first) for k in first[0]},
            "later": {k: statistics.median(r[k] for r in later) for k in later[0]},
            "later, largest fixed": max(r["fixed"] for r in later),
            "whole sweep": statistics.median(totals[mode]),
        }
        f, rest = medians[mode]["first"], medians[mode]["later"]
        print(
            f"| {mode} | {f['start-up']:.2f} | {f['shut-down']:.2f} | {rest['start-up']:.2f} | "
            f"{rest['shut-down']:.2f} | {rest['fixed']:.2f} (at most {medians[mode]['later, largest fixed']:.2f}) | "
            f"{medians[mode]['whole sweep']:.1f} |"
        )
    if json_path:
        json_path.write_text(json.dumps({"workload": [*WORKLOAD, *items], "medians": medians, "runs": rows}, indent=2))
    return 0


def milestone_main(cfg: dict, label: str, tag: str, train: Callable) -> int:
    """A loop of the workload as a process of its own (the bare loop, pfl-research): prints the milestones
    ``phases`` reads (``{label}: ...``, ``[{tag}] ...``) and writes the rounds' seconds to
    ``output-dir/rounds.jsonl`` (what ``steady_round_seconds`` reads). ``train(cfg, device, on_start,
    on_round)`` runs the rounds and returns the mean local-test accuracy."""
    run = common(cfg)
    import torch

    from ..core.training import use_device

    out = Path(run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(os.cpu_count() or 1)
    rounds = run.num_rounds
    print(
        f"{label}: {run.strategy} on {run.dataset}, {run.num_clients} clients, {rounds} rounds",
        flush=True,
    )
    records = []

    def on_round(server_round: int, seconds: float) -> None:
        records.append({"round": server_round, "seconds": seconds})
        print(f"[{tag}] round {server_round}/{rounds} | {seconds:.2f} s", flush=True)

    def on_start() -> None:
        print(f"[{tag}] {common(cfg).num_clients} clients built", flush=True)

    accuracy = train(cfg, use_device(cfg), on_start, on_round)
    print(f"[{tag}] evaluated : mean local-test acc {accuracy:.2%}", flush=True)
    (out / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return 0


def bare_main(argv: Sequence[str]) -> int:
    """The bare loop as a process of its own (``milestone_main``)."""
    from ..launch.plan import build_config

    def train(cfg, device, on_start, on_round) -> float:
        from .bare import bare_loop

        _, clients, arrays = bare_loop(cfg, common(cfg).num_rounds, device, on_start, on_round)
        return statistics.mean(client.evaluate(arrays, {})[2]["accuracy"] for client in clients)

    return milestone_main(build_config(argv), "bare loop", "bare", train)


if __name__ == "__main__":
    sys.exit(bare_main(sys.argv[1:]))


# ``fedbr-bench --round-profile``: a default run of the workload sampled by py-spy (every thread, idle ones too),
# its simulation process's samples sorted into the parts of a round. Each part: (name, the frames that mark it);
# the first part whose mark a sample's stack holds takes it.
PROFILE_RATE = 100  # samples a second, per thread
ROUND_PARTS = (
    ("clients: local training", ("run_local_steps (",)),
    ("clients: evaluation", ("ClientAlgorithm.evaluate (", "evaluate_members (")),
    ("clients: the message's arrays, state and context (decode, encode, copies)", ("process_message (fedbr_flwr",)),
    ("clients: waiting for a message (idle)", (ENGINE_FRAMES["worker"],)),
    ("server: configure_fit (sampling, the round's messages)", ("configure_fit (fedbr_flwr",)),
    ("server: aggregate_fit (update checks, aggregation, the round's record)", ("aggregate_fit (fedbr_flwr",)),
    ("server: evaluate, configure/aggregate_evaluate, checkpoints", ("evaluate (fedbr_flwr/server",)),
    ("server: waiting for the replies (idle)", (ENGINE_FRAMES["replies"],)),
    ("engine: handing messages over (mostly idle)", ENGINE_FRAMES["hand-over"]),
)
OTHER_PART = "other threads (imports, run host, Flower's bookkeeping; mostly idle)"


def profile_parts(raw_lines: Sequence[str], process_mark: str = "fedbr_flwr.launch.simulation") -> dict[str, int]:
    """Samples per part of ``ROUND_PARTS`` (else ``OTHER_PART``) in py-spy's raw output (``--threads``: one line
    per distinct stack, ``frame;frame;... count``), counting only stacks of the process whose command line holds
    ``process_mark``."""
    parts: dict[str, int] = {}
    for line in raw_lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit() or process_mark not in stack.split(";thread (", 1)[0]:
            continue
        part = next((name for name, marks in ROUND_PARTS if any(m in stack for m in marks)), OTHER_PART)
        parts[part] = parts.get(part, 0) + int(count)
    return parts


def profile_table(parts: dict[str, int], rounds: int, rate: int = PROFILE_RATE) -> str:
    """The parts as a markdown table: thread-seconds in all and milliseconds per round."""
    rows = [name for name, _ in ROUND_PARTS] + [OTHER_PART]
    lines = ["| part | thread-seconds | ms per round |", "|---|---|---|"]
    for name in rows:
        seconds = parts.get(name, 0) / rate
        lines.append(f"| {name} | {seconds:.2f} | {1000 * seconds / max(rounds, 1):.1f} |")
    return "\n".join(lines)


def round_profile_main(items: Sequence[str], json_path: Path | None) -> int:
    """A default ``fedbr-run`` of the workload under ``py-spy record`` (its child processes, every thread, idle
    ones too): where the simulation process's thread-seconds go, in all and per round."""
    import shutil

    spy = shutil.which("py-spy")
    if spy is None:
        print("fedbr-bench: error: --round-profile needs py-spy on the PATH: pip install py-spy", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="fedbr-profile-") as tmp:
        out, raw = Path(tmp) / "run", Path(tmp) / "profile.txt"
        run = [sys.executable, "-m", MODULES["fedbr-run"], *WORKLOAD, *items, f"output-dir={out}", "--quiet"]
        record = [
            spy,
            "record",
            "--nonblocking",
            "--subprocesses",
            "--idle",
            "--threads",
            "-r",
            str(PROFILE_RATE),
            "-f",
            "raw",
        ]
        start = time.perf_counter()
        done = subprocess.run([*record, "-o", str(raw), "--", *run], capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0 or not raw.exists():
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
            print(f"fedbr-bench: error: the profiled run exited {done.returncode}:\n{tail}", file=sys.stderr)
            return 1
        from ..runfiles.metrics import read_jsonl

        records = read_jsonl(out / "rounds.jsonl")
        parts = profile_parts(raw.read_text().splitlines())
    rounds = len(records)
    print(f"py-spy, {PROFILE_RATE} samples a second per thread; the simulation process of one default run")
    print(
        f"({rounds} rounds, {sum(r['seconds'] for r in records):.2f} s of rounds, steady "
        f"{steady_seconds(records):.3f} s a round; whole command {wall:.1f} s under the profiler):\n"
    )
    print(profile_table(parts, rounds))
    if json_path:
        json_path.write_text(json.dumps({"workload": [*WORKLOAD, *items], "rounds": rounds, "samples": parts}))
    return 0


def steady_seconds(records: list[dict]) -> float:
    """The median seconds of the rounds after the first."""
    later = [r["seconds"] for r in records if r["round"] > 1] or [r["seconds"] for r in records]
    return statistics.median(later)
