"""Summaries of an evaluation history, the markdown table and the convergence plot."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fedbr_flwr.runfiles.metrics import plot_history, read_jsonl, summarize, summary_table

MEAN = [0.30, 0.55, 0.61, 0.72, 0.70, 0.8247, 0.79, 0.65]
WORST = [0.10, 0.20, 0.45, 0.40, 0.52, 0.50, 0.61, 0.33]
GLOBAL = [0.25, 0.50, 0.58, 0.70, 0.69, 0.81, 0.77, 0.60]


def history():
    return [
        {"round": 2 * (i + 1), "mean_acc": m, "worst_acc": w, "global_acc": g, "wall_time": 1.5 * (i + 1)}
        for i, (m, w, g) in enumerate(zip(MEAN, WORST, GLOBAL))
    ]


def test_summarize_best5_and_finals():
    s = summarize(history(), threshold=0.7)
    assert s["evaluations"] == 8
    assert s["last_round"] == 16
    assert s["mean_acc_best5"] == pytest.approx(np.mean(sorted(MEAN)[-5:]))
    assert s["worst_acc_best5"] == pytest.approx(np.mean(sorted(WORST)[-5:]))
    assert s["global_acc_best5"] == pytest.approx(np.mean(sorted(GLOBAL)[-5:]))
    assert s["final_mean_acc"] == 0.65 and s["final_worst_acc"] == 0.33 and s["final_global_acc"] == 0.60
    assert s["best_mean_acc"] == 0.8247
    assert s["target_acc"] == 0.7
    assert s["wall_time_s"] == 12.0
    # mean_acc first >= 0.7 at the 4th evaluation (round 8)
    assert s["rounds_to_target"] == 8


def test_summarize_gives_the_best_pooled_accuracy_the_distrans_paper_reports():
    pooled = [0.4, 0.9, 0.7, 0.6, 0.5, 0.55]
    h = [{"round": i + 1, "mean_acc": 0.5, "pooled_acc": p} for i, p in enumerate(pooled)]
    s = summarize(h, 0.7)
    assert s["best_pooled_acc"] == 0.9
    assert s["pooled_acc_best5"] == pytest.approx(np.mean(sorted(pooled)[-5:]))
    assert "best_pooled_acc" not in summarize(history(), 0.7)  # no pooled figure recorded


def test_summarize_best5_is_independent_of_order():
    shuffled = history()[::-1]
    a, b = summarize(history(), 0.7), summarize(shuffled, 0.7)
    assert a == b


def test_rounds_to_target_exact_threshold_and_never():
    assert summarize(history(), threshold=0.72)["rounds_to_target"] == 8  # >= counts
    assert summarize(history(), threshold=0.55)["rounds_to_target"] == 4
    assert summarize(history(), threshold=0.9)["rounds_to_target"] is None


def test_fewer_than_five_evaluations():
    h = history()[:3]
    s = summarize(h, 0.5)
    assert s["evaluations"] == 3
    assert s["mean_acc_best5"] == pytest.approx(np.mean(MEAN[:3]))
    assert s["worst_acc_best5"] == pytest.approx(np.mean(WORST[:3]))


def test_records_without_mean_acc_are_ignored_and_global_optional():
    h = [{"round": 1, "mean_acc": None, "worst_acc": None}, {"round": 2, "mean_acc": 0.4, "worst_acc": 0.2}]
    s = summarize(h, 0.5)
    assert s["evaluations"] == 1 and s["last_round"] == 2
    assert "global_acc_best5" not in s and "wall_time_s" not in s
    assert s["rounds_to_target"] is None


def test_empty_history():
    assert summarize([], 0.5) == {"evaluations": 0}
    assert "no evaluation" in summary_table({"evaluations": 0})
    assert summary_table({"evaluations": 0}, "t").startswith("t")


def test_summary_table_percentages():
    s = summarize(history(), 0.7)
    table = summary_table(s, title="fedavg on mnist5k")
    assert table.startswith("### fedavg on mnist5k")
    assert "73.69" in table  # mean of the 5 best mean_acc: (0.8247+0.79+0.72+0.70+0.65)/5
    assert f"{100 * np.mean(sorted(MEAN)[-5:]):.2f}" in table
    assert f"{100 * np.mean(sorted(WORST)[-5:]):.2f}" in table
    assert "65.00 / 33.00" in table
    assert "rounds to 70.00% mean acc" in table
    assert "| 8 |" in table and "| 16 |" in table
    assert "12.0" in table
    lines = [line for line in table.splitlines() if line.startswith("|")]
    assert len({len(line.split("|")) for line in lines}) == 1  # well-formed two-column table
    single = summary_table(summarize([{"round": 3, "mean_acc": 0.82471, "worst_acc": 0.5}], 0.5))
    assert "| 82.47 |" in single and "82.47 / 50.00" in single
    never = summary_table(summarize(history(), 0.95))
    assert "not reached" in never


def test_the_final_row_names_no_round_where_the_last_evaluation_is_complete():
    """Only a final figure that is not the last evaluation's (a partial last one) names its round."""
    table = summary_table(summarize(history(), 0.7))
    assert "| final mean / worst acc (%) " in table and ", round" not in table


def test_plot_history_writes_png_with_whole_rounds_on_its_axis(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    ticks = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (ticks.extend(fig.axes[0].get_xticks()), close(fig)))
    path = tmp_path / "convergence.png"
    plot_history([{"round": r, "mean_acc": 0.04 * r, "worst_acc": 0.02 * r} for r in range(2, 21, 2)], path, title="t")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG")
    assert len(data) > 1000
    assert ticks and all(float(t).is_integer() for t in ticks)


def test_read_jsonl(tmp_path):
    p = tmp_path / "m.jsonl"
    assert read_jsonl(p) == []
    p.write_text("\n".join(json.dumps(r) for r in history()) + "\n\n")
    assert read_jsonl(p) == history()


def test_a_damaged_line_that_a_crash_did_not_cut_short_is_an_error(tmp_path):
    """Only a last line without its newline is what a crash leaves; a whole line that is no JSON is damage."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"round": 1}\n{"round": 2')
    assert read_jsonl(path) == [{"round": 1}]
    path.write_text('{"round": 1}\n{bad}\n')
    with pytest.raises(ValueError):
        read_jsonl(path)
