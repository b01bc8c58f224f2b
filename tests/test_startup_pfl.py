"""The pfl-research column of ``fedbr-bench --startup``: its milestones, when it is in the default variant list,
and the process it starts. The last test (pfl installed only) checks that it trains what the bare loop trains."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from fedbr_flwr.bench import command as bench
from fedbr_flwr.bench import startup
from fedbr_flwr.bench.startup import (
    PFL_SKIPPED,
    SHUTDOWN,
    VARIANTS,
    WORKLOAD,
    default_variants,
    phases,
    variant_command,
)

FLOWER_AND_BARE = [
    "engine=cohort",
    "engine=clients",
    "engine=cohort, backend=ray",
    "engine=clients, --superlink",
    "bare loop",
]


def pretend_pfl(monkeypatch, installed: bool) -> None:
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "pfl":
            return object() if installed else None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_the_pfl_processs_lines_end_the_same_phases_as_the_bare_loops():
    lines = [
        (2.5, "pfl-research: fedavg on mnist5k, 10 clients, 20 rounds"),
        (4.0, "[pfl] 10 clients built"),
        (4.5, "[pfl] round 1/20 | 0.50 s"),
        (5.0, "[pfl] round 2/20 | 0.50 s"),
        (13.0, "[pfl] round 19/20 | 0.50 s"),
        (14.0, "[pfl] round 20/20 | 0.50 s"),
        (14.25, "[pfl] evaluated : mean local-test acc 11.22%"),
    ]
    got = phases(lines, total=15.0)
    assert got == pytest.approx(
        {
            "command: imports, config, partition": 2.5,
            "clients up, data loaded (discovery)": 1.5,
            "rounds": 10.0,
            "final evaluation, run files": 0.25,
            SHUTDOWN: 0.75,
        }
    )


def test_a_pfl_line_that_is_not_a_milestone_ends_no_phase():
    lines = [
        (1.0, "pfl: fedavg on mnist5k"),  # not the first line's name
        (2.0, "[pfl] round 3/20 | 0.50 s"),  # not the last round
        (3.0, "[pfl] evaluating"),
    ]
    assert phases(lines, total=4.0) == {SHUTDOWN: 4.0}


def test_the_default_variants_have_pfl_research_exactly_when_pfl_is_importable(monkeypatch, capsys):
    pretend_pfl(monkeypatch, installed=True)
    assert default_variants() == [*FLOWER_AND_BARE, "pfl-research"]
    assert PFL_SKIPPED not in capsys.readouterr().out

    pretend_pfl(monkeypatch, installed=False)
    assert default_variants() == FLOWER_AND_BARE
    out = capsys.readouterr().out
    assert out.count("pfl-research column is skipped") == 1 and "pip install" in out
    assert VARIANTS["pfl-research"] == ("pfl", [])  # still there to ask for by name


@pytest.mark.parametrize("installed", [True, False])
def test_fedbr_bench_startup_runs_the_default_variants(monkeypatch, capsys, installed):
    pretend_pfl(monkeypatch, installed)
    seen = []
    monkeypatch.setattr(startup, "startup_main", lambda items, repeats, variants, json_path: seen.append(variants))
    bench.main(["--startup", "1"])
    assert seen == [[*FLOWER_AND_BARE, *(["pfl-research"] if installed else [])]]
    assert ("pfl-research column is skipped" in capsys.readouterr().out) is not installed


def test_the_pfl_research_variant_runs_its_own_module():
    out = Path("/tmp/x/run")
    command = variant_command("pfl-research", ["lr=0.1"], out)
    assert command == [sys.executable, "-m", "fedbr_flwr.bench.startup_pfl", *WORKLOAD, "lr=0.1", f"output-dir={out}"]
    assert variant_command("bare loop", [], out)[:3] == [sys.executable, "-m", "fedbr_flwr.bench.startup"]
    assert variant_command("engine=cohort", [], out)[-1] == "--verbose"


@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_pfl_trains_what_the_bare_loop_trains(weighting):
    """Same initial weights, batches, local SGD and averaging: after two rounds the global models agree to
    float rounding (pfl installed only: ``pip install -e '.[pfl]'``)."""
    pytest.importorskip("pfl")
    import torch

    from fedbr_flwr.bench.bare import bare_loop
    from fedbr_flwr.bench.startup_pfl import mean_local_accuracy, pfl_loop
    from fedbr_flwr.launch.plan import build_config

    # unequal partitions, so that weighting=samples differs from uniform
    cfg = build_config([*WORKLOAD, "num-clients=4", "num-rounds=2", "partition=dirichlet", f"weighting={weighting}"])
    device = torch.device("cpu")
    _, clients, arrays = bare_loop(cfg, cfg["num-rounds"], device)
    model, data = pfl_loop(cfg, device)
    assert len({len(c.y_train) for c in data}) > 1
    state = model.pytorch_model.model.state_dict()
    assert set(arrays) == {f"model/{k}" for k in state}
    for key, value in state.items():
        assert torch.allclose(torch.from_numpy(arrays[f"model/{key}"]), value, atol=1e-6), key
    bare_accuracy = sum(c.evaluate(arrays, {})[2]["accuracy"] for c in clients) / len(clients)
    assert mean_local_accuracy(model, data) == pytest.approx(bare_accuracy, abs=1e-6)


def test_pfl_evaluates_no_user_before_the_end():
    """pfl evaluates every user before and after local training in each iteration i with i % frequency == 0,
    so always in the first one; the workload evaluates once, at the end (pfl installed only)."""
    pytest.importorskip("pfl")
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.hyperparam import NNTrainHyperParams

    from fedbr_flwr.bench.startup_pfl import FedAvgNoLocalEvaluation

    params = NNAlgorithmParams(
        central_num_iterations=20, evaluation_frequency=20, train_cohort_size=10, val_cohort_size=None
    )
    train = NNTrainHyperParams(local_batch_size=32, local_num_epochs=1, local_learning_rate=0.02)
    plain, _, _ = FederatedAveraging().get_next_central_contexts(None, 0, params, train)
    assert [c.do_evaluation for c in plain] == [True]  # what it fixes
    for iteration in (0, 1, 19):
        contexts, _, _ = FedAvgNoLocalEvaluation().get_next_central_contexts(None, iteration, params, train)
        assert [c.do_evaluation for c in contexts] == [False]
    assert FedAvgNoLocalEvaluation().get_next_central_contexts(None, 20, params, train)[0] is None
