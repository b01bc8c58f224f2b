"""Tables, plots and the results page from run folders (fedbr_flwr/commands/report.py, fedbr-sweep --report),
on hand-made run folders: no processes."""

import csv
import json

import numpy as np
import pytest

from fedbr_flwr.commands import report, sweep
from fedbr_flwr.core.errors import ConfigError

from test_sweep import SWEEP, write

HOST = {"platform": "Linux-x86_64", "cpu": "Test CPU 9000", "cpus": 2, "gpu": None}


def fake_run(
    folder, accs, target=0.5, pooled=None, commit="abc1234def", day="2026-11-25", wall=10.0, cfg=None, best_pooled=None
):
    """A finished run's files: an evaluation every 2 rounds with mean accuracy ``accs[i]``, worst half of it."""
    folder.mkdir(parents=True, exist_ok=True)
    history = [{"round": 2 * (i + 1), "mean_acc": a, "worst_acc": a / 2} for i, a in enumerate(accs)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    config = {
        "dataset": "mnist5k",
        "model": "lenet",
        "num-rounds": 2 * len(accs),
        "lr": 0.05,
        "rotate": True,
        **(cfg or {}),
    }
    (folder / "manifest.json").write_text(
        json.dumps({"config": config, "git_commit": commit, "host": HOST, "started_utc": f"{day}T10:00:00+00:00"})
    )
    best5 = sorted(accs, reverse=True)[:5]
    summary = {
        "mean_acc_best5": sum(best5) / len(best5),
        "worst_acc_best5": sum(best5) / len(best5) / 2,
        "final_mean_acc": accs[-1],
        "final_worst_acc": accs[-1] / 2,
        "best_mean_acc": max(accs),
        "rounds_to_target": next((r["round"] for r in history if r["mean_acc"] >= target), None),
        "target_acc": target,
        "wall_time_s": wall,
        "last_round": history[-1]["round"],
    }
    if pooled is not None:
        summary["pooled_acc_best5"] = pooled
    if best_pooled is not None:
        summary["best_pooled_acc"] = best_pooled
    (folder / "summary.json").write_text(json.dumps(summary))


def test_the_move_in_the_last_fifth_is_that_of_the_mean_curve_over_seeds():
    curve = {2: [0.1, 0.3], 4: [0.5, 0.5], 6: [0.6, 0.8], 8: [0.7, 0.7], 10: [0.6, 0.9]}
    assert report.last_fifth_move(curve, 10) == pytest.approx(0.75 - 0.7)  # rounds 8 and 10
    assert report.last_fifth_move(curve, 20) is None  # no evaluation from round 16 on
    assert report.last_fifth_move({10: [0.5]}, 10) is None  # one point moves nowhere


def test_rounds_to_target_over_seeds_keep_their_fraction(tmp_path):
    out = tmp_path / "out"
    for seed, accs in enumerate([[0.2, 0.6], [0.2, 0.6], [0.6, 0.6]]):  # reached at rounds 4, 4 and 2
        fake_run(out / "A" / f"seed{seed}", accs)
    lines = report.write_comparison(out, ["A"], [0, 1, 2], "t").splitlines()
    assert dict(zip(lines[0].split(" | "), lines[2].split(" | ")))["rounds to 50%"] == "3.3"


@pytest.mark.parametrize("name", ["comparison.md", "comparison.csv"])
def test_a_sweep_stopped_as_it_writes_its_table_keeps_the_old_one_whole(tmp_path, monkeypatch, name):
    """comparison.md and .csv were written in place: a sweep stopped as it wrote them (Ctrl-C, SIGTERM, kill -9
    while the table of a sweep run again is written) left half a file. A rename that fails stands for the stop:
    the old file stays whole."""
    from fakes import stop_as_it_replaces

    out = tmp_path / "out"
    fake_run(out / "A" / "seed0", [0.2, 0.6])
    report.write_comparison(out, ["A"], [0], "t")
    old = (out / name).read_bytes()
    fake_run(out / "A" / "seed0", [0.3, 0.7])
    stop_as_it_replaces(monkeypatch, name)
    with pytest.raises(KeyboardInterrupt):
        report.write_comparison(out, ["A"], [0], "t")
    assert (out / name).read_bytes() == old
    assert not list(out.glob(".*.tmp"))


def test_comparison_gives_mean_std_per_seed_and_the_late_move(tmp_path):
    out = tmp_path / "out"
    fake_run(out / "A" / "seed0", [0.2, 0.6, 0.7, 0.72, 0.74])
    fake_run(out / "A" / "seed1", [0.2, 0.4, 0.5, 0.5, 0.56])
    fake_run(out / "B" / "seed0", [0.1, 0.3, 0.3, 0.3, 0.3])
    table = report.write_comparison(out, ["A", "B"], [0, 1], "t")
    lines = table.splitlines()
    assert lines[0].startswith("| run | seeds | mean acc, best 5 (%) | worst client, best 5 (%) | final mean acc (%)")
    assert "rounds to 50%" in lines[0] and lines[0].endswith("| seed 0 / 1: mean acc, best 5 (%) |")
    assert "pooled" not in lines[0] and "global" not in lines[0]  # no run has them
    a = dict(zip(lines[0].split(" | "), lines[2].split(" | ")))
    assert a["mean acc, best 5 (%)"] == "51.20 ± 11.31"  # best-5 means 0.592 and 0.432
    assert a["rounds to 50%"] == "5"  # rounds 4 and 6
    assert a["move in last fifth (points)"] == "4.00"  # rounds 8..10 of the mean curve: 0.61 -> 0.65
    assert lines[2].endswith("| 59.20 / 43.20 |")
    assert lines[3].startswith("| B | 1 | 26.00 | 13.00 | 30.00 | 15.00 | not reached | 0.00 | 10 |")
    rows = list(csv.DictReader(open(out / "comparison.csv")))
    assert rows[0]["run"] == "A" and float(rows[0]["last_fifth_move"]) == pytest.approx(0.04)
    assert rows[0]["rounds_to_target"] == "5.0" and rows[0]["target_acc"] == "0.5"  # the CSV says of what target


def test_the_csv_leaves_the_spread_of_a_missing_late_move_empty(tmp_path):
    out = tmp_path / "out"
    fake_run(out / "A" / "seed0", [0.2, 0.6], cfg={"num-rounds": 20})
    summary = json.loads((out / "A" / "seed0" / "summary.json").read_text())
    (out / "A" / "seed0" / "summary.json").write_text(json.dumps({**summary, "last_round": 20}))
    report.write_comparison(out, ["A"], [0], "t")  # finished, but no evaluation in the last fifth of 20 rounds
    row = next(csv.DictReader(open(out / "comparison.csv")))
    assert row["seeds"] == "1" and row["last_fifth_move"] == "" and row["last_fifth_move_std"] == ""


def test_a_run_that_did_not_finish_is_shown_as_failed_and_never_averaged(tmp_path):
    """Seed 1 of A died in round 3 of 10: its summary.json (rewritten at each evaluation) looks like a short
    run's. Its figures stay out of A's means, the row says it covers one seed, and which seed failed where."""
    out = tmp_path / "out"
    fake_run(out / "A" / "seed0", [0.2, 0.6, 0.7, 0.72, 0.74])
    died = out / "A" / "seed1"
    fake_run(died, [0.9], cfg={"num-rounds": 10})
    (died / "rounds.jsonl").write_text("".join(json.dumps({"round": r}) + "\n" for r in (1, 2, 3)))
    fake_run(out / "B" / "seed0", [0.1, 0.3, 0.3, 0.3, 0.3])
    fake_run(out / "B" / "seed1", [0.1, 0.3, 0.3, 0.3, 0.5])
    lines = report.write_comparison(out, ["A", "B"], [0, 1], "t").splitlines()
    assert lines[0].endswith("| seed 0 / 1: mean acc, best 5 (%) | not finished (left out) |")
    a, b = (dict(zip(lines[0].split(" | "), line.split(" | "))) for line in lines[2:4])
    assert a["seeds"] == "1" and a["mean acc, best 5 (%)"] == "59.20"  # seed 0 alone, no "±"
    assert lines[2].endswith("| 59.20 / failed | seed 1 failed after round 3 |")
    assert b["seeds"] == "2" and lines[3].endswith("| 26.00 / 30.00 | - |")
    rows = list(csv.DictReader(open(out / "comparison.csv")))
    assert rows[0]["seeds"] == "1" and rows[0]["not_finished"] == "seed 1 failed after round 3"


def test_a_running_run_s_summary_json_is_rewritten_at_each_evaluation(tmp_path):
    """What the report reads of a run that died before its end (above)."""
    from fedbr_flwr.core.config import validate
    from fedbr_flwr.runfiles.run_io import RunRecorder

    recorder = RunRecorder(validate({"output-dir": str(tmp_path)}), tmp_path)
    for r in (2, 4):
        recorder.log_eval({"round": r, "mean_acc": 0.5, "worst_acc": 0.4, "loss": 1.0})
        assert json.loads((tmp_path / "summary.json").read_text())["last_round"] == r


def test_a_figure_that_a_finished_seed_lacks_says_over_how_many_seeds_it_is(tmp_path):
    """Seed 1 finished, but no evaluation reached every client (its accuracy figures are None): A's accuracies
    are seed 0's alone, and the cell says so beside the row's 2 seeds."""
    out = tmp_path / "out"
    fake_run(out / "A" / "seed0", [0.2, 0.6, 0.7, 0.72, 0.74])
    fake_run(out / "A" / "seed1", [0.3, 0.5])
    summary = json.loads((out / "A" / "seed1" / "summary.json").read_text())
    summary.update(mean_acc_best5=None, worst_acc_best5=None, final_mean_acc=None)
    (out / "A" / "seed1" / "summary.json").write_text(json.dumps(summary))
    lines = report.write_comparison(out, ["A"], [0, 1], "t").splitlines()
    a = dict(zip(lines[0].split(" | "), lines[2].split(" | ")))
    assert a["seeds"] == "2" and a["mean acc, best 5 (%)"] == "59.20 (1/2 seeds)"
    assert a["final worst client (%)"] == "31.00 ± 8.49"  # both seeds have it
    assert a["rounds to 50%"] == "4"


def test_a_run_paused_at_its_checkpoint_is_shown_as_paused_not_failed(tmp_path):
    """A time limit stopped seed 1 after round 3 of 10, with its checkpoint at round 3: the table says it paused
    and resumes, and still leaves it out of the means. A checkpoint behind the last round means it died."""
    from fedbr_flwr.runfiles.checkpoint import save_checkpoint

    out = tmp_path / "out"
    fake_run(out / "A" / "seed0", [0.2, 0.6, 0.7, 0.72, 0.74])
    paused = out / "A" / "seed1"
    fake_run(paused, [0.9], cfg={"num-rounds": 10})
    (paused / "rounds.jsonl").write_text("".join(json.dumps({"round": r}) + "\n" for r in (1, 2, 3)))
    save_checkpoint(paused, {"w": np.zeros(2, dtype=np.float32)}, {"round": 3, "config": {}})
    lines = report.write_comparison(out, ["A"], [0, 1, 2], "t").splitlines()
    assert lines[2].endswith(
        "| 59.20 / paused / not run | seed 1 paused after round 3 of 10 (resumes from its checkpoint) |"
    )  # seed 2 has no folder: not "-", which a finished seed without the figure shows
    section = report.report_section("k", "t", "cmd", out, ["A"], [0, 1], "results/k.png")
    assert "- **in progress**: paused (by a time limit or a stop), A seed 1 at round 3 of 10 (" in section
    assert "- runs: 1 of 2 finished (1 setting x seeds 0, 1)," in section  # not "runs: 1" of a 2-run plan
    save_checkpoint(paused, {"w": np.zeros(2, dtype=np.float32)}, {"round": 2, "config": {}})
    lines = report.write_comparison(out, ["A"], [0, 1], "t").splitlines()
    assert lines[2].endswith("| 59.20 / failed | seed 1 failed after round 3 |")


def test_a_run_its_command_stopped_between_a_round_and_its_checkpoint_is_paused_not_failed(tmp_path):
    """SIGTERM came after round 3's record and before its checkpoint (round 2's is the last), and before any
    evaluation: the stop the command wrote in the run's events makes it paused at round 2, not failed. A stop
    followed by later events (the run resumed, then crashed) is a failure again."""
    from fedbr_flwr.runfiles.checkpoint import save_checkpoint
    from fedbr_flwr.runfiles.progress import Progress, mark_stopped

    out = tmp_path / "out"
    fake_run(out / "A" / "seed0", [0.2, 0.6, 0.7, 0.72, 0.74])
    stopped = out / "A" / "seed1"
    fake_run(stopped, [0.9], cfg={"num-rounds": 10})
    (stopped / "summary.json").unlink()
    (stopped / "rounds.jsonl").write_text("".join(json.dumps({"round": r}) + "\n" for r in (1, 2, 3)))
    save_checkpoint(stopped, {"w": np.zeros(2, dtype=np.float32)}, {"round": 2, "config": {}})
    progress = Progress(stopped)
    progress.emit("round", "round 3/10", round=3)
    assert report.seed_result(stopped) == (None, "failed after round 3")
    mark_stopped(stopped, "SIGTERM")
    assert report.seed_result(stopped) == (None, "paused after round 2 of 10 (resumes from its checkpoint)")
    section = report.report_section("k", "t", "cmd", out, ["A"], [0, 1], "results/k.png")
    assert "A seed 1 at round 2 of 10 (0.0 min)" in section
    progress.emit("error", "the run failed in round 3")
    assert report.seed_result(stopped) == (None, "failed after round 3")


def test_a_run_stopped_before_any_checkpoint_starts_again_and_one_not_started_is_not_run(tmp_path):
    """A time limit stopped seed 1 in its start-up (no run file written yet) and seed 2 after round 1 with
    checkpoints every 5 rounds: no checkpoint, so each starts again, stopped, not failed. Seed 3's folder holds
    only the labels a sweep writes for its trackers before the run starts: not run. Seed 4 crashed in its
    start-up."""
    from fedbr_flwr.runfiles.progress import Progress, mark_stopped, read_events
    from fedbr_flwr.runfiles.tracking import label_sweep_run

    out = tmp_path / "out"
    for seed in (1, 4):
        (out / "A" / f"seed{seed}").mkdir(parents=True)
        (out / "A" / f"seed{seed}" / "flower.log").write_text("starting\n")
    mark_stopped(out / "A" / "seed1", "time limit")
    started = out / "A" / "seed2"
    fake_run(started, [0.9], cfg={"num-rounds": 10})
    (started / "summary.json").unlink()
    (started / "rounds.jsonl").write_text(json.dumps({"round": 1}) + "\n")
    Progress(started).emit("round", "round 1/10", round=1)
    mark_stopped(started, "time limit")
    label_sweep_run(out / "A" / "seed3", "out", "A/seed3", ["A", "seed3"])
    assert [report.seed_result(out / "A" / f"seed{seed}")[1] for seed in (1, 2, 3, 4)] == [
        "stopped before its first round, with no checkpoint (starts again)",
        "stopped after round 1, with no checkpoint (starts again)",
        "",
        "failed before its first round",
    ]
    assert read_events(started / "progress.jsonl")[0][-1]["message"] == "run stopped (time limit); start it again"


def test_a_run_continued_on_another_machine_names_every_piece_s_commit_and_machine(tmp_path):
    out = tmp_path / "out"
    fake_run(out / "A" / "seed0", [0.5, 0.6])
    manifest_path = out / "A" / "seed0" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    h100 = {**HOST, "cpu": "Big CPU", "cpus": 16, "gpu": "NVIDIA H100"}
    manifest["resumed"] = [
        {"after_round": 1, "git_commit": "abc1234def"},  # recorded before pieces named their machine
        {"after_round": 2, "git_commit": "fed9876abc", "host": h100},
    ]
    manifest_path.write_text(json.dumps(manifest))
    section = report.report_section("k", "t", "cmd", out, ["A"], [0], "results/k.png")
    machines = "16-core Big CPU, GPU NVIDIA H100; 2-core Test CPU 9000, no GPU"
    assert f"- commit: abc1234, fed9876; machine: {machines}\n" in section


def test_settings_that_differ_between_runs_or_pieces_are_named_with_their_values(tmp_path):
    """A run resumed on another engine, beside a run that used one throughout: engine is not a setting of
    every run, and the settings line says which values it took; settings alike everywhere are not named."""
    out = tmp_path / "out"
    fake_run(out / "A" / "seed0", [0.5, 0.6], cfg={"engine": "clients"})
    fake_run(out / "B" / "seed0", [0.5, 0.6], cfg={"engine": "cohort"})
    section = report.report_section("k", "t", "cmd", out, ["A", "B"], [0], "results/k.png")
    assert "- settings of every run: `dataset=mnist5k model=lenet rotate=true num-rounds=4 lr=0.05`; " in section
    assert "differing between runs or their pieces: `engine` (clients, cohort)\n" in section
    manifest_path = out / "B" / "seed0" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["config"]["engine"] = "clients"  # B too started on engine=clients, and went on on cohort
    manifest["resumed"] = [{"after_round": 2, "config": {**manifest["config"], "engine": "cohort", "lr": 0.05}}]
    manifest_path.write_text(json.dumps(manifest))
    section = report.report_section("k", "t", "cmd", out, ["A", "B"], [0], "results/k.png")
    assert "differing between runs or their pieces: `engine` (clients, cohort)\n" in section
    fake_run(out / "A" / "seed0", [0.5, 0.6], cfg={"engine": "cohort"})
    fake_run(out / "B" / "seed0", [0.5, 0.6], cfg={"engine": "cohort"})
    section = report.report_section("k", "t", "cmd", out, ["A", "B"], [0], "results/k.png")
    assert "engine=cohort`\n" in section and "differing" not in section


def test_pooled_accuracy_is_shown_only_where_it_differs_from_the_mean(tmp_path):
    out = tmp_path / "out"
    fake_run(out / "A" / "seed0", [0.5, 0.6], pooled=0.55)
    assert "pooled" not in report.compare(out, ["A"], [0])[0]
    fake_run(out / "A" / "seed0", [0.5, 0.6], pooled=0.57)
    assert "| pooled acc, best 5 (%) |" in report.compare(out, ["A"], [0])[0]


def test_a_best_headline_leads_with_the_best_evaluation_as_distrans_tables_do(tmp_path):
    out = tmp_path / "out"
    fake_run(out / "A" / "seed0", [0.5, 0.6, 0.9], pooled=0.62, best_pooled=0.93)
    fake_run(out / "A" / "seed1", [0.5, 0.7, 0.8], pooled=0.64, best_pooled=0.85)
    assert "best eval" not in report.compare(out, ["A"], [0, 1])[0]  # the FedBR tables' headline: best 5
    lines = report.compare(out, ["A"], [0, 1], headline="best")[0].splitlines()
    assert lines[0].startswith(
        "| run | seeds | mean acc, best eval (%) | pooled acc, best eval (%) | mean acc, best 5 (%) |"
    )
    assert lines[2].startswith("| A | 2 | 85.00 ± 7.07 | 89.00 ± 5.66 |")
    with pytest.raises(ConfigError, match="'sweep.headline' must be one of best5, best"):
        sweep.load_sweep(write(tmp_path, SWEEP.replace("sweep:\n", "sweep:\n  headline: max\n")))


def test_the_distrans_files_evaluate_every_round_and_lead_with_the_best():
    from pathlib import Path

    from fedbr_flwr.core.config import load_yaml

    files = sorted((Path(__file__).resolve().parents[1] / "experiments").glob("distrans_*.yaml"))
    assert len(files) == 4
    for path in files:
        assert load_yaml(path)["eval-every"] == 1 and sweep.load_sweep(str(path)).headline == "best", path.name


def test_the_comparison_plot_holds_a_mean_and_a_worst_client_panel(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    out = tmp_path / "out"
    fake_run(out / "FedAvg" / "seed0", [0.2, 0.6])
    fake_run(out / "FedAvg" / "seed1", [0.4, 0.8])
    fake_run(out / "FedBR" / "seed0", [0.3, 0.7])
    drawn = {}
    close = plt.close
    monkeypatch.setattr(
        plt,
        "close",
        lambda fig: (
            drawn.update(
                {
                    ax.get_title(): {
                        line.get_label(): (list(line.get_ydata()), line.get_linestyle()) for line in ax.get_lines()
                    }
                    for ax in fig.axes
                }
            ),
            close(fig),
        ),
    )
    report.plot_comparison(out, ["FedAvg", "FedBR"], [0, 1], out / "c.png", "t")
    assert drawn["mean client"]["FedAvg"][0] == pytest.approx([30.0, 70.0])
    assert drawn["mean client"]["FedBR"] == (pytest.approx([30.0, 70.0]), "-")
    assert drawn["worst client"]["FedAvg"] == (pytest.approx([15.0, 35.0]), "--")
    assert (out / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_a_section_is_appended_then_replaced_and_the_rest_of_the_page_kept():
    page = "# Results\n\nhand-written intro\n"
    one = report.replace_section(page, "a", "## A\nOLD-TEXT\n")
    two = report.replace_section(one + "\nhand-written note after A\n", "b", "## B\n")
    three = report.replace_section(two, "a", "## A\nNEW-TEXT\n")
    assert three.count("hand-written intro") == 1 and f"{report._end('a')}\n\nhand-written note after A" in three
    assert "NEW-TEXT" in three and "OLD-TEXT" not in three and three.index("## A") < three.index("## B")
    assert report.replace_section(three, "a", "## A\nNEW-TEXT\n") == three


def swap_markers(text, key):
    return (
        text.replace(report._begin(key), "@")
        .replace(report._end(key), report._begin(key))
        .replace("@", report._end(key))
    )


@pytest.mark.parametrize(
    "damage", [lambda t, k: t.replace(report._end(k), ""), lambda t, k: t + report._begin(k) + "\n", swap_markers]
)
def test_damaged_markers_stop_the_report(damage):
    page = report.replace_section("# Results\n", "a", "## A\n")
    with pytest.raises(ConfigError, match="markers of section 'a' are damaged"):
        report.replace_section(damage(page, "a"), "a", "## A\n")


def test_sweep_report_writes_the_section_with_its_provenance_and_again_identically(tmp_path):
    path = write(tmp_path, SWEEP.replace("sweep:\n", "sweep:\n  title: A against B\n"))
    out, page = tmp_path / "out", tmp_path / "docs" / "results.md"
    for name, accs in (("FedAvg", [0.3, 0.5]), ("FedBR_no_max", [0.4, 0.6])):
        for seed in (0, 1):
            fake_run(
                out / name / f"seed{seed}",
                accs,
                day=f"2026-11-2{4 + seed}",
                wall=60.0,
                cfg={"num-clients": 2, "lr": 0.05},
            )
    argv = [path, "--out", str(out), "--table-only", "--report", str(page)]
    assert sweep.main(argv) == 0
    text = page.read_text()
    assert text.startswith("# Results\n") and "## A against B\n" in text
    assert f"fedbr-sweep {path} --out {out} --report {page}\n" in text  # --table-only: not part of the command
    assert "commit: abc1234; machine: 2-core Test CPU 9000, no GPU" in text
    assert "runs: 4 (2 settings x seeds 0, 1), started 2026-11-24 to 2026-11-25; wall time 4.0 min" in text
    assert "`dataset=mnist5k model=lenet rotate=true num-clients=2 num-rounds=4 lr=0.05`" in text
    assert "| FedAvg | 2 | 40.00 ± 0.00 |" in text and "| FedBR no max | 2 | 50.00 ± 0.00 |" in text
    assert "![A against B](results/s.png)" in text and (page.parent / "results" / "s.png").exists()
    page.write_text(text + "\nWhat this shows (hand-written).\n")
    assert sweep.main(argv) == 0
    assert page.read_text() == text + "\nWhat this shows (hand-written).\n"  # same runs: same section


def test_two_reports_written_to_one_page_at_once_keep_both_sections(tmp_path, monkeypatch):
    """Another sweep's report lands on the page while this one draws its plots (seconds): the page is read again
    under a lock when written, so neither section is lost."""
    out, page = tmp_path / "out", tmp_path / "docs" / "results.md"
    for name in ("A", "B"):
        fake_run(out / name / "seed0", [0.3, 0.5])
    draw, other = report.plot_comparison, []

    def another_report_meanwhile(*args):
        draw(*args)
        if not other:
            other.append("started")
            report.write_report(page, "other", "Other", "cmd", out, ["B"], [0])

    monkeypatch.setattr(report, "plot_comparison", another_report_meanwhile)
    report.write_report(page, "mine", "Mine", "cmd", out, ["A"], [0])
    text = page.read_text(encoding="utf-8")
    assert "## Mine\n" in text and "## Other\n" in text


def test_a_page_with_damaged_markers_is_left_as_it_was(tmp_path, capsys):
    path = write(tmp_path)
    out, page = tmp_path / "out", tmp_path / "results.md"
    fake_run(out / "FedAvg" / "seed0", [0.3, 0.5])
    page.write_text("# Results\n" + report._begin("s") + "\n")
    assert sweep.main([path, "--out", str(out), "--seeds", "0", "--table-only", "--report", str(page)]) == 2
    assert "the page's markers of section 's' are damaged" in capsys.readouterr().err  # said before the runs
    assert page.read_text() == "# Results\n" + report._begin("s") + "\n"
    assert not (tmp_path / "results").exists() or not list((tmp_path / "results").iterdir())


def test_a_verdict_compares_mean_less_spread_standard_deviations_with_the_others_mean_plus_them():
    ours, theirs = [0.90, 0.92, 0.94], [0.85, 0.87, 0.89]  # means 0.92 and 0.87, standard deviations 0.02
    assert report.verdict(ours, theirs, 1.0, True) == "ahead"  # 0.92 - 0.02 > 0.87 + 0.02
    assert report.verdict(ours, theirs, 1.5, True) == "level"  # 0.92 - 0.03 < 0.87 + 0.03
    assert report.verdict(theirs, ours, 1.0, True) == "behind"
    assert report.verdict([10, 12, 14], [20, 22, 24], 1.0, False) == "ahead"  # fewer rounds
    assert report.verdict([10, 12, 14], [13, 15, 17], 1.0, False) == "level"  # 12 + 2 > 15 - 2
    assert report.verdict([0.5], [0.5], 0.0, True) == "level"


GRID_RUNS = {  # cell lr -> run -> each seed's accuracies at rounds 2 and 4 (target 60%)
    0.01: {"FedAvg": [[0.5, 0.6], [0.5, 0.62], [0.5, 0.64]], "FedBR": [[0.6, 0.7], [0.6, 0.72], [0.6, 0.74]]},
    0.1: {"FedAvg": [[0.3, 0.4]] * 3, "FedBR": [[0.3, 0.7], [0.3, 0.3], [0.3, 0.32]]},
}
RULE = report.Rule("FedBR", "FedAvg", ("mean_acc_best5", "rounds_to_target"), 1.0)


def fake_grid(out):
    settings = []
    for lr, runs in GRID_RUNS.items():
        for run, seeds in runs.items():
            setting = report.Setting(run, (("lr", lr),))
            settings.append(setting)
            for seed, accs in enumerate(seeds):
                fake_run(setting.folder(out, seed), accs, target=0.6, cfg={"lr": lr, "eval-every": 2})
    return settings


def test_the_rule_decides_each_cell_on_each_metric_counting_a_target_never_reached_after_the_last_round(tmp_path):
    out = tmp_path / "out"
    settings = fake_grid(out)
    fast, slow = report.decide(out, settings, [0, 1, 2], RULE)
    assert fast.setting == report.Setting("FedBR", (("lr", 0.01),)) and fast.baseline.run == "FedAvg"
    assert fast.results["mean_acc_best5"] == (pytest.approx(0.10), "ahead")  # 0.66 - 0.01 > 0.56 + 0.01
    assert fast.results["rounds_to_target"] == (pytest.approx(-2.0), "ahead")  # round 2 against round 4
    assert slow.results["mean_acc_best5"] == (pytest.approx(0.02), "level")  # 0.37 ± 0.11 against 0.35 ± 0
    assert slow.results["rounds_to_target"] == (pytest.approx(-2 / 3), "level")  # 4, 6, 6 (± 1.15) against 6, 6, 6
    table = report.decision_table([fast, slow], RULE, [0, 1, 2])
    assert "- mean acc, best 5: FedBR 1 ahead, 1 level, 0 behind of 2 cells" in table
    assert "| lr | mean acc, best 5: FedBR − FedAvg (points) | rounds to target: FedBR − FedAvg (rounds) |" in table
    assert "| 0.01 | +10.00 ahead | -2.0 ahead |" in table and "| 0.1 | +2.00 level | -0.7 level |" in table
    fake_run(out / "FedAvg" / "lr=0.1" / "seed2", [0.3], cfg={"num-rounds": 4})  # stopped after round 2 of 4
    assert report.decide(out, settings, [0, 1, 2], RULE)[1].results["mean_acc_best5"] is None
    (out / "FedAvg" / "lr=0.1" / "seed2" / "summary.json").unlink()  # a seed still to run decides nothing
    assert report.decide(out, settings, [0, 1, 2], RULE)[1].results["mean_acc_best5"] is None


def test_the_heatmap_marks_the_cells_the_rule_decides(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    out = tmp_path / "out"
    decisions = report.decide(out, fake_grid(out), [0, 1, 2], RULE)
    drawn = {}
    close = plt.close
    monkeypatch.setattr(
        plt,
        "close",
        lambda fig: (drawn.update({ax.get_title(): [t.get_text() for t in ax.texts] for ax in fig.axes}), close(fig)),
    )
    report.plot_decisions(decisions, RULE, out / "d.png", "t")
    assert drawn["mean acc, best 5 (points)"] == ["+10.0 ▲", "+2.0"]
    assert drawn["rounds to target (rounds)"] == ["-2.0 ▲", "-0.7"]
    assert (out / "d.png").read_bytes()[:4] == b"\x89PNG"


def test_a_grid_sweeps_report_has_the_factors_as_columns_and_the_rules_decisions(tmp_path):
    text = SWEEP.replace("seeds: [0, 1]", "seeds: [0, 1, 2]").replace(
        "    FedBR no max: {strategy: fedbr, fedbr-max-step: false}\n",
        "    FedBR: {strategy: fedbr}\n  grid: {lr: [0.01, 0.1]}\n"
        "  decide: {method: FedBR, baseline: FedAvg, metrics: [mean_acc_best5, rounds_to_target]}\n",
    )
    path, out, page = write(tmp_path, text), tmp_path / "out", tmp_path / "results.md"
    fake_grid(out)
    assert sweep.main([path, "--out", str(out), "--table-only", "--report", str(page)]) == 0
    section = page.read_text()
    assert "| run | lr | seeds | mean acc, best 5 (%) |" in section and "| FedBR | 0.1 | 3 | 37.00 ± 11.27 |" in section
    assert "runs: 12 (4 settings x seeds 0, 1, 2)" in section
    assert "### FedBR against FedAvg\n\nRule (fixed in the sweep file before its runs): FedBR is ahead" in section
    assert "| 0.1 | +2.00 level | -0.7 level |" in section
    assert "![s: FedBR − FedAvg](results/s-decisions.png)" in section
    assert (tmp_path / "results" / "s-decisions.png").exists()
    assert "| 0.01 | +10.00 ahead | -2.0 ahead |" in (out / "comparison.md").read_text()
    assert (out / "decisions.png").exists()


def test_a_grid_of_more_than_twelve_settings_is_drawn_as_heatmaps(tmp_path):
    """48 curves cannot be told apart: a grid past 12 settings gets one heatmap per run of each cell's mean
    accuracy (its cells filled from the runs, "?" where a seed is missing); a short list keeps its curves."""
    out = tmp_path / "out"
    grid = [
        report.Setting(run, (("aggregation", rule), ("lr", lr)))
        for run in ("A", "B")
        for rule in "xyz"
        for lr in (1, 2, 3)
    ]
    for setting in grid[:-1]:
        fake_run(setting.folder(out, 0), [0.5, 0.6])
    report.plot_comparison(out, grid, [0], tmp_path / "grid.png", "t")
    assert (tmp_path / "grid.png").stat().st_size > 0
    assert report.grid_axes(grid)[1:] == ([1, 2, 3], [(("aggregation", r),) for r in "xyz"])
    drawn = []
    import matplotlib.axes

    original = matplotlib.axes.Axes.text
    try:
        matplotlib.axes.Axes.text = lambda self, x, y, s, **kw: drawn.append(s) or original(self, x, y, s, **kw)
        report.plot_comparison(out, grid, [0], tmp_path / "grid.png", "t")
    finally:
        matplotlib.axes.Axes.text = original
    assert drawn.count("?") == 1 and drawn.count("55.0") == 17  # best 5 of two evaluations: their mean


def test_the_last_fifths_move_is_its_range_not_its_end_to_end_change():
    """A curve that jumps and comes back within the last fifth has not levelled off."""
    assert report.last_fifth_move({8: [0.5], 9: [0.7], 10: [0.5]}, 10) == pytest.approx(0.2)


def test_the_last_fifths_move_is_that_of_the_finished_seeds_only(tmp_path):
    out = tmp_path / "out"
    fake_run(out / "FedAvg" / "seed0", [0.5, 0.6, 0.6, 0.6, 0.6])  # rounds 2..10: level at 0.6
    fake_run(out / "FedAvg" / "seed1", [0.1, 0.9, 0.1, 0.9], cfg={"num-rounds": 10})  # failed after round 8
    (row,) = report.compare(out, ["FedAvg"], [0, 1])[1]
    assert row["last_fifth_move_n"] == 1 and row["last_fifth_move"] == 0.0  # seed 1's 0.9 at round 8 would make it 0.15


def test_a_finished_run_in_which_no_round_trained_is_no_result(tmp_path):
    """Every update rejected (NaN after a too large lr): the summary holds the initial model's accuracy."""
    folder = tmp_path / "FedAvg" / "seed0"
    fake_run(folder, [0.1, 0.1])
    summary = json.loads((folder / "summary.json").read_text())
    (folder / "summary.json").write_text(json.dumps({**summary, "rounds_trained": 0}))
    assert report.seed_result(folder) == (None, "failed: no round trained")


def test_a_method_cell_is_decided_against_the_baseline_cell_of_the_factors_the_baseline_uses(tmp_path):
    """A baseline swept over lr alone against a method swept over lr and mu: each (lr, mu) cell is decided against
    the baseline's lr cell; a method cell that two baseline cells fit is not decided at all."""
    out = tmp_path / "out"
    cells = [report.Setting("FedBR", (("lr", 0.01), ("mu", mu))) for mu in (0.1, 1.0)]
    baseline = report.Setting("FedAvg", (("lr", 0.01),))
    for setting in (*cells, baseline):
        for seed in (0, 1):
            fake_run(setting.folder(out, seed), [0.5, 0.6 + seed / 100])
    rule = report.Rule("FedBR", "FedAvg", ("mean_acc_best5",), 1.0)
    decisions = report.decide(out, [*cells, baseline], [0, 1], rule)
    assert [(d.setting, d.baseline) for d in decisions] == [(cell, baseline) for cell in cells]
    anywhere = report.Setting("FedAvg", ())
    for seed in (0, 1):
        fake_run(anywhere.folder(out, seed), [0.5, 0.6])
    assert report.decide(out, [*cells, baseline, anywhere], [0, 1], rule) == []


def test_a_rule_may_compare_plain_means_with_a_spread_of_zero():
    rule = report.Rule.from_block({"method": "FedBR", "baseline": "FedAvg", "spread": 0}, ["FedAvg", "FedBR"], "x")
    assert rule.spread == 0.0


def test_a_torn_manifest_leaves_its_seed_out_of_the_sections_provenance_without_stopping_it(tmp_path):
    out = tmp_path / "out"
    for seed in (0, 1):
        fake_run(out / "FedAvg" / f"seed{seed}", [0.5, 0.6], commit=f"c{seed}" * 5)
    manifest = out / "FedAvg" / "seed1" / "manifest.json"
    manifest.write_text(manifest.read_text()[:25])
    manifests, paused = report._manifests_and_paused(out, ["FedAvg"], [0, 1])
    assert [m["git_commit"] for m in manifests] == ["c0c0c0c0c0"] and paused == []


def test_the_best_pooled_column_is_left_out_where_it_equals_the_best_mean(tmp_path):
    out = tmp_path / "out"
    fake_run(out / "A" / "seed0", [0.5, 0.6, 0.9], pooled=0.62, best_pooled=0.9)
    assert "pooled acc, best eval" not in report.compare(out, ["A"], [0], headline="best")[0]


def test_rounds_to_target_reads_not_reached_only_where_a_seed_finished(tmp_path):
    out = tmp_path / "out"
    fake_run(out / "A" / "seed0", [0.1, 0.2])  # finished, target 50% never reached
    table = report.compare(out, ["A", "B"], [0])[0]  # B: no seed run
    header, _, a, b = table.splitlines()[:4]
    assert dict(zip(header.split(" | "), a.split(" | ")))["rounds to 50%"] == "not reached"
    assert dict(zip(header.split(" | "), b.split(" | ")))["rounds to 50%"] == "-"
