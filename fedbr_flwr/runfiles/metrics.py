"""Summaries of an evaluation history (the paper's reported metrics) and the convergence plot.

A history is the list of ``metrics.jsonl`` records: dicts with at least ``round``, ``mean_acc`` and
``worst_acc`` (fractions in [0, 1]) and optionally the server's tests (``global_acc``, ``global_worst_acc``,
``global_acc_by_angle``, ``extra_local_acc``, ...); a value written as ``null`` (a NaN or
infinite one, e.g. the loss of a diverged model) counts as missing. ``clients_evaluated`` of
``clients_expected`` says whether an evaluation is complete; summary figures count complete ones only.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from .jsonsafe import write_atomically


@dataclass(frozen=True)
class ClientMetric:
    """A figure of one evaluation over the clients that answered, computed from their local test accuracies
    and test-set sizes (in the same order). Every evaluation records it in metrics.jsonl under its name;
    the summary has its mean of the best 5 (``<name>_best5``), its best and its final figure; the tables
    show the best-5 figure, and the final one with ``final_column``; a sweep's rule may decide on them."""

    label: str  # its name in the tables: "mean acc" gives "mean acc, best 5 (%)"
    compute: Callable[[list[float], list[int]], float]
    final_column: bool = True


CLIENT_METRICS: dict[str, ClientMetric] = {
    "mean_acc": ClientMetric("mean acc", lambda accs, sizes: float(np.mean(accs))),
    "worst_acc": ClientMetric("worst client", lambda accs, sizes: float(np.min(accs))),
    # every client's test samples counted together (DisTrans' metric); equal to mean_acc on equal test sets
    "pooled_acc": ClientMetric(
        "pooled acc",
        lambda accs, sizes: sum(acc * size for acc, size in zip(accs, sizes)) / max(sum(sizes), 1),
        final_column=False,
    ),
}


def mean_of_best(values: Iterable[float | None], k: int = 5) -> float | None:
    vals = sorted((v for v in values if v is not None), reverse=True)[:k]
    return sum(vals) / len(vals) if vals else None


def rounds_to_reach(history: list[dict], threshold: float, key: str = "mean_acc") -> int | None:
    """First evaluated round whose ``key`` is at least ``threshold`` (None if never)."""
    for rec in sorted(history, key=lambda r: r["round"]):
        if rec.get(key) is not None and rec[key] >= threshold:
            return int(rec["round"])
    return None


def is_partial(record: dict) -> bool:
    """An evaluation some client did not answer: scored over the clients that did only, so not
    comparable with a complete one (lines written before ``clients_evaluated`` existed: ``eval_failures``)."""
    if record.get("clients_evaluated") is not None and record.get("clients_expected") is not None:
        return record["clients_evaluated"] < record["clients_expected"]
    return bool(record.get("eval_failures"))


def rounds_without_update(rounds: list[dict]) -> list[int]:
    """The rounds (rounds.jsonl records) that left the global model unchanged: fewer valid updates than
    min-fit-clients, because every client failed or every update was rejected (NaN, wrong arrays)."""
    return sorted(int(r["round"]) for r in rounds if r.get("skipped"))


def summarize(history: list[dict], threshold: float, rounds: list[dict] | None = None) -> dict[str, Any]:
    """The run's figures from its evaluations (metrics.jsonl records). Best-of, final and rounds-to-target
    figures count complete evaluations only (every client answered); the global test accuracy is the
    server's own and counts every evaluation. ``rounds`` (rounds.jsonl records): also which rounds left
    the model unchanged."""
    trained = {}
    if rounds:
        without = rounds_without_update(rounds)
        trained = {
            "rounds_trained": len({int(r["round"]) for r in rounds}) - len(without),
            "rounds_without_update": without,
        }
    evals = [r for r in history if r.get("mean_acc") is not None]
    if not evals:
        return {"evaluations": 0, **trained}
    last = max(evals, key=lambda r: r["round"])
    complete = [r for r in evals if not is_partial(r)]
    final = max(complete, key=lambda r: r["round"]) if complete else {}
    summary = {
        "evaluations": len(evals),
        "complete_evaluations": len(complete),
        "partial_evaluations": sorted(int(r["round"]) for r in evals if is_partial(r)),
        "last_round": int(last["round"]),
        "final_round": int(final["round"]) if final else None,
        "target_acc": threshold,
        "rounds_to_target": rounds_to_reach(complete, threshold),
        **trained,
    }
    for name in recorded_client_metrics(evals):  # best_*: the best evaluation, the DisTrans paper's headline
        values = [r[name] for r in complete if r.get(name) is not None]
        summary |= {f"{name}_best5": mean_of_best(values), f"best_{name}": max(values, default=None)}
        summary[f"final_{name}"] = final.get(name)
    summary |= server_test_summary(evals)
    if last.get("wall_time") is not None:
        summary["wall_time_s"] = last["wall_time"]
    return summary


def recorded_client_metrics(evals: list[dict]) -> list[str]:
    """The client metrics some evaluation recorded (a metric added later is missing from older runs)."""
    return [name for name in CLIENT_METRICS if any(r.get(name) is not None for r in evals)]


def server_test_summary(evals: list[dict]) -> dict[str, Any]:
    """The server's tests over the evaluations that ran them (every one counts: the server answers for
    itself): the best-5 means of the balanced global test's mean and worst angle and of the extra local
    tests' mean and worst set, and each one's latest figures (``final_*``: its last run, per angle too)."""
    summary: dict[str, Any] = {}
    for prefix, per_part in (("global", "global_acc_by_angle"), ("extra_local", "extra_local_acc_by_set")):
        ran = sorted((r for r in evals if r.get(f"{prefix}_acc") is not None), key=lambda r: r["round"])
        if not ran:
            continue
        latest = ran[-1]
        summary[f"{prefix}_acc_best5"] = mean_of_best(r[f"{prefix}_acc"] for r in ran)
        summary[f"final_{prefix}_acc"] = latest[f"{prefix}_acc"]
        worst = [r.get(f"{prefix}_worst_acc") for r in ran]
        if any(w is not None for w in worst):
            summary[f"{prefix}_worst_acc_best5"] = mean_of_best(worst)
            summary[f"final_{prefix}_worst_acc"] = latest.get(f"{prefix}_worst_acc")
        if latest.get(per_part) is not None:
            summary[f"final_{per_part}"] = latest[per_part]
        if latest.get(f"{prefix}_worst_angle") is not None:
            summary[f"final_{prefix}_worst_angle"] = latest[f"{prefix}_worst_angle"]
    return summary


def run_problem(summary: dict[str, Any]) -> str | None:
    """Why a finished run's result is not a result, or None: no round changed the global model (every
    update failed or was rejected), so its accuracy is the initial model's."""
    if "rounds_trained" in summary and summary["rounds_trained"] == 0:
        without = summary.get("rounds_without_update", [])
        return (
            f"no round trained: in all {len(without)} round(s) every client failed or its update was rejected "
            "(e.g. NaN after a too large lr), so the global model is the initial one and its accuracy is no "
            "result; rounds.jsonl says why each update was rejected"
        )
    return None


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.2f}"


def summary_table(summary: dict[str, Any], title: str = "") -> str:
    """The summary as a small markdown table (what the CLI prints and summary.md holds), with a line
    below it for rounds that left the model unchanged and for evaluations some client missed."""
    notes = _notes(summary)
    if not summary.get("evaluations"):
        text = f"{title}\n(no evaluation recorded)\n" if title else "(no evaluation recorded)\n"
        return text + "".join(f"\n{note}\n" for note in notes)
    reached = summary["rounds_to_target"]
    final = summary.get("final_round")
    final_name = (
        "final mean / worst acc (%)"
        if final in (None, summary["last_round"])
        else f"final mean / worst acc, round {final} (%)"
    )
    rows = [
        ("mean local-test acc, best 5 evals (%)", _pct(summary["mean_acc_best5"])),
        ("worst client acc, best 5 evals (%)", _pct(summary["worst_acc_best5"])),
        ("pooled local-test acc, best 5 evals (%)", _pct(summary.get("pooled_acc_best5"))),
        (final_name, f"{_pct(summary['final_mean_acc'])} / {_pct(summary['final_worst_acc'])}"),
        ("global test acc, best 5 evals (%)", _pct(summary.get("global_acc_best5"))),
        *_server_test_rows(summary),
        (f"rounds to {_pct(summary['target_acc'])}% mean acc", "not reached" if reached is None else str(reached)),
        ("rounds run", str(summary["last_round"])),
        ("wall time (s)", "-" if summary.get("wall_time_s") is None else f"{summary['wall_time_s']:.1f}"),
    ]
    if summary.get("partial_evaluations"):
        rows.append(("evaluations missing a client (not counted)", _rounds(summary["partial_evaluations"])))
    if summary.get("rounds_without_update"):
        rows.append(("rounds without update (model unchanged)", _rounds(summary["rounds_without_update"])))
    width = max(len(r[0]) for r in rows)
    lines = [f"### {title}", ""] if title else []
    lines += [f"| {'metric'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {name.ljust(width)} | {value} |" for name, value in rows]
    return "\n".join(lines) + "\n" + "".join(f"\n{note}\n" for note in notes)


def _server_test_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """Rows for the balanced global test's angles and the extra local tests, where the run has them."""
    rows = []
    by_angle = summary.get("final_global_acc_by_angle") or {}
    if len(by_angle) > 1:
        rows.append(("global test worst angle, best 5 evals (%)", _pct(summary.get("global_worst_acc_best5"))))
        angles = " / ".join(f"{a}: {_pct(v)}" for a, v in by_angle.items())
        worst = summary.get("final_global_worst_angle")
        rows.append((f"global test per angle, last (%; worst {worst} deg)", angles))
    if summary.get("extra_local_acc_best5") is not None:
        rows.append(
            (
                "extra local tests mean / worst, best 5 evals (%)",
                f"{_pct(summary['extra_local_acc_best5'])} / {_pct(summary.get('extra_local_worst_acc_best5'))}",
            )
        )
    return rows


def _rounds(rounds: list[int]) -> str:
    shown = ", ".join(str(r) for r in rounds[:10])
    return f"{len(rounds)}: round {shown}{', ...' if len(rounds) > 10 else ''}"


def _notes(summary: dict[str, Any]) -> list[str]:
    notes = []
    problem = run_problem(summary)
    if problem:
        notes.append(f"**Warning: {problem}.**")
    elif summary.get("rounds_without_update"):
        notes.append(
            f"Warning: {len(summary['rounds_without_update'])} round(s) left the global model unchanged "
            "(every client failed or its update was rejected; see rounds.jsonl)."
        )
    if summary.get("evaluations") and not summary.get("complete_evaluations", summary["evaluations"]):
        notes.append(
            "Warning: no complete evaluation: in every evaluation some client did not answer, so no "
            "accuracy figure is reported (metrics.jsonl holds the partial ones)."
        )
    elif summary.get("partial_evaluations"):
        notes.append(
            f"Note: {len(summary['partial_evaluations'])} evaluation(s) missed a client and are not "
            "counted in the figures above."
        )
    return notes


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSON-lines file, without a last line that a crash cut short (as a resume drops it); a
    ValueError for any other line that is not JSON."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1 and not text.endswith("\n"):
                break
            raise
    return records


def plot_history(history: list[dict], path: str | Path, title: str = "") -> None:
    """Mean and worst client accuracy (and the server's tests: the global test's mean and worst angle, the
    extra local tests' mean) per evaluated round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = sorted((r for r in history if r.get("mean_acc") is not None), key=lambda r: r["round"])
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    rounds = [r["round"] for r in evals]
    ax.plot(rounds, [100 * r["mean_acc"] for r in evals], marker="o", ms=3, label="mean client (local test)")
    w = [(r["round"], 100 * r["worst_acc"]) for r in evals if r.get("worst_acc") is not None]
    if w:
        ax.plot(*zip(*w), marker="v", ms=3, ls="--", label="worst client")
    g = [(r["round"], 100 * r["global_acc"]) for r in evals if r.get("global_acc") is not None]
    if g:
        ax.plot(*zip(*g), ls=":", label="global test (mean over angles)")
    gw = [(r["round"], 100 * r["global_worst_acc"]) for r in evals if r.get("global_worst_acc") is not None]
    if gw and any(len(r.get("global_acc_by_angle") or {}) > 1 for r in evals):
        ax.plot(*zip(*gw), ls="-.", label="global test, worst angle")
    e = [(r["round"], 100 * r["extra_local_acc"]) for r in evals if r.get("extra_local_acc") is not None]
    if e:
        ax.plot(*zip(*e), ls=(0, (1, 3)), label="extra local tests (mean)")
    save_accuracy_plot(fig, ax, path, title, "accuracy (%)")


def format_accuracy_axes(ax, title: str, ylabel: str) -> None:
    """The shared look of our accuracy-per-round axes: whole rounds, 0..100, a light grid."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("communication round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)


def save_accuracy_plot(fig, ax, path: str | Path, title: str, ylabel: str) -> None:
    """Our accuracy-per-round look and a legend, then save and close."""
    format_accuracy_axes(ax, title, ylabel)
    ax.legend(loc="best")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def save_figure(fig: Any, path: str | Path, dpi: int) -> None:
    """Save and close a matplotlib figure, replacing ``path`` atomically (a run killed as it plots leaves the
    old picture or the new one)."""
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(path).suffix.lstrip(".") or "png", dpi=dpi)
    plt.close(fig)
    write_atomically(Path(path), buffer.getvalue())
