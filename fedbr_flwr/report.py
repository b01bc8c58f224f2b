"""Tables, plots and the results page, from a sweep's run folders (reads files only: no Flower, no runs).

- ``comparison.md``/``.csv``/``.png``: every run of a sweep, mean ± std over its seeds;
- ``fedbr-sweep ... --report PAGE``: the same table, its plot, and the command, commit, machine and wall
  time that produced it, as one section of a markdown page. Each sweep file owns one section, between two
  marker lines; the rest of the page (other sections, the text around them) is left as it is. A section
  depends on the run folders only, never on the clock, so writing it again from the same runs changes
  nothing.
"""

from __future__ import annotations

import csv
import json
import re
import statistics
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .metrics import format_accuracy_axes, read_jsonl


def run_folder(out: Path, name: str, seed: int) -> Path:
    return out / re.sub(r"[^A-Za-z0-9+.=-]+", "_", name).strip("_") / f"seed{seed}"


COLUMNS = [  # (csv column, summary key (None: computed from the curves), markdown header, kind)
    ("mean_acc_best5", "mean_acc_best5", "mean acc, best 5 (%)", "pct"),
    ("worst_acc_best5", "worst_acc_best5", "worst client, best 5 (%)", "pct"),
    ("pooled_acc_best5", "pooled_acc_best5", "pooled acc, best 5 (%)", "pct"),
    ("final_mean_acc", "final_mean_acc", "final mean acc (%)", "pct"),
    ("final_worst_acc", "final_worst_acc", "final worst client (%)", "pct"),
    ("global_acc_best5", "global_acc_best5", "global test, best 5 (%)", "pct"),
    ("global_worst_acc_best5", "global_worst_acc_best5", "global test worst angle, best 5 (%)", "pct"),
    ("rounds_to_target", "rounds_to_target", "rounds to target", "rounds"),
    ("last_fifth_move", None, "move in last fifth (points)", "points"),
    ("wall_time_s", "wall_time_s", "wall time (s)", "seconds"),
]


def _stats(values: list[float | None]) -> tuple[float | None, float | None, int]:
    present = [v for v in values if v is not None]
    if not present:
        return None, None, 0
    return statistics.fmean(present), statistics.stdev(present) if len(present) > 1 else 0.0, len(present)


def seed_curves(out: Path, name: str, seeds: list[int], key: str) -> dict[int, list[float]]:
    """Round -> the run's ``key`` (a fraction) in each seed that evaluated that round."""
    curves: dict[int, list[float]] = {}
    for seed in seeds:
        for rec in read_jsonl(run_folder(out, name, seed) / "metrics.jsonl"):
            if rec.get(key) is not None:  # null: missing
                curves.setdefault(int(rec["round"]), []).append(rec[key])
    return curves


def last_fifth_move(curve: dict[int, list[float]], num_rounds: int) -> float | None:
    """How far the mean-over-seeds curve moves (max - min) over the last fifth of the rounds, the
    evaluations from round ``num_rounds - num_rounds / 5`` on: under 0.02, the run has levelled off."""
    start = num_rounds - num_rounds / 5
    points = [statistics.fmean(v) for r, v in curve.items() if r >= start and v]
    return max(points) - min(points) if len(points) > 1 else None


def compare(out: Path, names: list[str], seeds: list[int]) -> tuple[str, list[dict[str, Any]]]:
    """The markdown table and the csv rows: per run, mean, std and count over its seeds of every column,
    and each seed's mean accuracy (best 5). Columns no run has are left out of the markdown table, and so
    is pooled accuracy where it equals the mean accuracy in every row (equal-sized local test sets)."""
    rows = []
    target = None
    for name in names:
        summaries = {}
        for seed in seeds:
            path = run_folder(out, name, seed) / "summary.json"
            if path.exists():
                summaries[seed] = json.loads(path.read_text())
                target = summaries[seed].get("target_acc")
        row: dict[str, Any] = {"run": name, "seeds": len(summaries)}
        num_rounds = max((s.get("last_round") or 0 for s in summaries.values()), default=0)
        for column, key, _, _ in COLUMNS:
            if key is None:  # last_fifth_move: of the mean curve over seeds, so no spread
                move = last_fifth_move(seed_curves(out, name, list(summaries), "mean_acc"), num_rounds)
                row[column], row[f"{column}_std"], row[f"{column}_n"] = move, 0.0, int(move is not None)
                continue
            mean, std, n = _stats([s.get(key) for s in summaries.values()])
            row[column], row[f"{column}_std"], row[f"{column}_n"] = mean, std, n
        row["mean_acc_best5_per_seed"] = " / ".join(
            "-" if s.get("mean_acc_best5") is None else f"{100 * s['mean_acc_best5']:.2f}" for s in summaries.values()
        )
        rows.append(row)
    shown = [c for c in COLUMNS if _shown(rows, c[0])]
    header = ["run", "seeds"] + [
        h.replace("rounds to target", f"rounds to {100 * (target or 0):.0f}%") for _, _, h, _ in shown
    ]
    per_seed = len(seeds) > 1
    if per_seed:
        header.append(f"seed {' / '.join(map(str, seeds))}: mean acc, best 5 (%)")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        cells = [row["run"], str(row["seeds"])] + [_cell(row, column, kind) for column, _, _, kind in shown]
        if per_seed:
            cells.append(row["mean_acc_best5_per_seed"] or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", rows


def _shown(rows: list[dict[str, Any]], column: str) -> bool:
    if all(row[column] is None for row in rows):
        return column == "rounds_to_target" and any(row["seeds"] for row in rows)  # "not reached" says something
    if column == "pooled_acc_best5":
        return any(row[column] is not None and abs(row[column] - (row["mean_acc_best5"] or 0)) > 1e-9 for row in rows)
    return True


def _cell(row: dict[str, Any], column: str, kind: str) -> str:
    mean, std, n = row[column], row[f"{column}_std"], row[f"{column}_n"]
    if mean is None:
        return "not reached" if kind == "rounds" and row["seeds"] else "-"
    if kind == "points":
        return f"{100 * mean:.2f}"
    if kind != "pct":
        text = f"{mean:.0f}"
    else:  # one seed has no spread to show
        text = f"{100 * mean:.2f} ± {100 * std:.2f}" if n > 1 else f"{100 * mean:.2f}"
    if kind == "rounds" and n < row["seeds"]:
        text += f" ({n}/{row['seeds']} reached)"
    return text


def write_comparison(out: Path, names: list[str], seeds: list[int], title: str) -> str:
    table, rows = compare(out, names, seeds)
    (out / "comparison.md").write_text(
        f"### {title}\n\nMean ± standard deviation over seeds {', '.join(map(str, seeds))}.\n\n{table}"
    )
    with open(out / "comparison.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot_comparison(out, names, seeds, out / "comparison.png", title)
    return table


def plot_comparison(out: Path, names: list[str], seeds: list[int], path: Path, title: str) -> None:
    """Two panels, one curve per run, each the mean over seeds per evaluated round: mean client accuracy
    (left, solid, band = min..max over seeds) and worst client accuracy (right, dashed, same colour)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_mean, ax_worst) = plt.subplots(1, 2, figsize=(11.0, 4.6), sharey=True)
    colours = plt.get_cmap("tab20" if len(names) > 10 else "tab10").colors  # type: ignore[attr-defined]
    for i, name in enumerate(names):
        mean_curves = seed_curves(out, name, seeds, "mean_acc")
        worst_curves = seed_curves(out, name, seeds, "worst_acc")
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
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- the results page


def _begin(key: str) -> str:
    return (
        f"<!-- fedbr-sweep report {key}: written by the command below from its run folders; edits are overwritten -->"
    )


def _end(key: str) -> str:
    return f"<!-- end of fedbr-sweep report {key} -->"


def replace_section(text: str, key: str, section: str) -> str:
    """The page with ``key``'s section (between its markers) replaced, or appended where it has none."""
    begin, end = _begin(key), _end(key)
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


def _manifests(out: Path, names: list[str], seeds: list[int]) -> list[dict[str, Any]]:
    found = []
    for name in names:
        for seed in seeds:
            path = run_folder(out, name, seed) / "manifest.json"
            if path.exists() and (path.parent / "summary.json").exists():
                found.append(json.loads(path.read_text()))
    return found


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
    same = [
        k
        for k in SETTINGS_SHOWN
        if configs
        and all(k in c and c[k] == configs[0][k] for c in configs)
        and all(c.get("partition") in SPLIT_KEYS.get(k, (c.get("partition"),)) for c in configs)
    ]
    return " ".join(
        f"{k}={json.dumps(configs[0][k]) if isinstance(configs[0][k], bool) else configs[0][k]}" for k in same
    )


def report_section(key: str, title: str, command: str, out: Path, names: list[str], seeds: list[int], plot: str) -> str:
    """The section of ``key``: title, command, provenance (commit, machine, dates, wall time), the table
    over ``seeds`` and the plot (``plot``: its path relative to the page)."""
    manifests = _manifests(out, names, seeds)
    table, rows = compare(out, names, seeds)
    commits = sorted(
        {
            str(m.get("git_commit", "unknown"))[:7]
            + ("-dirty" if str(m.get("git_commit", "")).endswith("-dirty") else "")
            for m in manifests
        }
    )
    machines = sorted({describe_machine(m.get("host", {})) for m in manifests})
    days = sorted({str(m.get("started_utc", ""))[:10] for m in manifests if m.get("started_utc")})
    walls = [r["wall_time_s"] * r["wall_time_s_n"] for r in rows if r["wall_time_s"] is not None]
    runs = sum(r["seeds"] for r in rows)
    lines = [
        f"## {title}",
        "",
        "```bash",
        command,
        "```",
        "",
        f"- commit: {', '.join(commits) or '-'}; machine: {'; '.join(machines) or '-'}",
        f"- runs: {runs} ({len(names)} settings x seeds {', '.join(map(str, seeds))}), started "
        f"{' to '.join(dict.fromkeys([days[0], days[-1]])) if days else '-'}; wall time {sum(walls) / 60:.1f} min "
        "(the runs' own clocks, from the server's start to the last evaluation; Flower's start-up is not counted)",
        f"- settings of every run: `{shared_settings([m['config'] for m in manifests if 'config' in m])}`",
        '- mean ± standard deviation over seeds; "move in last fifth": max - min of the mean curve over the '
        "last fifth of the rounds (under 2 points: levelled off)",
        "",
        table,
        f"![{title}]({plot})",
    ]
    return "\n".join(lines) + "\n"


def write_report(page: Path, key: str, title: str, command: str, out: Path, names: list[str], seeds: list[int]) -> Path:
    """Write ``key``'s section of ``page`` (made if missing) and its plot in ``results/`` beside it."""
    plot = page.parent / "results" / f"{key}.png"
    plot.parent.mkdir(parents=True, exist_ok=True)
    text = page.read_text() if page.exists() else "# Results\n"
    section = report_section(key, title, command, out, names, seeds, plot.relative_to(page.parent).as_posix())
    new_text = replace_section(text, key, section)  # before the plot: damaged markers change nothing
    plot_comparison(out, names, seeds, plot, title)
    page.write_text(new_text)
    return plot
