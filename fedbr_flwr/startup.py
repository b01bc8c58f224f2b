"""``fedbr-bench --startup``: where the seconds of one ``fedbr-run`` go, from outside, as a user sees them.

Each repetition runs ``fedbr-run ITEMS --verbose`` as a new process, stamps every line it prints with the
time it arrived, and reads the milestones from those lines (Flower's and the ServerApp's own log); the
engines are interleaved. Per phase it reports the median over repetitions."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

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
    ("command: imports, config, partition", re.compile(r"^fedbr-run: \S+ on ")),
    ("SuperLink up, `flwr run` connected", re.compile(r"Using SuperLink")),
    ("simulation process started", re.compile(r"Starting Flower Simulation")),
    ("Ray started, ServerApp started", re.compile(r"Starting Flower ServerApp")),
    ("client processes up, data loaded (discovery)", re.compile(r"\[fedbr\] \d+ clients found")),
    ("rounds", re.compile(r"\[fedbr\] round (\d+)/\1 ")),
    ("final evaluation, run files", re.compile(r"\[fedbr\] run files in ")),
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
    from .metrics import read_jsonl

    return statistics.median(r["seconds"] for r in read_jsonl(out_dir / "rounds.jsonl") if r["round"] > 1)


def startup_main(items: Sequence[str], repeats: int, engines: Sequence[str], json_path: Path | None) -> int:
    rows: dict[str, list[dict[str, float]]] = {engine: [] for engine in engines}
    for i in range(repeats):
        for engine in engines:
            with tempfile.TemporaryDirectory(prefix="fedbr-startup-") as tmp:
                out = Path(tmp) / "run"
                command = [
                    sys.executable,
                    "-m",
                    "fedbr_flwr.cli",
                    *WORKLOAD,
                    *items,
                    f"engine={engine}",
                    f"output-dir={out}",
                    "--verbose",
                ]
                lines, total, code = timed_lines(command)
                if code != 0:
                    tail = "\n".join(text for _, text in lines[-20:])
                    print(f"fedbr-bench: error: engine={engine} run {i + 1} exited {code}:\n{tail}", file=sys.stderr)
                    return 1
                row = {**phases(lines, total), "whole process": total, "per round, steady": steady_round_seconds(out)}
                rows[engine].append(row)
                print(f"  engine={engine} run {i + 1}/{repeats}: {total:.1f} s", flush=True)
    names = [name for name, _ in MILESTONES] + [SHUTDOWN, "whole process", "per round, steady"]
    medians = {e: {n: statistics.median(r[n] for r in rs if n in r) for n in names} for e, rs in rows.items()}
    print(f"\nmedian seconds over {repeats} run(s) of each engine, interleaved:\n")
    print("| phase | " + " | ".join(f"engine={e}" for e in engines) + " |")
    print("|---|" + "---|" * len(engines))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{medians[e][name]:.2f}" for e in engines) + " |")
    if json_path:
        json_path.write_text(json.dumps({"workload": [*WORKLOAD, *items], "medians": medians, "runs": rows}, indent=2))
    return 0
