"""Summaries of an evaluation history (the paper's reported metrics) and the convergence plot.

A history is the list of ``metrics.jsonl`` records: dicts with at least ``round``, ``mean_acc`` and
``worst_acc`` (fractions in [0, 1]) and optionally ``global_acc``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable


def mean_of_best(values: Iterable[float], k: int = 5) -> float | None:
    vals = sorted((v for v in values if v is not None), reverse=True)[:k]
    return sum(vals) / len(vals) if vals else None


def rounds_to_reach(history: list[dict], threshold: float, key: str = "mean_acc") -> int | None:
    """First evaluated round whose ``key`` is at least ``threshold`` (None if never)."""
    for rec in sorted(history, key=lambda r: r["round"]):
        if rec.get(key) is not None and rec[key] >= threshold:
            return int(rec["round"])
    return None


def summarize(history: list[dict], threshold: float) -> dict[str, Any]:
    evals = [r for r in history if r.get("mean_acc") is not None]
    if not evals:
        return {"evaluations": 0}
    last = max(evals, key=lambda r: r["round"])
    summary = {
        "evaluations": len(evals),
        "last_round": int(last["round"]),
        "mean_acc_best5": mean_of_best(r["mean_acc"] for r in evals),
        "worst_acc_best5": mean_of_best(r["worst_acc"] for r in evals),
        "final_mean_acc": last["mean_acc"],
        "final_worst_acc": last["worst_acc"],
        "best_mean_acc": max(r["mean_acc"] for r in evals),
        "target_acc": threshold,
        "rounds_to_target": rounds_to_reach(evals, threshold),
    }
    pooled = [r["pooled_acc"] for r in evals if r.get("pooled_acc") is not None]
    if pooled:  # every client's local test samples counted together (DisTrans' metric)
        summary["pooled_acc_best5"] = mean_of_best(pooled)
        summary["final_pooled_acc"] = last.get("pooled_acc")
    globals_ = [r["global_acc"] for r in evals if r.get("global_acc") is not None]
    if globals_:
        summary["global_acc_best5"] = mean_of_best(globals_)
        summary["final_global_acc"] = last.get("global_acc")
    if last.get("wall_time") is not None:
        summary["wall_time_s"] = last["wall_time"]
    return summary


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


def summary_table(summary: dict[str, Any], title: str = "") -> str:
    """The summary as a small markdown table (what the CLI prints and summary.md holds)."""
    if not summary.get("evaluations"):
        return f"{title}\n(no evaluation recorded)\n" if title else "(no evaluation recorded)\n"
    reached = summary["rounds_to_target"]
    rows = [
        ("mean local-test acc, best 5 evals (%)", _pct(summary["mean_acc_best5"])),
        ("worst client acc, best 5 evals (%)", _pct(summary["worst_acc_best5"])),
        ("pooled local-test acc, best 5 evals (%)", _pct(summary.get("pooled_acc_best5"))),
        ("final mean / worst acc (%)", f"{_pct(summary['final_mean_acc'])} / {_pct(summary['final_worst_acc'])}"),
        ("global test acc, best 5 evals (%)", _pct(summary.get("global_acc_best5"))),
        (f"rounds to {_pct(summary['target_acc'])}% mean acc", "not reached" if reached is None else str(reached)),
        ("rounds run", str(summary["last_round"])),
        ("wall time (s)", "-" if summary.get("wall_time_s") is None else f"{summary['wall_time_s']:.1f}"),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"### {title}", ""] if title else []
    lines += [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {name.ljust(width)} | {value} |" for name, value in rows]
    return "\n".join(lines) + "\n"


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_history(history: list[dict], path: str | Path, title: str = "") -> None:
    """Mean and worst client accuracy (and global test accuracy) per evaluated round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = sorted((r for r in history if r.get("mean_acc") is not None), key=lambda r: r["round"])
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    rounds = [r["round"] for r in evals]
    ax.plot(rounds, [100 * r["mean_acc"] for r in evals], marker="o", ms=3, label="mean client (local test)")
    ax.plot(rounds, [100 * r["worst_acc"] for r in evals], marker="v", ms=3, ls="--", label="worst client")
    g = [(r["round"], 100 * r["global_acc"]) for r in evals if r.get("global_acc") is not None]
    if g:
        ax.plot(*zip(*g), ls=":", label="global test set")
    save_accuracy_plot(fig, ax, path, title, "accuracy (%)")


def save_accuracy_plot(fig, ax, path: str | Path, title: str, ylabel: str) -> None:
    """The shared look of our accuracy-per-round plots, then save and close."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("communication round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
