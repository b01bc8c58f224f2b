"""Tables, plots and the results page, from a sweep's run folders (reads files only: no Flower, no runs).

- ``comparison.md``/``.csv``/``.png``: every run of a sweep (in a grid: every run in every cell, the cell's
  factor values as columns), mean ± std over its seeds; with a ``decide`` rule (``Rule``) also the rule's
  verdict per cell, method against baseline, in ``comparison.md`` and as a heatmap, ``decisions.png``;
- ``fedbr-sweep ... --report PAGE``: the same table, its plot, and the command, commit, machine and wall
  time that produced it, as one section of a markdown page. Each sweep file owns one section, between two
  marker lines; the rest of the page (other sections, the text around them) is left as it is. A section
  depends on the run folders only, never on the clock, so writing it again from the same runs changes
  nothing.
"""

from __future__ import annotations

import csv
import fcntl
import io
import json
import os
import re
import statistics
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from ..core.config import CommonSettings
from ..core.errors import ConfigError
from ..runfiles.checkpoint import checkpoint_round
from ..runfiles.jsonsafe import write_text_atomically
from ..runfiles.metrics import CLIENT_METRICS, format_accuracy_axes, read_jsonl, run_problem, save_figure
from ..runfiles.progress import stopped_on_purpose
from ..runfiles.run_io import check_output_dir, manifest_config, stopped_before_its_last_checkpoint
from ..runfiles.tracking import TRACKING_FILE

Cell = tuple[tuple[str, Any], ...]  # a grid cell: (key, value) per factor, in the grid's order


def run_folder(out: Path, name: str, seed: int, cell: Cell = ()) -> Path:
    """``<out>/<name>/seed<k>``, or in a grid ``<out>/<name>/<cell>/seed<k>`` (``cell_name``); other characters
    than letters, digits and +.=- in the name become _."""
    folder = out / re.sub(r"[^A-Za-z0-9+.=-]+", "_", name).strip("_")
    return (folder / cell_name(cell, sort=True) if cell else folder) / f"seed{seed}"


def format_value(value: Any) -> str:
    """A config value as a grid cell writes it: true/false, a float as Python writes it (1e-3 and 0.001 alike:
    0.001), a list of names joined by +."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value).replace(",", "+")


def cell_name(cell: Cell, sort: bool = False) -> str:
    """``lr=0.01,local-steps=50``: in the grid's order, or (``sort``, a run folder's name) in key order, so that
    reordering a grid's keys keeps its folders; characters other than letters, digits and +.=- become _."""
    items = sorted(cell) if sort else cell
    return ",".join(re.sub(r"[^A-Za-z0-9+.=-]+", "_", f"{k}={format_value(v)}") for k, v in items)


@dataclass(frozen=True)
class Setting:
    """One row of a sweep's table: a run of the file and, in a grid, one cell of the factors that run uses."""

    run: str
    cell: Cell = ()

    @property
    def label(self) -> str:
        return f"{self.run} {cell_name(self.cell)}" if self.cell else self.run

    def folder(self, out: Path, seed: int) -> Path:
        return run_folder(out, self.run, seed, self.cell)


def as_settings(names: Sequence[str | Setting]) -> list[Setting]:
    return [name if isinstance(name, Setting) else Setting(name) for name in names]


def factors_of(settings: list[Setting]) -> list[str]:
    """The grid's factors, in its order, over every setting (none outside a grid)."""
    return list(dict.fromkeys(k for s in settings for k, _ in s.cell))


HEADLINES = ("best5", "best")  # a sweep file's headline: the FedBR paper's mean of the best 5, or the DisTrans
# paper's best evaluation (shown first, beside the best-5 figures)


@dataclass(frozen=True)
class Figure:
    """A figure of a run's summary as the tables show it (its key there: ``column``; last_fifth_move is computed
    from the curves)."""

    column: str
    label: str
    kind: str  # pct, points, rounds or seconds
    decidable: bool  # a sweep's rule may decide on it


UNITS = {"pct": " (%)", "points": " (points)", "seconds": " (s)", "rounds": ""}
BEST_FIGURES = [
    Figure("best_mean_acc", "mean acc, best eval", "pct", False),
    Figure("best_pooled_acc", "pooled acc, best eval", "pct", False),
]


def summary_figures() -> list[Figure]:
    """The tables' columns, in order: each client metric's best 5 and (``final_column``) final figure, then
    the server's tests, the rounds to the target, the last fifth's move and the wall time."""
    best5 = [Figure(f"{n}_best5", f"{m.label}, best 5", "pct", True) for n, m in CLIENT_METRICS.items()]
    final = [Figure(f"final_{n}", f"final {m.label}", "pct", True) for n, m in CLIENT_METRICS.items() if m.final_column]
    return [
        *best5,
        *final,
        Figure("global_acc_best5", "global test, best 5", "pct", True),
        Figure("global_worst_acc_best5", "global test worst angle, best 5", "pct", False),
        Figure("rounds_to_target", "rounds to target", "rounds", True),
        Figure("last_fifth_move", "move in last fifth", "points", False),
        Figure("wall_time_s", "wall time", "seconds", False),
    ]


def decidable() -> dict[str, tuple[str, str, bool]]:
    """Summary key -> (name in the tables, unit of a difference, higher is better) of what a rule may decide."""
    return {
        f.column: (f.label, "rounds" if f.kind == "rounds" else "points", f.kind != "rounds")
        for f in summary_figures()
        if f.decidable
    }


def _stats(values: list[float | None]) -> tuple[float | None, float | None, int]:
    present = [v for v in values if v is not None]
    if not present:
        return None, None, 0
    return statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else 0.0, len(present)


def seed_curves(out: Path, setting: Setting, seeds: list[int], key: str) -> dict[int, list[float]]:
    """Round -> the run's ``key`` (a fraction) in each seed that evaluated that round."""
    curves: dict[int, list[float]] = {}
    for seed in seeds:
        try:
            records = read_jsonl(setting.folder(out, seed) / "metrics.jsonl")
        except ValueError:  # damaged: the table says so (seed_result), and the plot leaves it out
            continue
        for rec in records:
            if rec.get(key) is not None:  # null: missing
                curves.setdefault(int(rec["round"]), []).append(rec[key])
    return curves


def last_fifth_move(curve: dict[int, list[float]], num_rounds: int) -> float | None:
    """How far the mean-over-seeds curve moves (max - min) over the last fifth of the rounds, the
    evaluations from round ``num_rounds - num_rounds / 5`` on: under 0.02, the run has levelled off."""
    start = num_rounds - num_rounds / 5
    points = [statistics.fmean(v) for r, v in curve.items() if r >= start and v]
    return max(points) - min(points) if len(points) > 1 else None


def compare(
    out: Path, names: Sequence[str | Setting], seeds: list[int], headline: str = "best5"
) -> tuple[str, list[dict[str, Any]]]:
    """The markdown table and the csv rows: per run (in a grid: per run and cell, the cell's factor values as
    columns after the run's name; "-" for a factor the run does not use), mean, std and count over its seeds of
    every column, and each seed's mean accuracy (best 5). Columns no run has are left out of the markdown table,
    and so is pooled accuracy where it equals the mean accuracy in every row (equal-sized local test sets). With
    ``headline="best"`` the best (maximum) evaluation's accuracies come first (DisTrans' tables)."""
    columns = (BEST_FIGURES if headline == "best" else []) + summary_figures()
    settings = as_settings(names)
    factors = factors_of(settings)
    rows = []
    target = None
    for setting in settings:
        summaries, failed = {}, {}
        for seed in seeds:
            summary, why = seed_result(setting.folder(out, seed))
            if summary is not None:
                summaries[seed] = summary
                target = summary.get("target_acc")
            elif why:
                failed[seed] = why
        row: dict[str, Any] = {"run": setting.run, **{k: dict(setting.cell).get(k) for k in factors}}
        row["seeds"] = len(summaries)  # the finished seeds; a figure some of them lack says over how many
        row["target_acc"] = next((s.get("target_acc") for s in summaries.values()), None)  # of rounds_to_target
        row["not_finished"] = "; ".join(f"seed {seed} {why}" for seed, why in failed.items())
        num_rounds = max((s.get("last_round") or 0 for s in summaries.values()), default=0)
        for f in columns:
            if f.column == "last_fifth_move":  # of the mean curve over seeds: one value, so no spread
                figures = [last_fifth_move(seed_curves(out, setting, list(summaries), "mean_acc"), num_rounds)]
            else:
                figures = [s.get(f.column) for s in summaries.values()]
            row[f.column], row[f"{f.column}_std"], row[f"{f.column}_n"] = _stats(figures)
        row["mean_acc_best5_per_seed"] = " / ".join(per_seed_cell(summaries.get(s), failed.get(s, "")) for s in seeds)
        rows.append(row)
    shown = [f for f in columns if _shown(rows, f.column)]
    header = ["run", *factors, "seeds"] + [
        (f.label + UNITS[f.kind]).replace("rounds to target", f"rounds to {100 * (target or 0):.0f}%") for f in shown
    ]
    per_seed = len(seeds) > 1
    if per_seed:
        header.append(f"seed {' / '.join(map(str, seeds))}: mean acc, best 5 (%)")
    failures = any(row["not_finished"] for row in rows)
    if failures:
        header.append("not finished (left out)")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        values = ["-" if row[k] is None else format_value(row[k]) for k in factors]
        cells = [row["run"], *values, str(row["seeds"])] + [_cell(row, f.column, f.kind) for f in shown]
        if per_seed:
            cells.append(row["mean_acc_best5_per_seed"] or "-")
        if failures:
            cells.append(row["not_finished"] or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", rows


def per_seed_cell(summary: dict[str, Any] | None, why: str) -> str:
    if summary is None:
        return why.split(" ")[0].rstrip(":") if why else "not run"  # failed, paused; no folder yet
    return "-" if summary.get("mean_acc_best5") is None else f"{100 * summary['mean_acc_best5']:.2f}"


def _shown(rows: list[dict[str, Any]], column: str) -> bool:
    if all(row[column] is None for row in rows):
        return column == "rounds_to_target" and any(row["seeds"] for row in rows)  # "not reached" says something
    if column in ("pooled_acc_best5", "best_pooled_acc"):
        mean = "mean_acc_best5" if column == "pooled_acc_best5" else "best_mean_acc"
        return any(row[column] is not None and abs(row[column] - (row[mean] or 0)) > 1e-9 for row in rows)
    return True


def _cell(row: dict[str, Any], column: str, kind: str) -> str:
    mean, std, n = row[column], row[f"{column}_std"], row[f"{column}_n"]
    if mean is None:
        return "not reached" if kind == "rounds" and row["seeds"] else "-"
    if kind == "points":
        return f"{100 * mean:.2f}"
    if kind == "rounds":  # a mean over seeds: 2.5 rounds is not 2
        text = f"{mean:.1f}".removesuffix(".0")
    elif kind == "seconds":
        text = f"{mean:.0f}"
    else:  # one seed has no spread to show
        text = f"{100 * mean:.2f} ± {100 * std:.2f}" if n > 1 else f"{100 * mean:.2f}"
    if n < row["seeds"]:  # a seed without the figure: no target reached, or no evaluation of every client
        text += f" ({n}/{row['seeds']} reached)" if kind == "rounds" else f" ({n}/{row['seeds']} seeds)"
    return text


def write_comparison(
    out: Path,
    names: Sequence[str | Setting],
    seeds: list[int],
    title: str,
    rule: Rule | None = None,
    headline: str = "best5",
) -> str:
    """comparison.md, .csv and .png in ``out``; with a ``rule``, its decisions below the table in comparison.md
    and as decisions.png."""
    table, rows = compare(out, names, seeds, headline)
    text = f"### {title}\n\nMean ± standard deviation over seeds {', '.join(map(str, seeds))}.\n\n{table}"
    if rule is not None:
        decisions = decide(out, names, seeds, rule)
        text += f"\n#### {rule.method} against {rule.baseline}\n\n{decision_table(decisions, rule, seeds)}"
        plot_decisions(decisions, rule, out / "decisions.png", title)
    write_text_atomically(out / "comparison.md", text)  # a sweep stopped as it writes them keeps the old ones
    table_csv = io.StringIO(newline="")
    writer = csv.DictWriter(table_csv, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomically(out / "comparison.csv", table_csv.getvalue())
    plot_comparison(out, names, seeds, out / "comparison.png", title)
    return table


MOST_CURVES = 12  # a grid with more settings is drawn as one heatmap per run: its curves could not be told apart


def plot_comparison(out: Path, names: Sequence[str | Setting], seeds: list[int], path: Path, title: str) -> None:
    """Two panels, one curve per run, each the mean over seeds per evaluated round: mean client accuracy
    (left, solid, band = min..max over seeds) and worst client accuracy (right, dashed, same colour). A grid of
    more than ``MOST_CURVES`` settings: ``plot_grid_levels`` instead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    settings = as_settings(names)
    if len(settings) > MOST_CURVES and factors_of(settings):
        plot_grid_levels(out, settings, seeds, path, title)
        return
    fig, (ax_mean, ax_worst) = plt.subplots(1, 2, figsize=(11.0, 4.6), sharey=True)
    colours = plt.get_cmap("tab20" if len(names) > 10 else "tab10").colors  # type: ignore[attr-defined]
    for i, setting in enumerate(settings):
        name = setting.label
        mean_curves = seed_curves(out, setting, seeds, "mean_acc")
        worst_curves = seed_curves(out, setting, seeds, "worst_acc")
        if not mean_curves:
            continue
        colour = colours[i % len(colours)]
        rounds = sorted(mean_curves)
        ax_mean.plot(rounds, [100 * np.mean(mean_curves[r]) for r in rounds], color=colour, label=name)
        ax_mean.fill_between(
            rounds,
            [100 * min(mean_curves[r]) for r in rounds],
            [100 * max(mean_curves[r]) for r in rounds],
            color=colour,
            alpha=0.15,
        )
        rounds = sorted(worst_curves)
        ax_worst.plot(rounds, [100 * np.mean(worst_curves[r]) for r in rounds], ls="--", color=colour, label=name)
    format_accuracy_axes(ax_mean, "mean client", "local-test accuracy (%)")
    format_accuracy_axes(ax_worst, "worst client", "local-test accuracy (%)")
    handles, labels = ax_mean.get_legend_handles_labels()
    if labels:  # no run finished: an empty plot, no legend
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize="small", frameon=False)
    fig.suptitle(title)
    rows_of_legend = -(-len(labels) // 5)
    fig.tight_layout(rect=(0, 0.06 * rows_of_legend, 1, 1))
    save_figure(fig, path, dpi=110)


def grid_axes(settings: list[Setting]) -> tuple[list[str], list[Any], list[tuple]]:
    """A grid drawn as a table: its factors, the last factor's values (columns) and every combination of the
    others (rows); outside a grid, one cell."""
    factors = factors_of(settings)
    if not factors:
        return factors, [None], [()]
    columns = list(dict.fromkeys(dict(s.cell).get(factors[-1]) for s in settings))
    rows = list(dict.fromkeys(tuple((k, v) for k, v in s.cell if k != factors[-1]) for s in settings)) or [()]
    return factors, columns, rows


def plot_grid_levels(out: Path, settings: list[Setting], seeds: list[int], path: Path, title: str) -> None:
    """One heatmap per run of the mean over seeds of its mean client accuracy (best 5) in every cell: columns
    the grid's last factor, rows the combinations of the others; "?" where a seed has not finished."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    factors, columns, rows = grid_axes(settings)
    runs = list(dict.fromkeys(s.run for s in settings))
    fig, axes = plt.subplots(
        1, len(runs), figsize=(2.5 + 1.3 * len(columns) * len(runs), 1.4 + 0.45 * len(rows)), squeeze=False
    )
    for ax, run in zip(axes[0], runs):
        grid = np.full((len(rows), len(columns)), np.nan)
        for setting in (s for s in settings if s.run == run):
            values = seed_values(out, setting, seeds, "mean_acc_best5")
            i = rows.index(tuple((k, v) for k, v in setting.cell if k != factors[-1]))
            j = columns.index(dict(setting.cell).get(factors[-1]))
            if values is None:
                ax.text(j, i, "?", ha="center", va="center", fontsize="small", color="grey")
                continue
            grid[i, j] = 100 * statistics.mean(values)
            ax.text(j, i, f"{grid[i, j]:.1f}", ha="center", va="center", fontsize="small", bbox=BOX)
        ax.imshow(grid, cmap="viridis", vmin=0, vmax=100, aspect="auto")
        ax.set_title(f"{run}: mean acc, best 5 (%)", fontsize="medium")
        ax.set_xticks(range(len(columns)), [format_value(c) for c in columns], rotation=30, ha="right")
        ax.set_xlabel(factors[-1])
        ax.set_yticks(range(len(rows)), [cell_name(r) or "-" for r in rows] if ax is axes[0][0] else [])
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


# ---------------------------------------------------------------- a sweep's decision rule

RULE_KEYS = ("method", "baseline", "metrics", "spread")


@dataclass(frozen=True)
class Rule:
    """A sweep file's ``decide`` block, written before its runs: in each cell, ``method`` is ahead of
    ``baseline`` on a metric where its mean over the seeds, less ``spread`` standard deviations, beats the
    baseline's mean plus ``spread`` of its standard deviations; behind where the baseline's beats it the same
    way; level otherwise. Each metric is decided on its own."""

    method: str
    baseline: str
    metrics: tuple[str, ...]
    spread: float = 1.0

    @classmethod
    def from_block(cls, block: Any, runs: Sequence[str], where: str) -> Rule:
        """The rule of a ``decide`` block, or a ConfigError naming what is wrong in it."""
        import difflib

        if not isinstance(block, dict):
            raise ConfigError(f"{where} must map {', '.join(RULE_KEYS)} to values, got {block!r}")
        unknown = sorted(set(block) - set(RULE_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (valid: {', '.join(RULE_KEYS)})")
        for role in ("method", "baseline"):
            if not isinstance(block.get(role), str) or block[role] not in runs:
                names = ", ".join(runs)
                raise ConfigError(f"{where}.{role} must name one of the runs ({names}), got {block.get(role)!r}")
        if block["method"] == block["baseline"]:
            raise ConfigError(f"{where}: method and baseline are the same run, {block['method']!r}")
        metrics = block.get("metrics", ["mean_acc_best5"])
        if not isinstance(metrics, list) or not metrics:
            raise ConfigError(f"{where}.metrics must be a non-empty list of: {', '.join(decidable())}")
        for metric in metrics:
            if not isinstance(metric, str) or metric not in decidable():
                close = difflib.get_close_matches(str(metric), list(decidable()), n=1)
                hint = f" Did you mean '{close[0]}'?" if close else ""
                raise ConfigError(f"{where}.metrics: unknown metric {metric!r}.{hint} Valid: {', '.join(decidable())}")
        spread = block.get("spread", 1.0)
        if isinstance(spread, bool) or not isinstance(spread, (int, float)) or not 0 <= spread < float("inf"):
            raise ConfigError(f"{where}.spread must be a number of standard deviations >= 0, got {spread!r}")
        return cls(block["method"], block["baseline"], tuple(dict.fromkeys(metrics)), float(spread))

    def describe(self, seeds: list[int]) -> str:
        return (
            f"{self.method} is ahead of {self.baseline} in a cell, on each metric separately, where its mean over "
            f"seeds {', '.join(map(str, seeds))} less {self.spread:g} standard deviation(s) beats {self.baseline}'s "
            f"mean plus {self.spread:g} of its own (higher accuracy; for rounds to target fewer rounds, a seed that "
            "never reached the target counted at the evaluation after its last round); behind where "
            f"{self.baseline}'s beats {self.method}'s the same way; level otherwise"
        )


@dataclass(frozen=True)
class Decision:
    """The rule in one cell: per metric, the method's mean less the baseline's and the verdict (ahead, level,
    behind), or None where a seed of either has no finished run."""

    setting: Setting
    baseline: Setting
    results: dict[str, tuple[float, str] | None]


DAMAGED = "failed: its summary.json, manifest.json or rounds.jsonl is damaged"
SWEEP_FILES = ("comparison.md", "comparison.csv", "comparison.png", "decisions.png")  # in a sweep's --out


def seed_result(folder: Path) -> tuple[dict[str, Any] | None, str]:
    """A seed's summary where its run finished (it evaluated its last round, and some round trained); else None
    and why not: "" where it never started, else how far it came ("failed after round 2"). summary.json is
    rewritten at every evaluation, so a run that died leaves one that looks like a shorter run's."""
    if not folder.is_dir() or {path.name for path in folder.iterdir()} <= {TRACKING_FILE}:
        return None, ""  # a sweep labels a run's folder for its trackers before the run starts
    try:
        rounds = [int(r["round"]) for r in read_jsonl(folder / "rounds.jsonl") if "round" in r]
    except (ValueError, TypeError):
        return None, DAMAGED
    if not (folder / "manifest.json").exists():
        return None, unfinished(folder, rounds)
    try:
        num_rounds = stored_settings(folder).num_rounds
        summary = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").exists() else {}
    except (ValueError, AttributeError, TypeError):  # torn or edited JSON: the sweep starts such a run again
        return None, DAMAGED
    if not isinstance(summary, dict):
        return None, DAMAGED
    if summary.get("last_round") != num_rounds or stopped_before_its_last_checkpoint(folder, num_rounds):
        saved = checkpoint_round(folder)
        # paused: stopped at a checkpoint, or its command stopped it (time limit, Ctrl-C, SIGTERM) after one
        if rounds and saved is not None and (saved == max(rounds) or stopped_on_purpose(folder)):
            return None, f"paused after round {saved} of {num_rounds} (resumes from its checkpoint)"
        return None, unfinished(folder, rounds)
    if run_problem(summary):
        return None, "failed: no round trained"
    return summary, ""


def unfinished(folder: Path, rounds: list[int]) -> str:
    """How far a run that did not finish came, and whether it failed or its command stopped it (a time limit,
    Ctrl-C, SIGTERM) where no checkpoint was left to resume: then it starts again."""
    came = f"after round {max(rounds)}" if rounds else "before its first round"
    if stopped_on_purpose(folder) and checkpoint_round(folder) is None:
        return f"stopped {came}, with no checkpoint (starts again)"
    return f"failed {came}"


def seed_values(out: Path, setting: Setting, seeds: list[int], metric: str) -> list[float] | None:
    """Each seed's ``metric``, or None when a seed has no finished run (one that evaluated its last round;
    summary.json is written at every evaluation) or, except for rounds to target, no value. Rounds to target
    that a seed never reached count as the evaluation after its last round (num-rounds + eval-every): the
    earliest it could have come."""
    values = []
    for seed in seeds:
        folder = setting.folder(out, seed)
        summary, _ = seed_result(folder)
        if summary is None:
            return None
        value = summary.get(metric)
        if value is None and metric == "rounds_to_target":
            run = stored_settings(folder)
            value = run.num_rounds + run.eval_every
        if value is None:
            return None
        values.append(float(value))
    return values


def stored_settings(folder: Path) -> CommonSettings:
    """The typed common settings of the run in ``folder``, from its manifest."""
    manifest = json.loads((folder / "manifest.json").read_text())
    return CommonSettings.from_config(manifest_config(manifest) if "config" in manifest else {}, stored=True)


def verdict(method: list[float], baseline: list[float], spread: float, higher_is_better: bool) -> str:
    """ahead, behind or level: mean - spread * std of one against mean + spread * std of the other."""
    m, b = statistics.fmean(method), statistics.fmean(baseline)
    margin = spread * sum(statistics.stdev(v) if len(v) > 1 else 0.0 for v in (method, baseline))
    gain = m - b if higher_is_better else b - m
    return "ahead" if gain > margin else "behind" if -gain > margin else "level"


def decide(out: Path, names: Sequence[str | Setting], seeds: list[int], rule: Rule) -> list[Decision]:
    """The rule in every cell of the method's that has a baseline cell (the baseline's cell holds the method's
    values of the factors the baseline uses)."""
    settings = as_settings(names)
    baselines = [s for s in settings if s.run == rule.baseline]
    decisions = []
    for setting in (s for s in settings if s.run == rule.method):
        matches = [b for b in baselines if set(b.cell) <= set(setting.cell)]
        if len(matches) != 1:
            continue
        results: dict[str, tuple[float, str] | None] = {}
        for metric in rule.metrics:
            ours, theirs = (seed_values(out, s, seeds, metric) for s in (setting, matches[0]))
            higher = decidable()[metric][2]
            results[metric] = (
                None
                if ours is None or theirs is None
                else (statistics.fmean(ours) - statistics.fmean(theirs), verdict(ours, theirs, rule.spread, higher))
            )
        decisions.append(Decision(setting, matches[0], results))
    return decisions


def _difference(metric: str, value: float) -> str:
    return f"{100 * value:+.2f}" if decidable()[metric][1] == "points" else f"{value:+.1f}"


def decision_table(decisions: list[Decision], rule: Rule, seeds: list[int]) -> str:
    """The rule, a count of verdicts per metric, and one row per cell: each metric's difference and verdict."""
    factors = factors_of([d.setting for d in decisions])
    lines = [f"Rule (fixed in the sweep file before its runs): {rule.describe(seeds)}.", ""]
    for metric in rule.metrics:
        found = [d.results[metric][1] for d in decisions if d.results[metric] is not None]  # type: ignore[index]
        counts = ", ".join(f"{found.count(v)} {v}" for v in ("ahead", "level", "behind"))
        missing = len(decisions) - len(found)
        lines.append(
            f"- {decidable()[metric][0]}: {rule.method} {counts} of {len(decisions)} cells"
            + (f" ({missing} incomplete)" if missing else "")
        )
    header = [*factors] + [
        f"{decidable()[m][0]}: {rule.method} − {rule.baseline} ({decidable()[m][1]})" for m in rule.metrics
    ]
    lines += ["", "| " + " | ".join(header or ["-"]) + " |", "|" + "|".join("---" for _ in header or ["-"]) + "|"]
    for d in decisions:
        cell = dict(d.setting.cell)
        results = [
            "incomplete" if d.results[m] is None else f"{_difference(m, d.results[m][0])} {d.results[m][1]}"  # type: ignore[index]
            for m in rule.metrics
        ]
        lines.append("| " + " | ".join([format_value(cell[k]) for k in factors] + results) + " |")
    return "\n".join(lines) + "\n"


BOX = {"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.7}  # readable on any colour


def plot_decisions(decisions: list[Decision], rule: Rule, path: Path, title: str) -> None:
    """One heatmap per metric of the method's mean less the baseline's per cell: columns the grid's last
    factor's values, rows every combination of the others; coloured so that the method's better side is blue
    (fewer rounds, more accuracy), and a mark and a frame on the cells the rule decides (▲ ahead, ▼ behind)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    factors, columns, rows = grid_axes([d.setting for d in decisions])
    fig, axes = plt.subplots(
        1,
        len(rule.metrics),
        figsize=(1.2 + 1.6 * len(columns) * len(rule.metrics) + 2.2, 1.2 + 0.5 * len(rows)),
        squeeze=False,
    )
    for n, (ax, metric) in enumerate(zip(axes[0], rule.metrics)):
        name, unit, higher = decidable()[metric]
        scale = 100.0 if unit == "points" else 1.0
        grid = np.full((len(rows), len(columns)), np.nan)
        for d in decisions:
            cell = dict(d.setting.cell)
            i = rows.index(tuple((k, v) for k, v in d.setting.cell if k != factors[-1])) if factors else 0
            j = columns.index(cell.get(factors[-1])) if factors else 0
            result = d.results[metric]
            if result is not None:
                grid[i, j] = scale * result[0]
                mark = {"ahead": " ▲", "behind": " ▼"}.get(result[1], "")
                ax.text(j, i, f"{scale * result[0]:+.1f}{mark}", ha="center", va="center", fontsize="small", bbox=BOX)
                if mark:
                    ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2.5, ec="black"))
            else:
                ax.text(j, i, "?", ha="center", va="center", fontsize="small", color="grey")
        limit = float(np.nanmax(np.abs(grid))) if np.isfinite(grid).any() else 1.0
        ax.imshow(grid, cmap="RdBu" if higher else "RdBu_r", vmin=-limit or -1, vmax=limit or 1, aspect="auto")
        ax.set_title(f"{name} ({unit})", fontsize="medium")
        ax.set_xticks(range(len(columns)), [format_value(c) if factors else "" for c in columns])
        ax.set_xlabel(factors[-1] if factors else "")
        ax.set_yticks(range(len(rows)), [cell_name(r).replace(",", ", ") for r in rows] if n == 0 else [])
    fig.suptitle(f"{title}: {rule.method} − {rule.baseline} (▲ ahead, ▼ behind by the rule)")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


# ---------------------------------------------------------------- the results page


def _begin(key: str, tool: str = "fedbr-sweep") -> str:
    source = " from its run folders" if tool == "fedbr-sweep" else ""
    return f"<!-- {tool} report {key}: written by the command below{source}; edits are overwritten -->"


def _end(key: str, tool: str = "fedbr-sweep") -> str:
    return f"<!-- end of {tool} report {key} -->"


def check_report_page(page: Path, key: str, tool: str = "fedbr-sweep") -> None:
    """ConfigError, before a sweep's runs, where ``write_report`` could not write ``key``'s section of ``page``
    after them: a folder in its place, a folder it cannot be written in, a page that is not UTF-8 text or whose
    markers of that section are damaged."""
    if page.is_dir():
        raise ConfigError(f"--report {page} is a folder: give the markdown page to write (a .md file)")
    check_output_dir(page.parent, "--report's folder")
    if page.exists():
        replace_section(read_page(page), key, "", tool)


def read_page(page: Path) -> str:
    try:
        return page.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"--report {page} is not UTF-8 text: give a markdown page") from None


def replace_section(text: str, key: str, section: str, tool: str = "fedbr-sweep") -> str:
    """The page with ``key``'s section (between ``tool``'s markers) replaced, or appended where it has none."""
    begin, end = _begin(key, tool), _end(key, tool)
    block = f"{begin}\n{section.rstrip()}\n{end}\n"
    starts, ends = text.count(begin), text.count(end)
    if (starts, ends) == (0, 0):
        return text.rstrip("\n") + "\n\n" + block
    if (starts, ends) != (1, 1) or text.index(begin) > text.index(end):
        raise ConfigError(
            f"the page's markers of section '{key}' are damaged (each must appear once, begin before "
            "end); repair or remove them, then write the report again"
        )
    head, rest = text.split(begin, 1)
    after = rest.split(end, 1)[1]
    return head + block + (after[1:] if after.startswith("\n") else after)


def _manifests_and_paused(
    out: Path, names: Sequence[str | Setting], seeds: list[int]
) -> tuple[list[dict[str, Any]], list[str]]:
    """The manifests of the runs with a summary, and each run a time limit paused, as "<run> seed <seed> at
    round <r> of <n> (<minutes> min)"."""
    manifests, paused = [], []
    for setting in as_settings(names):
        for seed in seeds:
            folder = setting.folder(out, seed)
            summary, why = seed_result(folder)
            if (folder / "manifest.json").exists() and (folder / "summary.json").exists() and why != DAMAGED:
                manifests.append(json.loads((folder / "manifest.json").read_text()))
            if summary is None and why.startswith("paused"):
                done = json.loads((folder / "summary.json").read_text()) if (folder / "summary.json").exists() else {}
                minutes = (done.get("wall_time_s") or 0.0) / 60
                where = f"at round {checkpoint_round(folder)} of {stored_settings(folder).num_rounds}"
                paused.append(f"{setting.label} seed {seed} {where} ({minutes:.1f} min)")
    return manifests, paused


def short_commit(commit: str) -> str:
    """A commit as a section names it: its first 7 characters, and "-dirty" where the tree had local changes."""
    return commit[:7] + ("-dirty" if commit.endswith("-dirty") else "")


def describe_machine(host: dict[str, Any]) -> str:
    cpu = host.get("cpu") or host.get("platform") or "unknown CPU"
    gpu = host.get("gpu")
    return f"{host.get('cpus', '?')}-core {cpu}, " + (
        f"GPU {gpu}" if gpu else "no GPU" if "gpu" in host else "GPU not recorded"
    )


SETTINGS_SHOWN = (
    "dataset",
    "model",
    "partition",
    "alpha",
    "classes-per-client",
    "rotate",
    "num-clients",
    "num-rounds",
    "local-steps",
    "batch-size",
    "lr",
    "eval-every",
    "target-acc",
    "engine",
    "precision",
)


SPLIT_KEYS = {"alpha": ("fedbr", "dirichlet"), "classes-per-client": ("classes",)}  # read by these splits only


def shared_settings(configs: list[dict[str, Any]]) -> str:
    """The main settings every run of the table has in common, as key=value (a split's own key only
    where every run uses that split)."""
    splits = {CommonSettings.from_config(c, stored=True).partition for c in configs}
    same = [
        k
        for k in SETTINGS_SHOWN
        if configs
        and all(k in c and c[k] == configs[0][k] for c in configs)
        and splits <= set(SPLIT_KEYS.get(k, splits))
    ]
    return " ".join(f"{k}={setting_value(configs[0][k])}" for k in same)


def setting_value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, bool) else str(value)


def differing_settings(configs: list[dict[str, Any]]) -> str:
    """The main settings that differ between the runs, or between the pieces of a resumed run, each with its
    values in order of first appearance, as "`engine` (clients, cohort)"; empty where none differs."""
    values = {k: list(dict.fromkeys(setting_value(c[k]) for c in configs if k in c)) for k in SETTINGS_SHOWN}
    return ", ".join(f"`{k}` ({', '.join(v)})" for k, v in values.items() if len(v) > 1)


def report_section(
    key: str,
    title: str,
    command: str,
    out: Path,
    names: Sequence[str | Setting],
    seeds: list[int],
    plot: str,
    rule: Rule | None = None,
    headline: str = "best5",
) -> str:
    """The section of ``key``: title, command, provenance (commit, machine, dates, wall time), the table
    over ``seeds`` (headed by ``headline``'s figures) and the plot (``plot``: its path relative to the page);
    with a ``rule``, its decisions and their heatmap (``decisions_plot(plot)``)."""
    manifests, paused = _manifests_and_paused(out, names, seeds)
    table, rows = compare(out, names, seeds, headline)
    # the run's start and each resumed piece (with its own commit and, since pieces record it, machine)
    pieces = [piece for m in manifests for piece in (m, *m.get("resumed", []))]
    commits = sorted({short_commit(str(m.get("git_commit", "unknown"))) for m in pieces})
    machines = sorted({describe_machine(m["host"]) for m in pieces if "host" in m})
    days = sorted({str(m.get("started_utc", ""))[:10] for m in manifests if m.get("started_utc")})
    walls = [r["wall_time_s"] * r["wall_time_s_n"] for r in rows if r["wall_time_s"] is not None]
    runs, planned = sum(r["seeds"] for r in rows), len(names) * len(seeds)
    finished = str(runs) if runs == planned else f"{runs} of {planned} finished"
    settings = f"{len(names)} setting{'s' * (len(names) > 1)}"
    lines = [
        f"## {title}",
        "",
        "```bash",
        command,
        "```",
        "",
        f"- commit: {', '.join(commits) or '-'}; machine: {'; '.join(machines) or '-'}",
        f"- runs: {finished} ({settings} x seeds {', '.join(map(str, seeds))}), started "
        f"{' to '.join(dict.fromkeys([days[0], days[-1]])) if days else '-'}; wall time {sum(walls) / 60:.1f} min "
        "(the runs' own clocks, from the server's start to the last evaluation; Flower's start-up is not counted)",
        settings_line([piece["config"] for piece in pieces if "config" in piece]),
        *paused_line(paused),
        '- mean ± standard deviation over seeds; "move in last fifth": max - min of the mean curve over the '
        "last fifth of the rounds (under 2 points: levelled off)",
        "",
        table,
        f"![{title}]({plot})",
    ]
    if rule is not None:
        decisions = decision_table(decide(out, names, seeds, rule), rule, seeds)
        heatmap = f"![{title}: {rule.method} − {rule.baseline}]({decisions_plot(plot)})"
        lines += ["", f"### {rule.method} against {rule.baseline}", "", decisions, heatmap]
    return "\n".join(lines) + "\n"


def settings_line(configs: list[dict[str, Any]]) -> str:
    differing = differing_settings(configs)
    return f"- settings of every run: `{shared_settings(configs)}`" + (
        f"; differing between runs or their pieces: {differing}" if differing else ""
    )


def paused_line(paused: list[str]) -> list[str]:
    if not paused:
        return []
    return [
        f"- **in progress**: paused (by a time limit or a stop), {'; '.join(paused)}: left out of the table until they "
        "finish; their curves so far are in the plot"
    ]


def decisions_plot(plot: str) -> str:
    """Where a section's heatmap of decisions goes: beside its plot, ``<key>-decisions.png``."""
    return plot.removesuffix(".png") + "-decisions.png"


def write_report(
    page: Path,
    key: str,
    title: str,
    command: str,
    out: Path,
    names: Sequence[str | Setting],
    seeds: list[int],
    rule: Rule | None = None,
    headline: str = "best5",
) -> Path:
    """Write ``key``'s section of ``page`` (made if missing) and its plot in ``results/`` beside it (with a
    ``rule``, also the heatmap of its decisions)."""
    plot = page.parent / "results" / f"{key}.png"
    plot.parent.mkdir(parents=True, exist_ok=True)
    relative = plot.relative_to(page.parent).as_posix()
    section = report_section(key, title, command, out, names, seeds, relative, rule, headline)
    replace_section(read_page(page) if page.exists() else "# Results\n", key, section)  # damaged markers: no plots
    plot_comparison(out, names, seeds, plot, title)
    if rule is not None:
        plot_decisions(decide(out, names, seeds, rule), rule, page.parent / decisions_plot(relative), title)
    write_section(page, key, section)
    return plot


def write_section(page: Path, key: str, section: str, tool: str = "fedbr-sweep", new_page: str = "# Results\n") -> None:
    """Write ``key``'s section of ``page`` (a page begun with ``new_page`` where there is none) under the page's
    lock: another report on the page meanwhile keeps its section."""
    with page_lock(page.parent):
        text = read_page(page) if page.exists() else new_page
        write_text_atomically(page, replace_section(text, key, section, tool))


@contextmanager
def page_lock(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``folder`` (the report page's) while a page in it is read and rewritten."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
