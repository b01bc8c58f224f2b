"""The vectorised cohort step (``cohort-step=vmap``, ``fedbr_flwr.vectorised``): the members'
``FunctionalStep`` functions vmapped over the members must give what the per-client loop gives, for every
strategy and combination with a vectorised step.

vmap turns the members' convolutions into one grouped convolution, which sums in another order, so the
two engines agree to float rounding, not bit for bit, and short federations amplify rounding (at the
golden runs' lr 0.05 with the paper's CNN, scaling lr by 1 + 1e-6 moves FedBR's weights by 4e-4 after 3
rounds). So the engines are compared with the small CNN at lr 0.01, where the measured differences are
1e-8 to 3e-5 of the weights and 3e-6 to 8e-3 of how far the 3 rounds moved them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import golden
from fedbr_flwr import codec
from fedbr_flwr.config import ConfigError, validate
from fedbr_flwr.registry import algorithm_names, client_class

REL = 1e-4  # the final weights, each file of arrays, each client's state and the logged figures, relative
UPDATE_REL = 0.02  # the final weights' difference relative to how far the 3 rounds moved them
ENGINES = {"loop": {"engine": "cohort", "cohorts": 2, "cohort-step": "loop"},  # cohort 0: clients 0 and 2
           "vmap": {"engine": "cohort", "cohorts": 2, "cohort-step": "vmap"}}
CASES = {name: s for name, s in {**golden.CASES, **golden.RESUME_CASES}.items()
         if client_class(s["strategy"]).vectorised}


def federation(settings: dict, engine: str, out: Path, rounds: int = 3) -> dict:
    """3 rounds of a golden case at lr 0.01: the final global arrays, the data files (checkpoint and
    client states included) and the metric and round lines without timing."""
    torch.set_num_threads(1)
    settings = dict(settings)
    lr = 0.01 * settings.pop("lr-scale", 1.0)
    cfg = golden.case_config({"model": "cnn-small", **settings, "lr": lr, "num-rounds": 3, **ENGINES[engine]})
    final = golden.federate(cfg, out, rounds)
    files = {}
    for name in (*golden.DATA_FILES, "checkpoint.npz"):
        if (out / name).exists():
            with np.load(out / name) as data:
                files[name] = {k: data[k] for k in data.files if k != "__header__"}  # the header holds the config
    for key in [k for k in files.get("checkpoint.npz", {}) if k.startswith("client-state/")]:
        files[key] = codec.decode(files["checkpoint.npz"].pop(key))  # a client's own state (SCAFFOLD's c_i, ...)
    return {"global": golden.global_arrays(final), "files": files,
            "metrics": golden.lines_without_timing(out / "metrics.jsonl"),
            "rounds": golden.lines_without_timing(out / "rounds.jsonl")}


def update_difference(got: list[np.ndarray], want: list[np.ndarray], start: list[np.ndarray]) -> float:
    """||got - want|| over how far training moved the weights, ||want - start||."""
    flat = [np.concatenate([np.ravel(x).astype(np.float64) for x in arrays]) for arrays in (got, want, start)]
    return float(np.linalg.norm(flat[0] - flat[1]) / np.linalg.norm(flat[1] - flat[2]))


def relative_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    flat_a = np.concatenate([np.ravel(x).astype(np.float64) for x in a])
    flat_b = np.concatenate([np.ravel(x).astype(np.float64) for x in b])
    return float(np.linalg.norm(flat_a - flat_b) / max(np.linalg.norm(flat_a), 1e-12))


def close_lines(got, want, path=""):
    """Equal structure and non-floats; floats within REL (accuracies may flip one sample at a tie)."""
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), f"{path}: keys {sorted(got)} vs {sorted(want)}"
        for k in want:
            close_lines(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            close_lines(g, w, f"{path}[{i}]")
    elif isinstance(want, float) and isinstance(got, float):
        tol = 0.02 if "acc" in path else 1e-5
        assert math.isclose(got, want, rel_tol=REL, abs_tol=tol), f"{path}: {got!r} vs {want!r}"
    else:
        assert got == want, f"{path}: {got!r} vs {want!r}"


def float_groups(run: dict) -> dict[str, list[np.ndarray]]:
    """Each file's float arrays (a client's own state is a file of its own), rng states aside."""
    groups = {file: [a for key, a in sorted(arrays.items()) if a.dtype.kind == "f" and not key.startswith("rng/")]
              for file, arrays in run["files"].items()}
    return {file: arrays for file, arrays in groups.items() if arrays}


def exact_arrays(run: dict) -> dict[str, np.ndarray]:
    return {f"{file}:{key}": a for file, arrays in run["files"].items() for key, a in arrays.items()
            if a.dtype.kind != "f" or key.startswith("rng/")}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_vmapped_cohort_trains_as_the_loop_does(name, tmp_path):
    settings = CASES[name]
    start = federation(settings, "loop", tmp_path / "start", rounds=0)["global"]
    loop = federation(settings, "loop", tmp_path / "loop")
    vmap = federation(settings, "vmap", tmp_path / "vmap")
    assert relative_difference(vmap["global"], loop["global"]) < REL
    assert update_difference(vmap["global"], loop["global"], start) < UPDATE_REL
    groups, want = float_groups(vmap), float_groups(loop)
    assert sorted(groups) == sorted(want)
    for file in want:  # the data files, the checkpoint and each client's own state (SCAFFOLD's c_i, ...)
        assert relative_difference(groups[file], want[file]) < REL, file
    got, want = exact_arrays(vmap), exact_arrays(loop)
    assert sorted(got) == sorted(want)
    for key in want:  # partitions, pseudo-data, the checkpoint's rng states
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    close_lines(vmap["rounds"], loop["rounds"], "rounds")
    close_lines(vmap["metrics"], loop["metrics"], "metrics")


def test_the_comparison_sees_a_change_of_the_training(tmp_path):
    """A tolerance that can fail: lr scaled by 1.05 moves FedBR's update by more than it allows."""
    cfg = {**golden.CASES["fedbr"]}
    start = federation(cfg, "loop", tmp_path / "start", rounds=0)["global"]
    a = federation(cfg, "loop", tmp_path / "a")["global"]
    b = federation({**cfg, "lr-scale": 1.05}, "loop", tmp_path / "b")["global"]
    assert update_difference(b, a, start) > UPDATE_REL


def test_every_built_in_algorithm_is_vectorised():
    assert all(client_class(name).vectorised for name in algorithm_names())


def test_cohort_step_vmap_is_refused_where_it_cannot_apply(monkeypatch):
    with pytest.raises(ConfigError, match="needs engine=cohort"):
        validate({"cohort-step": "vmap"})
    validate({"strategy": "moon", "engine": "cohort", "cohort-step": "vmap"})
    monkeypatch.setattr(client_class("moon"), "vectorised", False)  # an algorithm whose step is a plain LocalStep
    with pytest.raises(ConfigError, match="'moon' has no vectorised local step"):
        validate({"strategy": "moon", "engine": "cohort", "cohort-step": "vmap"})
    validate({"strategy": "moon", "engine": "cohort", "cohort-step": "auto"})  # auto falls back to the loop


def test_auto_vmaps_on_a_gpu_only():
    from fedbr_flwr.node import build_client

    from flwr.common import RecordDict

    run_config = {"num-clients": 4, "engine": "cohort", "cohorts": 2, "device": "cpu", "local-steps": 1,
                  "batch-size": 4}
    node = {"partition-id": 0, "num-partitions": 2}
    assert not build_client(run_config, node, RecordDict()).vectorised  # auto on a CPU: the loop
    assert build_client({**run_config, "cohort-step": "vmap"}, node, RecordDict()).vectorised


def test_members_are_evaluated_at_once_as_each_alone_with_its_own_state_and_test_set():
    """Two members with different weights and test sets of different lengths (the shorter one padded and
    masked), in chunks smaller than the sets: the same loss and accuracy as evaluating each alone."""
    from fedbr_flwr.model import build_model
    from fedbr_flwr.training import evaluate
    from fedbr_flwr.vectorised import evaluate_members, load_module_state, module_state

    torch.manual_seed(0)
    model = build_model("cnn-small", 10, 1, 28)
    states = [module_state(model), {k: v + 0.05 * torch.randn_like(v) for k, v in module_state(model).items()}]
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, 1, 28, 28, generator=g) for n in (5, 9)]
    ys = [torch.randint(0, 10, (n,), generator=g) for n in (5, 9)]
    together = evaluate_members(model, states, xs, ys, batch_size=4)
    for state, x, y, (loss, acc) in zip(states, xs, ys, together):
        load_module_state(model, state)
        alone_loss, alone_acc = evaluate(model, x, y)
        assert loss == pytest.approx(alone_loss, rel=1e-5) and acc == alone_acc
    assert together[0] != together[1]
