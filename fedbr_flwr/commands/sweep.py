"""``fedbr-sweep``: several runs x seeds, one after another (or several at once), then one comparison table and plot.

    fedbr-sweep experiments/table1_rotmnist5k.yaml
    fedbr-sweep experiments/table4_rotmnist5k.yaml num-rounds=10 --only FedAvg FedBR --out runs/t4

A sweep file holds the shared settings as top-level keys plus a ``sweep`` block:

    sweep:
      title: FedAvg vs FedBR   # optional: the comparison's and the report section's title
      seeds: [0, 1, 2]
      runs:                 # name: the keys that differ
        FedAvg: {strategy: fedavg}
        FedBR: {strategy: fedbr}
      grid:                 # optional: factors crossed with every run that uses their key, and the seeds
        lr: [0.005, 0.05]
        local-steps: [10, 50]
      decide:               # optional: the rule that decides each cell (report.Rule)
        method: FedBR
        baseline: FedAvg
        metrics: [mean_acc_best5, worst_acc_best5, rounds_to_target]
        spread: 1           # standard deviations on each side

Settings are applied as: file keys <- command-line key=value <- the grid cell's keys <- the run's keys
<- seed (a grid key set on the command line or by a run is an error). Each run goes to
<out>/<name>/seed<k>/, in a grid to <out>/<name>/<cell>/seed<k>/ with <cell> its factors' key=value
in key order, e.g. local-steps=50,lr=0.005 (the usual run files; other characters than letters, digits
and +.=- in the name become _); a grid key of an algorithm a run does not use is not crossed with that
run. A run whose folder already holds a finished run of the same config is kept, not repeated, and an
unfinished one continues from its checkpoint (``fedbr-run --resume``; started again where it has none), so an
interrupted sweep continues where it stopped. ``--time-limit 14m`` stops the sweep in time: its runs checkpoint
after every round, the run in progress stops after the last round that fits, and the same command continues
(a campaign of many pieces: docs/reproducing.md). The comparison (mean and standard deviation over seeds;
in a grid one row per run and cell) goes to <out>/comparison.md, .csv and .png, with a decide rule its
verdict per cell below it and as decisions.png; with --report PAGE also into the file's section of a
markdown results page, with its command, commit, machine and wall time (fedbr_flwr/commands/report.py).
``--jobs N`` runs up to N runs at the same time, each in a simulation process of its own (for a GPU that one
run leaves partly idle; each run still sizes itself for the whole machine).
Exit codes: 0 every run finished, 1 some run failed (the others still ran), 2 bad configuration, 75 the time
limit stopped it, 130 Ctrl-C, 143 SIGTERM (75 and 143 print the command that continues the sweep).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import queue
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from ..core.config import (
    NO_EFFECT_KEYS,
    ConfigError,
    active_owners,
    as_it_ran,
    common,
    load_yaml,
    normalise_key,
    parse_override,
    schema,
    unknown_key,
)
from ..core.errors import OneLineParser, quiet_when_its_reader_leaves
from ..core.registry import owned_keys
from ..launch.launcher import Echo, RunFailed, RunHost, print_line, run_flower
from ..launch.plan import check_code, check_data, check_local_resources, config_from_settings, plan_run
from ..launch.timelimit import (
    EXIT_TIME_LIMIT,
    RoundWatch,
    TimeLimitReached,
    parse_duration,
    stop_deadline,
    stopped_line,
)
from ..runfiles import runlock, tracking
from ..runfiles.run_io import (
    check_output_dir,
    check_path,
    check_records_continue,
    finish_run,
    finished_run_problem,
    manifest_config,
    only_end_left,
    stopped_before_its_last_checkpoint,
)
from ..runfiles.runlock import SWEEP_LOCK
from .report import (
    HEADLINES,
    SWEEP_FILES,
    Rule,
    Setting,
    cell_name,
    check_report_page,
    run_folder,
    setting_value,
    write_comparison,
    write_report,
)

SWEEP_KEYS = ("seeds", "runs", "title", "headline", "grid", "decide")
Factor = list[dict[str, Any]]  # a grid factor's values, each as the config keys it sets
Job = tuple[Setting, int, dict[str, Any]]  # a run of the sweep: its setting (run and grid cell), seed and config
NOT_FACTORS = ("seed", "output-dir", "git-commit", "strategy")  # the seeds, the runs and the sweep set these


@dataclass(frozen=True)
class SweepFile:
    """A sweep file: its shared settings, seeds, runs (name: settings), grid (factor: its values, each the
    config keys it sets; crossed with every run that uses the keys), decision rule (None: no ``decide``), title
    (what its results-page section is called) and headline (``best5``, the FedBR paper's mean of the best 5
    evaluations, or ``best``, the DisTrans paper's best evaluation, shown first in its tables)."""

    base: dict[str, Any]
    seeds: list[int]
    runs: dict[str, dict[str, Any]]
    grid: dict[str, Factor]
    rule: Rule | None
    title: str | None
    headline: str


def load_sweep(path: str) -> SweepFile:
    data = load_yaml(path)
    sweep = data.pop("sweep", None)
    if not isinstance(sweep, dict) or not isinstance(sweep.get("runs"), dict) or not sweep["runs"]:
        raise ConfigError(f"{path} needs a 'sweep' block with a non-empty 'runs' mapping (name: settings)")
    unknown = set(sweep) - set(SWEEP_KEYS)
    if unknown:
        raise ConfigError(
            f"{path}: unknown key(s) in 'sweep': {', '.join(sorted(unknown))} (valid: {', '.join(SWEEP_KEYS)})"
        )
    if sweep.get("headline", "best5") not in HEADLINES:
        raise ConfigError(f"{path}: 'sweep.headline' must be one of {', '.join(HEADLINES)}, got {sweep['headline']!r}")
    if not isinstance(sweep.get("title", ""), str):
        raise ConfigError(f"{path}: 'sweep.title' must be a string, got {sweep['title']!r}")
    seeds = sweep.get("seeds", [0])  # a top-level seed is refused (check_set_per_run)
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds):
        raise ConfigError(f"{path}: 'sweep.seeds' must be a list of integers >= 0, got {seeds!r}")
    runs = {}
    for name, settings in sweep["runs"].items():
        if not isinstance(settings, dict):
            raise ConfigError(f"{path}: run '{name}' must map config keys to values, got {settings!r}")
        runs[str(name)] = settings
    folders = [run_folder(Path("."), name, 0) for name in runs]
    if len(set(folders)) != len(folders) or any(f.parent.name in ("", "..") for f in folders):  # ".." leaves --out
        raise ConfigError(f"{path}: run names must differ in their letters and digits: {', '.join(runs)}")
    taken = [f.parent.name for f in folders if f.parent.name in (*SWEEP_FILES, SWEEP_LOCK)]
    if taken:
        raise ConfigError(f"{path}: run name {taken[0]!r} is a file the sweep writes in its --out: rename the run")
    grid = load_grid(sweep.get("grid", {}), path)
    rule = Rule.from_block(sweep["decide"], list(runs), f"{path}: 'sweep.decide'") if "decide" in sweep else None
    return SweepFile(data, seeds, runs, grid, rule, sweep.get("title"), sweep.get("headline", "best5"))


def load_grid(grid: Any, path: str) -> dict[str, Factor]:
    """The ``grid`` block: per factor, a non-empty list of values. A factor named by a config key lists that
    key's values (``lr: [0.01, 0.1]``); any other name lists mappings of the same config keys, which then move
    together (``budget: [{local-steps: 10, num-rounds: 40}, {local-steps: 50, num-rounds: 8}]``). Each key one
    the schema knows (with a did-you-mean otherwise), in one factor only, and not one the sweep sets itself."""
    if not isinstance(grid, dict):
        raise ConfigError(f"{path}: 'sweep.grid' must map config keys to lists of values, got {grid!r}")
    factors: dict[str, Factor] = {}
    taken: set[str] = set()
    for raw_name, values in grid.items():
        where = f"{path}: 'sweep.grid.{raw_name}'"
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{where} must be a non-empty list of values, got {values!r}")
        linked = all(isinstance(v, dict) for v in values)
        mixed = not linked and any(isinstance(v, dict) for v in values)
        if mixed or (linked and len({tuple(sorted(v)) for v in values}) != 1) or values == [{}]:
            raise ConfigError(f"{where}: its values must all be values of one key, or all set the same keys")
        settings = values if linked else [{raw_name: v} for v in values]
        keys = [grid_key(k, path) for k in settings[0]]
        repeated = [k for k in keys if k in taken]
        if repeated:
            raise ConfigError(f"{where}: key '{repeated[0]}' is listed twice; each key in one factor")
        taken.update(keys)
        factors[str(raw_name)] = [{normalise_key(k): v for k, v in value.items()} for value in settings]
    return factors


def grid_key(raw_key: str, path: str) -> str:
    """A grid key: one of the schema's (with a did-you-mean otherwise), not one the sweep sets itself."""
    keys = schema()
    key = normalise_key(raw_key)
    if key not in keys:
        raise ConfigError(f"{path}: 'sweep.grid': {unknown_key(raw_key, keys)}")
    if key in NOT_FACTORS:
        raise ConfigError(
            f"{path}: 'sweep.grid': key '{raw_key}' is set by the sweep (seeds: sweep.seeds; methods: runs)"
        )
    return key


def grid_keys(grid: dict[str, Factor]) -> list[str]:
    return [key for values in grid.values() for key in values[0]]


def run_factors(name: str, settings: dict[str, Any], grid: dict[str, Factor]) -> list[str]:
    """The grid keys that apply to run ``name`` (its ``settings`` without the grid's): a key of an algorithm or
    component the run does not use (DisTrans' offset lr for FedAvg) is not crossed with it."""
    if not grid:
        return []
    try:
        owners = active_owners(config_from_settings(settings))
    except ConfigError as exc:
        raise ConfigError(f"run '{name}': {exc}") from None
    keys = schema()
    return [key for key in grid_keys(grid) if keys[key].owner is None or keys[key].owner in owners]


def check_rule_has_cells(rule: Rule | None, factors: dict[str, list[str]]) -> None:
    """A rule decides each cell of its method against the one baseline cell with the same values of the
    baseline's factors: a baseline crossed with a grid key its method is not would leave no cell decided."""
    extra = [] if rule is None else sorted(set(factors[rule.baseline]) - set(factors[rule.method]))
    if rule is not None and extra:
        raise ConfigError(
            f"'sweep.decide': the baseline {rule.baseline} is crossed with grid key(s) {', '.join(extra)} and the "
            f"method {rule.method} is not, so no cell of {rule.method} has one baseline cell: swap them"
        )


def check_rule_metrics_recorded(rule: Rule | None, jobs: list[Job]) -> None:
    """A rule on the global test's figure decides nothing where its runs never run that test: every cell would
    stay "incomplete"."""
    if rule is None or "global_acc_best5" not in rule.metrics:
        return
    off = sorted({s.run for s, _, cfg in jobs if s.run in (rule.method, rule.baseline) and not common(cfg).global_test})
    if off:
        raise ConfigError(
            f"'sweep.decide' decides global_acc_best5, which only runs with global-test=true record; "
            f"{', '.join(off)} run(s) without it: set global-test: true, or drop that metric"
        )


def check_grid_is_alone(grid: dict[str, Factor], cli: dict[str, Any], runs: dict[str, dict[str, Any]]) -> None:
    """A grid key set on the command line or by a run would silently replace the grid's values: stop."""
    factor_keys = grid_keys(grid)
    for where, settings in [("the command line", cli)] + [(f"run '{n}'", s) for n, s in runs.items()]:
        taken = [normalise_key(k) for k in settings if normalise_key(k) in factor_keys]
        if taken:
            raise ConfigError(f"{where} sets {', '.join(taken)}, a factor of the grid: give its values in 'sweep.grid'")


def cells(grid: dict[str, Factor]) -> list[tuple[tuple[str, Any], ...]]:
    """Every combination of the grid's values as (key, value) pairs, the first factor's slowest ((): no grid,
    one cell)."""
    return [tuple(kv for value in values for kv in value.items()) for values in itertools.product(*grid.values())]


def plan(
    path: str, overrides: Sequence[str], out: Path, only: Sequence[str] | None, seeds: Sequence[int] | None = None
) -> list[Job]:
    """Every (setting: run name and grid cell, seed, validated config), seed by seed, cell by cell, run by run;
    or a ConfigError before anything runs."""
    spec = load_sweep(path)
    runs = spec.runs
    seeds = list(seeds) if seeds else spec.seeds
    twice = sorted({s for s in seeds if seeds.count(s) > 1})
    if twice:  # the same run folder: the second would silently be the first
        raise ConfigError(f"seed(s) {', '.join(map(str, twice))} given twice in {seeds}: give each seed once")
    if only:
        missing = sorted(set(only) - set(runs))
        if missing:
            raise ConfigError(f"--only names unknown runs: {', '.join(missing)}. Runs: {', '.join(runs)}")
    cli_overrides = dict(parse_override(item) for item in overrides)
    check_set_per_run(spec.base, f"in {path}")
    check_set_per_run(cli_overrides, "on the command line")
    for name, settings in runs.items():
        check_set_per_run(settings, f"in run '{name}'")
    check_grid_is_alone(spec.grid, cli_overrides, runs)
    factors = {name: run_factors(name, {**spec.base, **cli_overrides, **s}, spec.grid) for name, s in runs.items()}
    unused = [key for key in grid_keys(spec.grid) if not any(key in f for f in factors.values())]
    if unused:
        raise ConfigError(f"{path}: grid key(s) {', '.join(unused)} apply to none of the runs {', '.join(runs)}")
    check_rule_has_cells(spec.rule, factors)
    if only:  # a grid key of the runs left out is not crossed with these (the baseline of a grid alone)
        runs = {name: runs[name] for name in runs if name in only}
    jobs: list[Job] = []
    folders = set()
    for seed in seeds:
        for cell in cells(spec.grid):
            for name, settings in runs.items():
                own = tuple((k, v) for k, v in cell if k in factors[name])
                merged = {**spec.base, **cli_overrides, **dict(own), **settings, "seed": seed}
                try:
                    cfg = config_from_settings(merged)
                except ConfigError as exc:
                    where = f"run '{name}'" + (f" in cell {cell_name(own)}" if own else "")
                    raise ConfigError(f"{where} (seed {seed}): {exc}") from None
                setting = Setting(name, tuple((k, cfg[k]) for k, _ in own))  # 1e-3 and 0.001 alike
                folder = cfg["output-dir"] = str(setting.folder(out, seed))
                if folder not in folders:  # else: a cell that differs in keys this run does not use
                    folders.add(folder)
                    jobs.append((setting, seed, cfg))
    check_cells_differ(spec.grid, [setting for setting, seed, _ in jobs if seed == seeds[0]])
    check_rule_metrics_recorded(spec.rule, jobs)
    return jobs


def check_each(jobs: list[Job], check: Callable[[dict[str, Any]], None]) -> None:
    """``check`` on each job's config before any run starts, its refusal naming the run."""
    for setting, seed, cfg in jobs:
        try:
            check(cfg)
        except ConfigError as exc:
            raise ConfigError(f"{setting.label} seed {seed}: {exc}") from None


def check_set_per_run(settings: Mapping[str, Any], where: str) -> None:
    """``seed``, ``output-dir`` and ``resume`` are set per run by the sweep: given anywhere else they would be
    ignored (``resume=true`` failed every run that had no checkpoint yet)."""
    for key, instead in (
        ("seed", "use sweep.seeds or --seeds"),
        ("output-dir", "use --out"),
        ("resume", "the same command continues each unfinished run from its checkpoint"),
    ):
        if key in {normalise_key(k) for k in settings}:
            raise ConfigError(f"{key} {where} would be ignored: a sweep sets it for each run; {instead}")


def check_cells_differ(grid: dict[str, Factor], settings: list[Setting]) -> None:
    """Two values of a factor that read the same (1e-3 and 0.001, or names that differ only in characters a
    folder cannot hold) would share one run folder: each run must have one folder per combination of the
    values of the factors it uses."""
    for run in dict.fromkeys(s.run for s in settings):
        own = [s for s in settings if s.run == run]
        keys = {k for k, _ in own[0].cell}
        used = [values for values in grid.values() if keys & set(values[0])]
        if len(own) != math.prod(map(len, used)):
            listed = "; ".join(", ".join(cell_name(tuple(v.items())) for v in values) for values in used)
            raise ConfigError(f"grid values that read the same would share a run folder ({listed}): list each once")


def finished_with_same_config(cfg: Mapping[str, Any], say_damaged: bool = True) -> bool:
    """True if the folder holds a finished run of this config; False where it holds none, an unfinished one
    (continued or started again) or a finished one this config extends by more rounds (continued from its
    checkpoint). A finished run of other settings, fewer rounds included, is an error: it is never replaced.
    ``say_damaged``: a line for damaged run files (the check before the sweep's runs leaves it to the run's)."""
    run = common(cfg)
    out = Path(run.output_dir)
    manifest, summary = out / "manifest.json", out / "summary.json"
    if not (out / "metrics.jsonl").exists():
        return False
    if not manifest.exists() or not summary.exists():
        return False  # an unfinished run: start it again
    try:
        old = as_it_ran(manifest_config(json.loads(manifest.read_text())))  # after an upgrade: as it ran
        last_round = json.loads(summary.read_text()).get("last_round")
    except (ValueError, KeyError, TypeError, AttributeError):
        if say_damaged:
            print_line(f"fedbr-sweep: {out}: its manifest.json or summary.json is damaged; starting it again")
        return False
    if last_round != old["num-rounds"]:
        return False  # summary.json is refreshed at every evaluation: this run stopped early
    if stopped_before_its_last_checkpoint(out, old["num-rounds"]):
        return False  # it continues from its checkpoint
    differs = sorted(
        k
        for k in cfg
        if k not in NO_EFFECT_KEYS and old.get(k) != cfg[k] and not (k == "num-rounds" and cfg[k] > old[k])
    )
    if differs:
        raise ConfigError(
            f"{out} holds a finished run with different settings ({', '.join(differs)}); "
            "pick another --out or remove that folder"
        )
    return run.num_rounds == old["num-rounds"]


def resumable_round(cfg: Mapping[str, Any]) -> int | None:
    """The round of the checkpoint in the run's folder when the run can continue from it (``fedbr-run --resume``);
    None when there is none, or it or its records cannot be read (then the run starts again, and a line says why).
    A checkpoint of other settings is an error (``unfinished_run``): its run is never replaced."""
    out = Path(common(cfg).output_dir)
    header, problem = unfinished_run(cfg)
    if header is not None:
        try:
            check_records_continue(out, header["round"], header["config"])
        except ConfigError as exc:
            problem = str(exc)
    if problem is not None:
        print_line(f"fedbr-sweep: {out}: its checkpoint cannot continue this run ({problem}); starting it again")
        return None
    return None if header is None else header["round"]


def unfinished_run(cfg: Mapping[str, Any], header_only: bool = False) -> tuple[dict[str, Any] | None, str | None]:
    """(the header of the checkpoint in the run's folder, or None where there is none; why it cannot be read,
    its arrays unread with ``header_only``, or None). A ConfigError where the checkpoint is of settings this run
    cannot continue: like a finished run of other settings, it is not replaced."""
    from ..app.server_app import check_resumable
    from ..runfiles.checkpoint import CHECKPOINT_NAME, load_checkpoint

    out = Path(common(cfg).output_dir)
    if not (out / CHECKPOINT_NAME).exists():
        return None, None
    try:
        _, header = load_checkpoint(out, header_only)  # its round and config checked there
    except ConfigError as exc:
        return None, str(exc)
    try:
        check_resumable(header["config"], {**cfg, "resume": True}, header["round"])
    except ConfigError as exc:
        raise ConfigError(
            f"{out} holds an unfinished run that this one cannot continue ({exc}); pick another --out or remove "
            "that folder"
        ) from None
    return header, None


class RunsStopped(Exception):
    """Runs of a sweep that ran at once (``--jobs``) stopped at the time limit: each one's TimeLimitReached,
    in the sweep's order."""

    def __init__(self, stops: list[TimeLimitReached]):
        super().__init__(f"{len(stops)} run(s) stopped at the time limit")
        self.stops = stops


@dataclass
class SweepRuns:
    """What a sweep's runs share: how many there are, whether their progress is printed, the time limit
    (``deadline``, ``time.time()``'s clock; None: none) and the sweep's folder (each run's W&B group where
    tracking is on). Each run has a watch (``timelimit.RoundWatch``, without a deadline where there is no limit)
    that ``halt`` can stop; with runs at once (``at_once``) each progress line names its run."""

    total: int
    quiet: bool
    deadline: float | None
    out: Path | None
    at_once: bool = False
    halted: bool = False
    watches: set[RoundWatch] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, i: int, job: Job, host: RunHost | None) -> str:
        """Run job ``i`` (1-based) unless it is finished, continuing it from its checkpoint; its status.
        TimeLimitReached (``where``: this run) when the limit stops it or leaves no time to start it."""
        name, seed, cfg = job
        label = f"[{i}/{self.total}] {name.label} seed {seed}"
        try:
            run_plan = plan_run(cfg, overwrite=True)
        except ConfigError as exc:  # found only now (its folder taken by a live run, say): the others go on
            print_line(f"fedbr-sweep: {label}: failed: {exc}")
            return f"failed: {exc}"
        run, out_dir = run_plan.settings, run_plan.out_dir  # what the changes below (resume, ...) leave alone
        if finished_with_same_config(run_plan.config):
            end_left = only_end_left(out_dir, run.num_rounds)
            if end_left:  # killed after the checkpoint of its last round, before its end: written now
                finish_run(run_plan.config, out_dir)
            problem = finished_run_problem(out_dir)
            print_line(
                f"fedbr-sweep: {label}: already finished in {out_dir}; kept"
                + (" (its summary written now)" if end_left else "")
                + (f" ({problem})" if problem else "")
            )
            return f"failed: {problem} (kept from an earlier sweep)" if problem else "kept"
        where = f"{name.label} seed {seed} ({out_dir})"
        resumed = resumable_round(run_plan.config)
        changes: dict[str, Any] = {"resume": resumed is not None}
        if self.deadline is not None:
            if time.time() >= self.deadline:
                raise TimeLimitReached(resumed, where, run.num_rounds)
            changes["checkpoint-every"] = 1  # a stop loses no finished round
        run_plan = run_plan.with_keys(changes)
        watch = RoundWatch(math.inf if self.deadline is None else self.deadline, run.num_rounds, resumed)
        with self.lock:  # from here on ``halt`` stops this run
            if self.halted:
                raise TimeLimitReached(resumed, where, run.num_rounds)
            self.watches.add(watch)
        start = f"continues after round {resumed}" if resumed is not None else run.strategy
        print_line(f"fedbr-sweep: {label}: {start} -> {out_dir}")
        try:
            if self.out is not None and run.tracking:
                tracking.label_sweep_run(
                    out_dir, self.out.name, str(out_dir.relative_to(self.out)), [name.label[:64], f"seed{seed}"]
                )
            echo: Echo = (
                "none" if self.quiet else (lambda text: print_line(f"{label}: {text}")) if self.at_once else "progress"
            )
            try:
                run_flower(run_plan, echo=echo, host=host, watch=watch)
            except TimeLimitReached as exc:
                raise TimeLimitReached(exc.saved_round, where, run.num_rounds) from None
            ok = (out_dir / "summary.json").exists()
            problem = finished_run_problem(out_dir) if ok else "no final evaluation"
            status = f"failed: {problem}" if problem else "ok"
        except (RunFailed, ConfigError) as exc:
            status = f"failed: {exc}"
        except OSError as exc:  # its folder's disk filled up, say: the next runs may still fit elsewhere
            status = f"failed: cannot write to {out_dir}: {exc.strerror or exc}"
        finally:
            with self.lock:
                self.watches.discard(watch)
        print_line(f"fedbr-sweep: {label}: {status}")
        return status

    def halt(self) -> None:
        """Stop every run in progress now, as the time limit does at its deadline, and start no other."""
        with self.lock:
            self.halted = True
            for watch in self.watches:
                watch.stop.set()


def run_all(
    jobs: list[Job],
    quiet: bool,
    isolated: bool = False,
    deadline: float | None = None,
    out: Path | None = None,
    at_once: int = 1,
) -> dict[tuple[Setting, int], str]:
    """Run each job not finished yet, continuing those with a checkpoint; the status of each. ``deadline``
    (``time.time()``'s clock): the time limit every run shares, at which the sweep stops with
    TimeLimitReached (``where``: the run in progress). ``out``, the sweep's folder, is each run's W&B group
    where tracking is on. ``at_once``: how many runs go at the same time (``run_at_once``)."""
    if at_once > 1 and len(jobs) > 1:
        return run_at_once(jobs, SweepRuns(len(jobs), quiet, deadline, out, at_once=True), at_once, isolated)
    runs = SweepRuns(len(jobs), quiet, deadline, out)
    with contextlib.nullcontext(None) if isolated else shared_host(jobs) as host:
        return {(name, seed): runs.run(i, (name, seed, cfg), host) for i, (name, seed, cfg) in enumerate(jobs, 1)}


def run_at_once(jobs: list[Job], runs: SweepRuns, workers: int, isolated: bool) -> dict[tuple[Setting, int], str]:
    """``run_all`` with up to ``workers`` runs at the same time, each worker a thread with a simulation process
    of its own (``shared_host``) that takes the next job when its run ends. A run stopped by the time limit
    starts no new one, and the sweep raises RunsStopped once the others have ended or been stopped too. On
    SIGTERM or Ctrl-C (in the main thread) every run in progress is stopped, with its last checkpoint kept."""
    pending: queue.SimpleQueue[tuple[int, Job]] = queue.SimpleQueue()
    for item in enumerate(jobs, 1):
        pending.put(item)
    status: dict[int, str] = {}
    stops: dict[int, TimeLimitReached] = {}
    errors: list[BaseException] = []

    def work(done: threading.Event) -> None:
        try:
            with contextlib.nullcontext(None) if isolated else shared_host(jobs) as host:
                while not (runs.halted or stops or errors):
                    try:
                        i, job = pending.get_nowait()
                    except queue.Empty:
                        return
                    try:
                        status[i] = runs.run(i, job, host)
                    except TimeLimitReached as exc:
                        stops[i] = exc
        except BaseException as exc:  # noqa: BLE001 - raised in the main thread once the other runs have ended
            errors.append(exc)
            runs.halt()
        finally:
            done.set()

    # each worker says when it is done: a Thread.join interrupted by a signal can mark a live thread ended (3.11)
    ended = [threading.Event() for _ in range(min(workers, len(jobs)))]
    for done in ended:
        threading.Thread(target=work, args=(done,), daemon=True).start()
    try:
        for done in ended:
            while not done.wait(0.2):
                pass
    except BaseException:  # SIGTERM's SystemExit or Ctrl-C: stop the runs in progress, then go on unwinding
        runs.halt()
        for done in ended:
            done.wait()
        raise
    if errors:
        raise errors[0]
    if stops:
        raise RunsStopped([stops[i] for i in sorted(stops)])
    return {(jobs[i - 1][0], jobs[i - 1][1]): status[i] for i in sorted(status)}


@contextlib.contextmanager
def shared_host(jobs: list[Job]) -> Iterator[RunHost | None]:
    """One simulation process for the sweep's runs (``launcher.RunHost``): the second and later runs start on
    the first's imports, Ray runtime and client processes. None (each run a process of its own) when the
    runs name different Ray clusters."""
    from ..app.raycluster import describe, requested_address

    addresses = {requested_address(common(cfg).ray_address) for _, _, cfg in jobs}
    if len(addresses) != 1:
        yield None
        return
    address = addresses.pop()
    with RunHost(describe(address).address if address else None) as host:
        yield host


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="fedbr-sweep", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("file", help="sweep YAML file")
    parser.add_argument("overrides", nargs="*", help="key=value settings for every run")
    parser.add_argument("--out", type=Path, help="output folder (default: runs/<file name>)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these runs of the file")
    parser.add_argument(
        "--seeds", nargs="+", type=seed_or_setting, metavar="SEED", help="these seeds instead of the file's"
    )
    parser.add_argument("--dry-run", action="store_true", help="validate every run and list them, then exit")
    parser.add_argument("--table-only", action="store_true", help="do not run; rebuild the comparison")
    parser.add_argument("--quiet", action="store_true", help="no per-round progress")
    parser.add_argument(
        "--time-limit",
        metavar="DURATION",
        help="stop before DURATION (90s, 15m, 1h30m, 2h; a plain number is seconds) has passed, shared by the "
        "runs: each checkpoints after every round and the run in progress stops after the last round that fits; "
        "exit code 75 and a line with "
        "the command that continues (this same command: it resumes the unfinished run and keeps finished ones)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="run up to N runs at the same time, each in a simulation process of its own (for a GPU that one run "
        "leaves partly idle); their progress lines name their run",
    )
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


def seed_or_setting(text: str) -> int | str:
    """A --seeds value, or a key=value setting typed after the seeds (argparse hands it to the list before it)."""
    if "=" in text:
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid seed {text!r}: seeds are whole numbers") from None


def settings_to_overrides(args: argparse.Namespace) -> None:
    """Move the key=value settings that followed --only or --seeds out of those lists, into the overrides: the
    same command means the same run whether its settings come before or after the options."""
    for name in ("only", "seeds"):
        values = getattr(args, name)
        if values:
            kept = [v for v in values if not (isinstance(v, str) and "=" in v)]
            if not kept:
                noun = {"only": "run", "seeds": "seed"}[name]
                raise ConfigError(f"--{name} names no {noun}: {' '.join(map(str, values))} are settings")
            args.overrides += [v for v in values if v not in kept]
            setattr(args, name, kept)


def seeds_left_out(jobs: list[Job], seeds: list[int]) -> list[int]:
    """The other seeds that have a run beside this sweep's runs in their folders (a sweep continued into the same
    --out with other --seeds), which its comparison does not cover."""
    found = set()
    for setting_folder in {Path(common(cfg).output_dir).parent for _, _, cfg in jobs}:  # one per setting, not seed
        for folder in setting_folder.glob("seed*"):
            seed = folder.name.removeprefix("seed")
            if seed.isdigit() and int(seed) not in seeds and (folder / "summary.json").is_file():
                found.add(int(seed))
    return sorted(found)


def run_settings(configs: list[dict[str, Any]]) -> list[list[str]]:
    """Each run's strategy and the settings in which the runs differ (but their folder and seed; an algorithm's
    key only for the runs it applies to), as key=value: what --dry-run shows of each run."""
    owned = owned_keys()
    varied = sorted(
        {k for c in configs for k in c if len({setting_value(d.get(k)) for d in configs}) > 1}
        - {"strategy", "output-dir", "seed"}
    )

    def shown(c: dict[str, Any]) -> list[str]:
        active = active_owners(c)
        applies = [k for k in varied if k not in owned or owned[k].owner in active]
        return [f"strategy={c['strategy']}", *(f"{k}={setting_value(c[k])}" for k in applies)]

    return [shown(c) for c in configs]


@quiet_when_its_reader_leaves
def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return sweep_command(argv)
    except KeyboardInterrupt:  # outside the runs (a stop there has a line of its own): the checks, the table
        stopped = "interrupted"
        code = 130
    except SystemExit as exc:
        if exc.code != 143:
            raise
        stopped, code = "stopped by SIGTERM", 143
    print(
        f"fedbr-sweep: {stopped}; finished runs are kept; continue with: {shlex.join(['fedbr-sweep', *argv])}",
        file=sys.stderr,
    )
    return code


def sweep_command(argv: list[str]) -> int:
    started = time.time()
    args = build_parser().parse_intermixed_args(argv)
    out = args.out or Path("runs") / Path(args.file).stem
    again = shlex.join(["fedbr-sweep", *argv])
    # the report's command, as a user would type it: without the switches that only skip work
    report_command = shlex.join(["fedbr-sweep", *(a for a in argv if a not in ("--table-only", "--quiet"))])
    try:
        settings_to_overrides(args)
        if args.dry_run and args.table_only:  # it listed the runs and left the table unwritten
            raise ConfigError("--dry-run writes nothing and --table-only writes the table: give one")
        deadline = None if args.time_limit is None else stop_deadline(started, parse_duration(args.time_limit))
        if args.jobs < 1:
            raise ConfigError(f"--jobs {args.jobs}: give how many runs may go at once, 1 or more")
        out = check_path(out, "--out").resolve()
        jobs = plan(args.file, args.overrides, out, args.only, args.seeds)
        if not args.table_only:
            check_each(jobs, check_local_resources)  # a CUDA device or cores it lacks: with --dry-run too
            check_each(jobs, check_code)  # a BatchNorm backbone, a metric's name: not in each run
        if not args.dry_run:  # a file in the way stops the sweep now, not with a traceback or after its runs
            check_output_dir(out, "--out")
            for _, _, cfg in [] if args.table_only else jobs:  # one of other settings: before any run starts
                if not finished_with_same_config(cfg, say_damaged=False):
                    unfinished_run(cfg, header_only=True)
            if args.table_only and not any(Path(common(cfg).output_dir).is_dir() for _, _, cfg in jobs):
                raise ConfigError(
                    f"--out {out} holds no run of this sweep: run it first (without --table-only), or give the "
                    "--out it ran into"
                )
            if args.report:
                check_report_page(args.report, Path(args.file).stem)
            if not args.table_only:  # a missing dataset or an impossible split: not after the runs before it
                check_each(jobs, check_data)
    except ConfigError as exc:
        print(f"fedbr-sweep: error: {exc}", file=sys.stderr)
        return 2
    names = list(dict.fromkeys(name for name, _, _ in jobs))
    seeds = list(dict.fromkeys(seed for _, seed, _ in jobs))
    if args.dry_run:
        for (name, seed, cfg), settings in zip(jobs, run_settings([cfg for _, _, cfg in jobs])):
            print(f"{name.label} seed {seed}: {' '.join(settings)} -> {common(cfg).output_dir}")
        print(f"{len(jobs)} runs ({len(names)} settings x {len(seeds)} seeds)")
        return 0
    status = {}
    if not args.table_only:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        try:
            with runlock.hold(out, "sweep"):
                status = run_all(jobs, args.quiet, args.isolated, deadline, out, args.jobs)
        except ConfigError as exc:
            print(f"fedbr-sweep: error: {exc}", file=sys.stderr)
            return 2
        except (TimeLimitReached, RunsStopped) as exc:
            for stop in exc.stops if isinstance(exc, RunsStopped) else [exc]:
                print(
                    stopped_line("fedbr-sweep", stop.where, stop.saved_round, stop.num_rounds, again), file=sys.stderr
                )
            return EXIT_TIME_LIMIT
        except KeyboardInterrupt:
            print(f"fedbr-sweep: interrupted; finished runs are kept in {out}", file=sys.stderr)
            return 130
        except SystemExit as exc:
            if exc.code != 143:
                raise
            print(
                f"fedbr-sweep: stopped by SIGTERM; finished runs and the last checkpoint of each run in progress are "
                f"kept in {out}; continue with: {again}",
                file=sys.stderr,
            )
            return 143
    # the command-line overrides say what the file alone does not
    spec = load_sweep(args.file)
    title = " ".join([spec.title or Path(args.file).stem, *args.overrides])
    chosen = {name.run for name in names}  # --only may leave out the rule's method or baseline: no cell to decide
    rule = spec.rule if spec.rule and {spec.rule.method, spec.rule.baseline} <= chosen else None
    table = write_comparison(out, names, seeds, title, rule, spec.headline)
    print("\n" + table)
    print(f"comparison: {out / 'comparison.md'}, comparison.csv, comparison.png" + (", decisions.png" if rule else ""))
    if others := seeds_left_out(jobs, seeds):
        every = " ".join(str(seed) for seed in sorted({*seeds, *others}))
        print(
            f"fedbr-sweep: the comparison covers seed(s) {', '.join(map(str, seeds))}; {out} also holds runs of "
            f"seed(s) {', '.join(map(str, others))}: for one table of all, run it again with --seeds {every} "
            "--table-only",
            file=sys.stderr,
        )
    if args.report:
        try:
            write_report(
                args.report, Path(args.file).stem, title, report_command, out, names, seeds, rule, spec.headline
            )
        except (ConfigError, OSError) as exc:
            print(f"fedbr-sweep: error: cannot write the report to {args.report}: {exc}", file=sys.stderr)
            return 2
        print(f"report: section '{Path(args.file).stem}' of {args.report}")
    failed = {k: v for k, v in status.items() if v.startswith("failed")}
    for (name, seed), why in failed.items():
        print(f"fedbr-sweep: {name.label} seed {seed} {why}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
