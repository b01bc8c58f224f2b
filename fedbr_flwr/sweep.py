"""``fedbr-sweep``: several runs x seeds, one after another, then one comparison table and plot.

    fedbr-sweep experiments/table1_rotmnist5k.yaml
    fedbr-sweep experiments/table4_rotmnist5k.yaml num-rounds=10 --only FedAvg FedBR --out runs/t4

A sweep file holds the shared settings as top-level keys plus a ``sweep`` block:

    sweep:
      title: FedAvg vs FedBR   # optional: the comparison's and the report section's title
      seeds: [0, 1, 2]
      runs:                 # name: the keys that differ
        FedAvg: {strategy: fedavg}
        FedBR: {strategy: fedbr}

Settings are applied as: file keys <- command-line key=value <- the run's keys <- seed. Each run goes
to <out>/<name>/seed<k>/ (the usual run files; other characters than letters, digits and
+.=- in the name become _). A run whose folder already holds a finished run of
the same config is kept, not repeated, so an interrupted sweep continues where it stopped. The
comparison (mean and standard deviation over seeds) goes to <out>/comparison.md, .csv and .png;
with --report PAGE also into the file's section of a markdown results page, with its command, commit,
machine and wall time (fedbr_flwr/report.py).
Exit codes: 0 every run finished, 1 some run failed (the others still ran), 2 bad configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import signal
import sys
from pathlib import Path
from typing import Any, Iterator, Sequence

from .cli import config_from_settings, finished_run_problem, prepare, size_for_runtime, supernodes
from .config import ConfigError, load_yaml, parse_override
from .launcher import RunFailed, RunHost, run_flower
from .report import HEADLINES, run_folder, write_comparison, write_report
from .run_io import check_path_length

VOLATILE_KEYS = ("output-dir", "git-commit", "client-gpus", "ray-address")  # may differ between machines or sessions


def sweep_title(path: str) -> str | None:
    """The ``title`` of the file's sweep block (what its results-page section is called), if it has one."""
    sweep = load_yaml(path).get("sweep")
    return sweep.get("title") if isinstance(sweep, dict) else None


def sweep_headline(path: str) -> str:
    """The ``headline`` of the file's sweep block: ``best5`` (default, the FedBR paper's mean of the best 5
    evaluations) or ``best`` (the DisTrans paper's best evaluation, shown first in its tables)."""
    sweep = load_yaml(path).get("sweep")
    return str(sweep.get("headline", "best5")) if isinstance(sweep, dict) else "best5"


def load_sweep(path: str) -> tuple[dict[str, Any], list[int], dict[str, dict[str, Any]]]:
    data = load_yaml(path)
    sweep = data.pop("sweep", None)
    if not isinstance(sweep, dict) or not isinstance(sweep.get("runs"), dict) or not sweep["runs"]:
        raise ConfigError(f"{path} needs a 'sweep' block with a non-empty 'runs' mapping (name: settings)")
    unknown = set(sweep) - {"seeds", "runs", "title", "headline"}
    if unknown:
        raise ConfigError(
            f"{path}: unknown key(s) in 'sweep': {', '.join(sorted(unknown))} (valid: seeds, runs, title, headline)"
        )
    if sweep.get("headline", "best5") not in HEADLINES:
        raise ConfigError(f"{path}: 'sweep.headline' must be one of {', '.join(HEADLINES)}, got {sweep['headline']!r}")
    if not isinstance(sweep.get("title", ""), str):
        raise ConfigError(f"{path}: 'sweep.title' must be a string, got {sweep['title']!r}")
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


def plan(
    path: str, overrides: Sequence[str], out: Path, only: Sequence[str] | None, seeds: Sequence[int] | None = None
) -> list[tuple[str, int, dict[str, Any]]]:
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
            merged = {**base, **cli_overrides, **settings, "seed": seed, "output-dir": str(run_folder(out, name, seed))}
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
        raise ConfigError(
            f"{out} holds a finished run with different settings ({', '.join(differs)}); "
            "pick another --out or remove that folder"
        )
    return True


def run_all(
    jobs: list[tuple[str, int, dict[str, Any]]], quiet: bool, isolated: bool = False
) -> dict[tuple[str, int], str]:
    status = {}
    with contextlib.nullcontext(None) if isolated else shared_host(jobs) as host:
        for i, (name, seed, cfg) in enumerate(jobs, 1):
            label = f"[{i}/{len(jobs)}] {name} seed {seed}"
            cfg = prepare(size_for_runtime(cfg), overwrite=True)
            if finished_with_same_config(cfg):
                print(f"fedbr-sweep: {label}: already finished in {cfg['output-dir']}; kept", flush=True)
                status[(name, seed)] = "kept"
                continue
            print(f"fedbr-sweep: {label}: {cfg['strategy']} -> {cfg['output-dir']}", flush=True)
            try:
                out_dir = Path(cfg["output-dir"])
                run_flower(cfg, supernodes(cfg), out_dir, echo="none" if quiet else "progress", host=host)
                ok = (out_dir / "summary.json").exists()
                problem = finished_run_problem(out_dir) if ok else "no final evaluation"
                status[(name, seed)] = f"failed: {problem}" if problem else "ok"
            except (RunFailed, ConfigError) as exc:
                status[(name, seed)] = f"failed: {exc}"
            except OSError as exc:  # its folder's disk filled up, say: the next runs may still fit elsewhere
                status[(name, seed)] = f"failed: cannot write to {cfg['output-dir']}: {exc.strerror or exc}"
            print(f"fedbr-sweep: {label}: {status[(name, seed)]}", flush=True)
    return status


@contextlib.contextmanager
def shared_host(jobs: list[tuple[str, int, dict[str, Any]]]) -> Iterator[RunHost | None]:
    """One simulation process for the sweep's runs (``launcher.RunHost``): the second and later runs start on
    the first's imports, Ray runtime and client processes. None (each run a process of its own) when the
    runs name different Ray clusters."""
    from .raycluster import describe, requested_address

    addresses = {requested_address(cfg["ray-address"]) for _, _, cfg in jobs}
    if len(addresses) != 1:
        yield None
        return
    address = addresses.pop()
    with RunHost(describe(address).address if address else None) as host:
        yield host


def report_command(argv: Sequence[str] | None) -> str:
    """The command that makes the sweep's runs and its report, as a user would type it (without the
    switches that only skip work: --table-only, --quiet)."""
    args = [a for a in (sys.argv[1:] if argv is None else argv) if a not in ("--table-only", "--quiet")]
    return shlex.join(["fedbr-sweep", *args])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedbr-sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("file", help="sweep YAML file")
    parser.add_argument("overrides", nargs="*", help="key=value settings for every run")
    parser.add_argument("--out", type=Path, help="output folder (default: runs/<file name>)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these runs of the file")
    parser.add_argument("--seeds", nargs="+", type=int, metavar="SEED", help="these seeds instead of the file's")
    parser.add_argument("--dry-run", action="store_true", help="validate every run and list them, then exit")
    parser.add_argument("--table-only", action="store_true", help="do not run; rebuild the comparison")
    parser.add_argument("--quiet", action="store_true", help="no per-round progress")
    parser.add_argument(
        "--isolated",
        action="store_true",
        help="each run in a process of its own, with a Ray runtime and client processes of its own (by default "
        "the runs share one simulation process, Ray runtime and set of client processes)",
    )
    parser.add_argument(
        "--report",
        type=Path,
        metavar="PAGE",
        help="also write the table, its plot (in results/ beside PAGE) and the command, commit, "
        "machine and wall time as this sweep file's section of the markdown page PAGE; the "
        "page's other sections and text are kept",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)
    out = (args.out or Path("runs") / Path(args.file).stem).expanduser()
    try:
        check_path_length(out, "--out")
        out = out.resolve()
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
            status = run_all(jobs, args.quiet, args.isolated)
        except ConfigError as exc:
            print(f"fedbr-sweep: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"fedbr-sweep: interrupted; finished runs are kept in {out}", file=sys.stderr)
            return 130
    # the command-line overrides say what the file alone does not
    title = " ".join([sweep_title(args.file) or Path(args.file).stem, *args.overrides])
    headline = sweep_headline(args.file)
    table = write_comparison(out, names, seeds, title, headline)
    print("\n" + table)
    print(f"comparison: {out / 'comparison.md'}, comparison.csv, comparison.png")
    if args.report:
        try:
            write_report(args.report, Path(args.file).stem, title, report_command(argv), out, names, seeds, headline)
        except (ConfigError, OSError) as exc:
            print(f"fedbr-sweep: error: cannot write the report to {args.report}: {exc}", file=sys.stderr)
            return 2
        print(f"report: section '{Path(args.file).stem}' of {args.report}")
    failed = {k: v for k, v in status.items() if v.startswith("failed")}
    for (name, seed), why in failed.items():
        print(f"fedbr-sweep: {name} seed {seed} {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
