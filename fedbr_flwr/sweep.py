"""``fedbr-sweep``: several runs x seeds, one after another, then one comparison table and plot.

    fedbr-sweep experiments/table1_rotmnist5k.yaml
    fedbr-sweep experiments/table4_rotmnist5k.yaml num-rounds=10 --only FedAvg FedBR --out runs/t4

A sweep file holds the shared settings as top-level keys plus a ``sweep`` block:

    sweep:
      seeds: [0, 1, 2]
      runs:                 # name: the keys that differ
        FedAvg: {strategy: fedavg}
        FedBR: {strategy: fedbr}

Settings are applied as: file keys <- command-line key=value <- the run's keys <- seed. Each run goes
to <out>/<name>/seed<k>/ (the usual run files; other characters than letters, digits and
+.=- in the name become _). A run whose folder already holds a finished run of
the same config is kept, not repeated, so an interrupted sweep continues where it stopped. The
comparison (mean and standard deviation over seeds) goes to <out>/comparison.md, .csv and .png.
Exit codes: 0 every run finished, 1 some run failed (the others still ran), 2 bad configuration.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from .cli import config_from_settings, finished_run_problem, prepare, size_resources, supernodes
from .config import ConfigError, load_yaml, parse_override
from .launcher import RunFailed, run_flower
from .metrics import read_jsonl, save_accuracy_plot

def run_folder(out: Path, name: str, seed: int) -> Path:
    return out / re.sub(r"[^A-Za-z0-9+.=-]+", "_", name).strip("_") / f"seed{seed}"


VOLATILE_KEYS = ("output-dir", "git-commit", "client-gpus")  # may differ between machines or sessions


def load_sweep(path: str) -> tuple[dict[str, Any], list[int], dict[str, dict[str, Any]]]:
    data = load_yaml(path)
    sweep = data.pop("sweep", None)
    if not isinstance(sweep, dict) or not isinstance(sweep.get("runs"), dict) or not sweep["runs"]:
        raise ConfigError(f"{path} needs a 'sweep' block with a non-empty 'runs' mapping (name: settings)")
    unknown = set(sweep) - {"seeds", "runs"}
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) in 'sweep': {', '.join(sorted(unknown))} (valid: seeds, runs)")
    seeds = sweep.get("seeds", [data.get("seed", 0)])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds):
        raise ConfigError(f"{path}: 'sweep.seeds' must be a list of integers >= 0, got {seeds!r}")
    runs = {}
    for name, settings in sweep["runs"].items():
        if not isinstance(settings, dict):
            raise ConfigError(f"{path}: run '{name}' must map config keys to values, got {settings!r}")
        runs[str(name)] = settings
    folders = [run_folder(Path("."), name, 0) for name in runs]
    if len(set(folders)) != len(folders) or any(str(f.parent) in ("", ".") for f in folders):
        raise ConfigError(f"{path}: run names must differ in their letters and digits: {', '.join(runs)}")
    return data, seeds, runs


def plan(path: str, overrides: Sequence[str], out: Path, only: Sequence[str] | None,
         seeds: Sequence[int] | None = None) -> list[tuple[str, int, dict[str, Any]]]:
    """Every (run name, seed, validated config), or a ConfigError before anything runs."""
    base, file_seeds, runs = load_sweep(path)
    seeds = list(seeds) if seeds else file_seeds
    if only:
        missing = sorted(set(only) - set(runs))
        if missing:
            raise ConfigError(f"--only names unknown runs: {', '.join(missing)}. Runs: {', '.join(runs)}")
        runs = {name: runs[name] for name in runs if name in only}
    cli_overrides = dict(parse_override(item) for item in overrides)
    jobs = []
    for seed in seeds:
        for name, settings in runs.items():
            merged = {**base, **cli_overrides, **settings, "seed": seed,
                      "output-dir": str(run_folder(out, name, seed))}
            try:
                cfg = config_from_settings(merged)
            except ConfigError as exc:
                raise ConfigError(f"run '{name}' (seed {seed}): {exc}") from None
            jobs.append((name, seed, cfg))
    return jobs


def finished_with_same_config(cfg: dict[str, Any]) -> bool:
    """True if the folder holds a finished run of this config; a different run there is an error."""
    out = Path(cfg["output-dir"])
    manifest, summary = out / "manifest.json", out / "summary.json"
    if not (out / "metrics.jsonl").exists():
        return False
    if not manifest.exists() or not summary.exists():
        return False  # an unfinished run: start it again
    if json.loads(summary.read_text()).get("last_round") != cfg["num-rounds"]:
        return False  # summary.json is refreshed at every evaluation: this run stopped early
    old = json.loads(manifest.read_text())["config"]
    differs = sorted(k for k in cfg if k not in VOLATILE_KEYS and old.get(k) != cfg[k])
    if differs:
        raise ConfigError(f"{out} holds a finished run with different settings ({', '.join(differs)}); "
                          "pick another --out or remove that folder")
    return True


def run_all(jobs: list[tuple[str, int, dict[str, Any]]], quiet: bool) -> dict[tuple[str, int], str]:
    import torch

    status = {}
    for i, (name, seed, cfg) in enumerate(jobs, 1):
        label = f"[{i}/{len(jobs)}] {name} seed {seed}"
        cfg = prepare(size_resources(cfg, torch.cuda.is_available(), os.cpu_count() or 1), overwrite=True)
        if finished_with_same_config(cfg):
            print(f"fedbr-sweep: {label}: already finished in {cfg['output-dir']}; kept", flush=True)
            status[(name, seed)] = "kept"
            continue
        print(f"fedbr-sweep: {label}: {cfg['strategy']} -> {cfg['output-dir']}", flush=True)
        try:
            run_flower(cfg, supernodes(cfg), Path(cfg["output-dir"]), echo="none" if quiet else "progress")
            ok = (Path(cfg["output-dir"]) / "summary.json").exists()
            problem = finished_run_problem(Path(cfg["output-dir"])) if ok else "no final evaluation"
            status[(name, seed)] = f"failed: {problem}" if problem else "ok"
        except (RunFailed, ConfigError) as exc:
            status[(name, seed)] = f"failed: {exc}"
        print(f"fedbr-sweep: {label}: {status[(name, seed)]}", flush=True)
    return status


# ---------------------------------------------------------------- comparison

COLUMNS = [  # (csv column, summary key, markdown header, kind)
    ("mean_acc_best5", "mean_acc_best5", "mean acc, best 5 (%)", "pct"),
    ("worst_acc_best5", "worst_acc_best5", "worst client, best 5 (%)", "pct"),
    ("pooled_acc_best5", "pooled_acc_best5", "pooled acc, best 5 (%)", "pct"),
    ("final_mean_acc", "final_mean_acc", "final mean acc (%)", "pct"),
    ("final_worst_acc", "final_worst_acc", "final worst client (%)", "pct"),
    ("global_acc_best5", "global_acc_best5", "global test, best 5 (%)", "pct"),
    ("rounds_to_target", "rounds_to_target", "rounds to target", "rounds"),
    ("wall_time_s", "wall_time_s", "wall time (s)", "seconds"),
]


def _stats(values: list[float | None]) -> tuple[float | None, float | None, int]:
    present = [v for v in values if v is not None]
    if not present:
        return None, None, 0
    return statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else 0.0, len(present)


def compare(out: Path, names: list[str], seeds: list[int]) -> tuple[str, list[dict[str, Any]]]:
    rows = []
    target = None
    for name in names:
        summaries = []
        for seed in seeds:
            path = run_folder(out, name, seed) / "summary.json"
            if path.exists():
                summaries.append(json.loads(path.read_text()))
                target = summaries[-1].get("target_acc")
        row: dict[str, Any] = {"run": name, "seeds": len(summaries)}
        for column, key, _, _ in COLUMNS:
            mean, std, n = _stats([s.get(key) for s in summaries])
            row[column], row[f"{column}_std"], row[f"{column}_n"] = mean, std, n
        rows.append(row)
    header = ["run", "seeds"] + [h.replace("rounds to target", f"rounds to {100 * (target or 0):.0f}%")
                                 for _, _, h, _ in COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        cells = [row["run"], str(row["seeds"])]
        for column, _, _, kind in COLUMNS:
            cells.append(_cell(row, column, kind))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", rows


def _cell(row: dict[str, Any], column: str, kind: str) -> str:
    mean, std, n = row[column], row[f"{column}_std"], row[f"{column}_n"]
    if mean is None:
        return "not reached" if kind == "rounds" and row["seeds"] else "-"
    scale = 100.0 if kind == "pct" else 1.0
    if kind != "pct":
        text = f"{mean:.0f}"
    else:  # one seed has no spread to show
        text = f"{scale * mean:.2f} ± {scale * std:.2f}" if n > 1 else f"{scale * mean:.2f}"
    if kind == "rounds" and n < row["seeds"]:
        text += f" ({n}/{row['seeds']} reached)"
    return text


def write_comparison(out: Path, names: list[str], seeds: list[int], title: str) -> str:
    table, rows = compare(out, names, seeds)
    (out / "comparison.md").write_text(f"### {title}\n\nMean ± standard deviation over seeds "
                                       f"{', '.join(map(str, seeds))}.\n\n{table}")
    with open(out / "comparison.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot_comparison(out, names, seeds, out / "comparison.png", title)
    return table


def plot_comparison(out: Path, names: list[str], seeds: list[int], path: Path, title: str) -> None:
    """Mean client accuracy (solid, band = min..max over seeds) and worst client accuracy (dashed, same
    colour) per evaluated round: one pair of curves per run, each the mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    for name in names:
        mean_curves, worst_curves = {}, {}
        for seed in seeds:
            for rec in read_jsonl(run_folder(out, name, seed) / "metrics.jsonl"):
                if rec.get("mean_acc") is None or rec.get("worst_acc") is None:  # null: missing
                    continue
                mean_curves.setdefault(rec["round"], []).append(100 * rec["mean_acc"])
                worst_curves.setdefault(rec["round"], []).append(100 * rec["worst_acc"])
        if not mean_curves:
            continue
        rounds = sorted(mean_curves)
        (line,) = ax.plot(rounds, [np.mean(mean_curves[r]) for r in rounds], label=f"{name}: mean client")
        ax.fill_between(rounds, [min(mean_curves[r]) for r in rounds], [max(mean_curves[r]) for r in rounds],
                        color=line.get_color(), alpha=0.15)
        ax.plot(rounds, [np.mean(worst_curves[r]) for r in rounds], ls="--", color=line.get_color(),
                label=f"{name}: worst client")
    save_accuracy_plot(fig, ax, path, title, "local-test accuracy (%)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedbr-sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", help="sweep YAML file")
    parser.add_argument("overrides", nargs="*", help="key=value settings for every run")
    parser.add_argument("--out", type=Path, help="output folder (default: runs/<file name>)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these runs of the file")
    parser.add_argument("--seeds", nargs="+", type=int, metavar="SEED", help="these seeds instead of the file's")
    parser.add_argument("--dry-run", action="store_true", help="validate every run and list them, then exit")
    parser.add_argument("--table-only", action="store_true", help="do not run; rebuild the comparison")
    parser.add_argument("--quiet", action="store_true", help="no per-round progress")
    args = parser.parse_intermixed_args(argv)
    out = (args.out or Path("runs") / Path(args.file).stem).expanduser().resolve()
    try:
        jobs = plan(args.file, args.overrides, out, args.only, args.seeds)
    except ConfigError as exc:
        print(f"fedbr-sweep: error: {exc}", file=sys.stderr)
        return 2
    names = list(dict.fromkeys(name for name, _, _ in jobs))
    seeds = list(dict.fromkeys(seed for _, seed, _ in jobs))
    if args.dry_run:
        for name, seed, cfg in jobs:
            print(f"{name} seed {seed}: strategy={cfg['strategy']} -> {cfg['output-dir']}")
        return 0
    status = {}
    if not args.table_only:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        out.mkdir(parents=True, exist_ok=True)
        try:
            status = run_all(jobs, args.quiet)
        except ConfigError as exc:
            print(f"fedbr-sweep: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"fedbr-sweep: interrupted; finished runs are kept in {out}", file=sys.stderr)
            return 130
    title = " ".join([Path(args.file).stem, *args.overrides])  # overrides say what the file alone does not
    table = write_comparison(out, names, seeds, title)
    print("\n" + table)
    print(f"comparison: {out / 'comparison.md'}, comparison.csv, comparison.png")
    failed = {k: v for k, v in status.items() if v.startswith("failed")}
    for (name, seed), why in failed.items():
        print(f"fedbr-sweep: {name} seed {seed} {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
