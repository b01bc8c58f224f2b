"""Adding a client metric is one entry of ``CLIENT_METRICS`` (docs/adding-a-metric.md): the guide's code,
appended to fedbr_flwr/runfiles/metrics.py as the guide says, gives a figure every evaluation records, the summary
sums up, the tables show, a sweep's rule may decide on and the trackers plot."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from fedbr_flwr.commands import report
from fedbr_flwr.core.config import validate
from fedbr_flwr.runfiles import metrics
from fedbr_flwr.runfiles.metrics import read_jsonl
from fedbr_flwr.runfiles.tracking import eval_scalars

from fakes import in_process_federation, run_rounds

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "adding-a-metric.md"


def add_the_guides_metric(monkeypatch) -> metrics.ClientMetric:
    """The guide's block run at the end of metrics.py; ``CLIENT_METRICS`` is restored after the test."""
    block = re.search(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    assert block, "the guide shows its code in a python block"
    monkeypatch.setitem(metrics.CLIENT_METRICS, "median_acc", metrics.CLIENT_METRICS["mean_acc"])  # then removed
    exec(block.group(1), vars(metrics))
    return metrics.CLIENT_METRICS["median_acc"]


@pytest.fixture
def median(monkeypatch) -> metrics.ClientMetric:
    return add_the_guides_metric(monkeypatch)


def test_a_run_records_sums_up_and_plots_the_guides_metric(median, tmp_path):
    cfg = validate({"num-clients": 5, "local-steps": 2, "eval-every": 1, "global-test": False, "model": "cnn-small"})
    strategy, _, proxies = in_process_federation(cfg, tmp_path)
    run_rounds(strategy, proxies, 2)
    lines = read_jsonl(strategy.recorder.metrics_path)
    for line in lines:
        assert line["median_acc"] == np.median(list(line["per_client_acc"].values()))
        assert eval_scalars(line)["eval/median_acc"] == line["median_acc"]
    summary = metrics.summarize(lines, 0.5)
    assert summary["median_acc_best5"] == pytest.approx(np.mean([r["median_acc"] for r in lines]))
    assert summary["final_median_acc"] == lines[-1]["median_acc"]


def test_the_tables_show_and_a_rule_decides_the_guides_metric(median, tmp_path):
    for seed, figure in enumerate((0.4, 0.6)):
        folder = tmp_path / "A" / f"seed{seed}"
        folder.mkdir(parents=True)
        (folder / "metrics.jsonl").write_text(json.dumps({"round": 2, "mean_acc": 0.5, "median_acc": figure}) + "\n")
        (folder / "manifest.json").write_text(json.dumps({"config": {"num-rounds": 2}}))
        (folder / "summary.json").write_text(json.dumps(metrics.summarize(read_jsonl(folder / "metrics.jsonl"), 0.5)))
    table = report.compare(tmp_path, ["A"], [0, 1])[0]
    assert "| median client, best 5 (%) |" in table.splitlines()[0] and "| 50.00 ± 14.14 |" in table
    assert report.decidable()["median_acc_best5"] == ("median client, best 5", "points", True)


def test_a_run_recorded_before_the_metric_leaves_it_out(median):
    summary = metrics.summarize([{"round": 2, "mean_acc": 0.5, "worst_acc": 0.25}], 0.5)
    assert "median_acc_best5" not in summary and summary["mean_acc_best5"] == 0.5


@pytest.mark.parametrize("name", ["loss", "round", "global_acc"])
def test_a_metric_named_like_a_record_field_stops_instead_of_being_overwritten(monkeypatch, name):
    from fedbr_flwr.core.errors import ConfigError
    from fedbr_flwr.server.recording import eval_record

    monkeypatch.setitem(metrics.CLIENT_METRICS, name, metrics.ClientMetric("clash", lambda accs, sizes: 0.5))
    with pytest.raises(ConfigError, match=f"client metric\\(s\\) {name} have the name of a metrics.jsonl field"):
        eval_record(2, [(0, 1.0, 20, 0.2)], 0, [0], {}, {})
