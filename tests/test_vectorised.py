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
           "vmap": {"engine": "cohort", "cohorts": 2, "cohort-step": "vmap"},
           "graph": {"engine": "cohort", "cohorts": 2, "cohort-step": "graph"}}  # on CUDA only
CASES = {name: s for name, s in {**golden.CASES, **golden.RESUME_CASES}.items()
         if client_class(s["strategy"]).vectorised}
CASES["fedbr-momentum-decay"] = {"strategy": "fedbr", "momentum": 0.9, "weight-decay": 1e-3}  # the head's SGD in vmap


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


def replay_eagerly(run):
    """``cuda_graph``'s stand-in on a CPU: the first run, and "replays" that run the step again on the same
    input buffers."""
    return run(), run


GRAPH_CASES = {name: CASES[name] for name in ("fedbr", "fedbr-momentum-decay", "fedbr-mixture", "fedbr+fedcm",
                                              "fedbr+mixup", "scaffold", "moon", "dann", "vhl",
                                              "distrans-alternating-auto", "fedmix")}
GRAPH_CASES["fedbr-bf16"] = {**CASES["fedbr"], "precision": "bf16"}


@pytest.mark.parametrize("name", sorted(GRAPH_CASES))
def test_a_replayed_step_on_fixed_input_buffers_trains_as_the_vmapped_step(name, tmp_path, monkeypatch):
    """cohort-step=graph's bookkeeping, without CUDA: the first step on the input buffers, the others after
    copying their own draws into them (MOON's constants, SCAFFOLD's and FedCM's adjustments, FedBR's two
    phases with the head's momentum, DisTrans' alternation), bit for bit what cohort-step=vmap computes."""
    import functools

    from fedbr_flwr import node, vectorised

    settings = {**GRAPH_CASES[name], "local-steps": 3}
    want = federation(settings, "vmap", tmp_path / "vmap")
    monkeypatch.setattr(vectorised, "cuda_graph", replay_eagerly)
    monkeypatch.setattr(node.CohortClient, "fit_together",
                        functools.partialmethod(node.CohortClient.fit_together, graph=True))
    got = federation(settings, "vmap", tmp_path / "replayed")
    for a, b in zip(got["global"], want["global"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert got["metrics"] == want["metrics"] and got["rounds"] == want["rounds"]


def test_fedbr_computes_its_features_once_a_step_under_vmap(tmp_path, monkeypatch):
    """FedBR's max and min steps share one feature forward (``shares_prepare``), as on the per-client path."""
    from clients.fedbr import FedBRStep
    from fedbr_flwr import vectorised

    calls = []
    original = FedBRStep.prepare
    monkeypatch.setattr(FedBRStep, "prepare", lambda self, *a: calls.append(1) or original(self, *a))
    federation({**CASES["fedbr"], "local-steps": 3}, "vmap", tmp_path / "shared", rounds=1)
    assert len(calls) == 3 * 2  # 3 steps, each once per cohort (2 cohorts)
    calls.clear()
    monkeypatch.setattr(vectorised, "shares_prepare", lambda step: False)
    federation({**CASES["fedbr"], "local-steps": 3}, "vmap", tmp_path / "per-phase", rounds=1)
    assert len(calls) == 3 * 2 * 2  # once per phase


def test_the_functional_sgd_is_torchs():
    from fedbr_flwr.vectorised import sgd_values

    torch.manual_seed(0)
    for hyper in ({"momentum": 0.0, "weight_decay": 0.0, "nesterov": False},
                  {"momentum": 0.9, "weight_decay": 1e-2, "nesterov": False},
                  {"momentum": 0.9, "weight_decay": 0.0, "nesterov": True}):
        p = torch.randn(5, requires_grad=True)
        optimizer = torch.optim.SGD([p], lr=0.1, dampening=0.0, **hyper)
        values, buffers = {"p": p.detach().clone()}, None
        for _ in range(3):
            g = torch.randn(5)
            p.grad = g.clone()
            optimizer.step()
            values, buffers = sgd_values(values, {"p": g}, buffers,
                                         {**optimizer.param_groups[0]})
            buffers = buffers or None
            torch.testing.assert_close(values["p"], p.detach(), rtol=1e-6, atol=1e-7)


def test_a_step_input_that_changes_shape_stops_a_captured_step():
    from fedbr_flwr.vectorised import copy_inputs

    buffers = {"x": torch.zeros(2, 4, 3)}
    copy_inputs(buffers, {"x": torch.ones(2, 4, 3)})
    assert buffers["x"].eq(1).all()
    with pytest.raises(RuntimeError, match="'x' changed from \\(2, 4, 3\\)"):
        copy_inputs(buffers, {"x": torch.ones(2, 1, 3)})  # copy_ would broadcast it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", ("fedbr", "fedbr-momentum-decay", "fedbr-bf16", "scaffold",
                                  "distrans-alternating-auto"))
def test_the_cuda_graph_step_trains_as_the_vmapped_step(name, tmp_path):
    settings = {**GRAPH_CASES[name], "local-steps": 3, "device": "cuda"}
    start = federation(settings, "vmap", tmp_path / "start", rounds=0)["global"]
    vmap = federation(settings, "vmap", tmp_path / "vmap")
    graph = federation(settings, "graph", tmp_path / "graph")
    assert relative_difference(graph["global"], vmap["global"]) < REL
    assert update_difference(graph["global"], vmap["global"], start) < UPDATE_REL
    close_lines(graph["metrics"], vmap["metrics"], "metrics")


def test_bf16_runs_a_vmapped_convolution_in_bf16():
    """Autocast does not reach a convolution under vmap (it stays fp32, bit for bit); precision=bf16 on the
    vectorised path casts the modules instead, which gives each member's bf16 convolution to bf16 rounding."""
    from torch import nn

    from fedbr_flwr.algorithm import call, modules_in
    from fedbr_flwr.vectorised import stacked

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 16, 3)
    states = [{k: v.detach() * scale for k, v in conv.named_parameters()} for scale in (1.0, 1.1)]
    x = torch.randn(2, 8, 3, 16, 16)
    forward = torch.func.vmap(lambda p, x: call(conv, p, "", x))
    fp32 = forward(stacked(states), x)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # (torch 2.14: vmapped under autocast, it equals fp32)
        each = torch.stack([torch.func.functional_call(conv, s, (x[i],)).float() for i, s in enumerate(states)])
    with modules_in(torch.bfloat16):
        cast = forward(stacked(states), x)
    assert cast.dtype == torch.float32
    rounding = (each - fp32).abs().mean()
    assert (cast - fp32).abs().mean() > 0.3 * rounding and (cast - each).abs().mean() < rounding


def test_bf16_vmapped_training_stays_near_fp32(tmp_path):
    start = federation(CASES["fedbr"], "vmap", tmp_path / "start", rounds=0)["global"]
    fp32 = federation(CASES["fedbr"], "vmap", tmp_path / "fp32")["global"]
    bf16 = federation({**CASES["fedbr"], "precision": "bf16"}, "vmap", tmp_path / "bf16")["global"]
    assert 1e-4 < update_difference(bf16, fp32, start) < 0.1  # measured: 0.04


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
    with pytest.raises(ConfigError, match="cohort-step=graph steps the clients of a cohort together"):
        validate({"cohort-step": "graph", "device": "cuda"})
    with pytest.raises(ConfigError, match="cohort-step=graph replays CUDA graphs: it needs device=cuda"):
        validate({"engine": "cohort", "cohort-step": "graph", "device": "cpu"})


def test_auto_vmaps_on_a_gpu_only():
    from fedbr_flwr.node import build_client

    from flwr.common import RecordDict

    run_config = {"num-clients": 4, "engine": "cohort", "cohorts": 2, "device": "cpu", "local-steps": 1,
                  "batch-size": 4}
    node = {"partition-id": 0, "num-partitions": 2}
    assert not build_client(run_config, node, RecordDict()).vectorised  # auto on a CPU: the loop
    assert build_client({**run_config, "cohort-step": "vmap"}, node, RecordDict()).vectorised
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="cohort-step=graph replays CUDA graphs, but this cohort's device is cpu"):
            build_client({**run_config, "device": "auto", "cohort-step": "graph"}, node, RecordDict())


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


def packed_members(augment: bool = False):
    """Three members with partitions of 5, 11 and 2 images, packed; each member's data as loaded, too."""
    from fedbr_flwr.dataset import ClientData, pack_partitions

    g = torch.Generator().manual_seed(0)
    loaded = {pid: ClientData(pid, torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g),
                              torch.randn(2, 3, 8, 8, generator=g), torch.randint(0, 10, (2,), generator=g),
                              10, augment, (-1.0, -2.0, -3.0))
              for pid, n in ((4, 5), (7, 11), (9, 2))}
    members, packed = pack_partitions(loaded, "cpu")
    return loaded, members, packed


def test_packed_partitions_hold_every_members_rows_once_and_members_view_them():
    loaded, members, packed = packed_members()
    assert packed.offsets == {4: 0, 7: 5, 9: 16} and len(packed.y) == 18
    for pid, data in members.items():
        assert torch.equal(data.x_train, loaded[pid].x_train) and torch.equal(data.y_train, loaded[pid].y_train)
        assert data.x_train.data_ptr() == packed.x[packed.offsets[pid]].data_ptr()  # a view, not a copy
        assert data.y_train.data_ptr() == packed.y[packed.offsets[pid]].data_ptr()
        assert torch.equal(data.x_test, loaded[pid].x_test)


@pytest.mark.parametrize("augment", [False, True], ids=["plain", "crop-flip"])
def test_packed_batches_are_each_members_own_stream(augment):
    """One gather for all members gives, step after step, bit for bit the batches each member's own sampler
    draws alone (with CIFAR's crop and flip, which draw from the same stream after the indices)."""
    from fedbr_flwr.training import BatchSampler
    from fedbr_flwr.vectorised import PackedBatches

    _, members, packed = packed_members(augment)
    alone = [BatchSampler(data, 4, seed=pid) for pid, data in members.items()]
    together = PackedBatches([BatchSampler(data, 4, seed=pid) for pid, data in members.items()],
                             list(packed.offsets.values()), packed.x, packed.y)
    for _ in range(3):
        x, y = together()
        for i, sampler in enumerate(alone):
            own_x, own_y = sampler()
            assert torch.equal(x[i], own_x) and torch.equal(y[i], own_y)


def test_a_batch_stream_off_the_packed_partitions_is_refused():
    from fedbr_flwr.training import BatchSampler
    from fedbr_flwr.vectorised import PackedBatches

    loaded, _, packed = packed_members()
    with pytest.raises(ValueError, match="does not read the packed partitions at row 5"):
        PackedBatches([BatchSampler(loaded[7], 4, seed=0)], [5], packed.x, packed.y)


def test_draws_are_stacked_only_where_not_stacked_already():
    """A member's value that is its slice of the gathered batch, or the tensor it gave the step before, is
    taken as it stands (no copy); a new tensor is stacked."""
    from fedbr_flwr.vectorised import DrawStacker

    stack = DrawStacker()
    fixed = [torch.full((2,), float(i)) for i in range(3)]
    for step in range(2):
        x, y = torch.randn(3, 4, 2), torch.randint(0, 9, (3, 4))
        fresh = [torch.randn(2) for _ in range(3)]
        draws = [{"x": xi, "y": yi, "fixed": f, "fresh": n} for (xi, yi), f, n in zip(stack.split(x, y), fixed, fresh)]
        inputs = stack(draws)
        assert inputs["x"] is x and inputs["y"] is y
        assert torch.equal(inputs["fresh"], torch.stack(fresh)) and torch.equal(inputs["fixed"], torch.stack(fixed))
        if step == 0:
            first_fixed = inputs["fixed"]
    assert inputs["fixed"] is first_fixed  # the second step's fixed values: the first step's stack
    stack.split(x, y)
    mixed = stack([{"x": torch.zeros(4, 2)} for _ in range(3)])  # a draw that made its own batch
    assert mixed["x"] is not x and not mixed["x"].any()
    assert stack([{"x": x[i]} for i in range(3)])["x"] is not x  # the batch's slices only for the step it gave them


def test_a_cohorts_members_draw_a_step_with_few_operations():
    """The draws of 10 FedAvg members (each member's index draw; the indices stacked and offset; one gather each
    for the images and labels): 10 + 4 operations a step, against 3 per member and 2 stacks without packing."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from fedbr_flwr.dataset import ClientData, pack_partitions
    from fedbr_flwr.training import BatchSampler
    from fedbr_flwr.vectorised import DrawStacker, PackedBatches

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    loaded = {pid: ClientData(pid, torch.randn(20, 1, 4, 4), torch.randint(0, 10, (20,)), torch.zeros(1, 1, 4, 4),
                              torch.zeros(1, dtype=torch.long), 10, False) for pid in range(10)}
    members, packed = pack_partitions(loaded, "cpu")
    batches = PackedBatches([BatchSampler(d, 8, seed=pid) for pid, d in members.items()],
                            list(packed.offsets.values()), packed.x, packed.y)
    stack = DrawStacker()
    with Count():
        inputs = stack([{"x": xi, "y": yi} for xi, yi in stack.split(*batches())])
    assert inputs["x"].shape == (10, 8, 1, 4, 4)
    assert Count.calls <= 10 + 4 + 2  # + the two unbinds (views: no kernels)


def test_evaluation_groups_bound_the_images_of_one_forward_and_pad_little():
    from fedbr_flwr.vectorised import evaluation_groups

    lengths = [5, 900, 3, 40, 700]
    groups = evaluation_groups(lengths, batch_size=512, max_images=1000)
    assert groups == [[2, 0, 3], [4], [1]]  # by length; 700 and 900 each take a 512 chunk: 2 x 512 > 1000
    assert evaluation_groups(lengths, batch_size=512, max_images=1024) == [[2, 0, 3], [4, 1]]
    assert sorted(sum(groups, [])) == list(range(len(lengths)))
    assert evaluation_groups(lengths, batch_size=512, max_images=10**6) == [[2, 0, 3, 4, 1]]
    assert evaluation_groups(lengths, max_images=1) == [[2], [0], [3], [4], [1]]


def test_a_cohort_evaluates_its_members_in_groups_as_each_alone():
    """Six members with test sets of different lengths: in one group, one member a group, and each on its own
    (the per-client path), the same losses and accuracies, in the members' order."""
    from flwr.common import RecordDict

    from fedbr_flwr.node import build_client

    run_config = {"num-clients": 6, "engine": "cohort", "cohorts": 1, "device": "cpu", "cohort-step": "vmap",
                  "model": "cnn-small", "partition": "dirichlet", "alpha": 0.5}
    cohort = build_client(run_config, {"partition-id": 0, "num-partitions": 1}, RecordDict())
    parts = [(pid, cohort.algorithm.weights(), {"server-round": 1}) for pid in cohort.members]
    assert len({len(cohort.members[pid].y_test) for pid, _, _ in parts}) > 1
    together = cohort.evaluate_together(parts)
    one_by_one = cohort.evaluate_together(parts, max_images=1)
    alone = [(pid, *cohort.member(pid).evaluate(arrays, config)) for pid, arrays, config in parts]
    for got, same, want in zip(together, one_by_one, alone):
        assert got[0] == same[0] == want[0] and got[2] == want[2]
        assert got[1] == pytest.approx(want[1], rel=1e-5) and same[1] == pytest.approx(want[1], rel=1e-5)
        assert got[3]["accuracy"] == same[3]["accuracy"] == want[3]["accuracy"]
