"""The vectorised cohort step (``cohort-step=vmap``, ``fedbr_flwr.core.vectorised``): the members'
``FunctionalStep`` functions vmapped over the members must give what the per-client loop gives, for every
strategy and combination with a vectorised step.

vmap turns the members' convolutions into one grouped convolution, which sums in another order, so the
two engines agree to float rounding, not bit for bit, and federations amplify rounding (at the golden
runs' lr 0.05 with the paper's CNN, scaling lr by 1 + 1e-6 moves FedBR's weights by 4e-4 after 3 rounds).
So the engines are compared in lockstep (``Lockstep``: every message answered both ways from the same
inputs), with the small CNN at lr 0.01; free-running 3-round federations (``federation``) remain for the
bf16 and captured-step comparisons."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedbr_flwr.app import cohort, payload
from fedbr_flwr.core.algorithm import client_class
from fedbr_flwr.core.config import ConfigError, validate
from fedbr_flwr.core.registry import algorithm_names

import golden
from fakes import FixedClientManager, InProcessProxy, bare_fit_config, run_rounds

REL = 1e-4  # the final weights and the logged figures, relative
UPDATE_REL = 0.02  # the final weights' difference relative to how far the 3 rounds moved them
ENGINES = {
    "loop": {"engine": "cohort", "cohorts": 2, "cohort-step": "loop"},  # cohort 0: clients 0 and 2
    "vmap": {"engine": "cohort", "cohorts": 2, "cohort-step": "vmap"},
    "graph": {"engine": "cohort", "cohorts": 2, "cohort-step": "graph"},
}  # on CUDA only
CASES = {
    name: s for name, s in {**golden.CASES, **golden.RESUME_CASES}.items() if client_class(s["strategy"]).vectorised
}
CASES["fedbr-momentum-decay"] = {"strategy": "fedbr", "momentum": 0.9, "weight-decay": 1e-3}  # the head's SGD in vmap


def federation(settings: dict, engine: str, out: Path, rounds: int = 3) -> dict:
    """3 rounds of a golden case at lr 0.01: the final global arrays and the metric and round lines without
    timing."""
    torch.set_num_threads(1)
    settings = dict(settings)
    lr = 0.01 * settings.pop("lr-scale", 1.0)
    cfg = golden.case_config({"model": "cnn-small", **settings, "lr": lr, "num-rounds": 3, **ENGINES[engine]})
    final = golden.federate(cfg, out, rounds)
    return {
        "global": golden.global_arrays(final),
        "metrics": golden.lines_without_timing(out / "metrics.jsonl"),
        "rounds": golden.lines_without_timing(out / "rounds.jsonl"),
    }


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


# ---------------------------------------------------------------- the engines in lockstep


# A member's fit, loop vs vmap: ||difference|| / how far the fit moved its arrays. Typically 1e-9 to 7e-6; a
# ReLU that flips on rounding makes a rare fit differ by up to 1e-3, which the loop alone shows too when its
# convolutions sum in another order (2 threads against 1). So every fit must stay under STEP_REL_ANY and
# nearly all under STEP_REL: a drift of the vectorised step (its lr 2e-4 larger) moves every fit past it.
STEP_REL, STEP_REL_ANY, RARE = 1e-4, 3e-3, 0.15
NOT_COMPARED_METRICS = ("fit-seconds", "peak-rss-mb", "peak-gpu-mb")
LOCKSTEP = {"engine": "cohort", "cohorts": 1, "cohort-step": "loop", "local-steps": 3}  # 3 or more members


class Lockstep(InProcessProxy):
    """A cohort node whose every message is answered twice from the same arrays, config and node state: by
    the vectorised cohort (``fit_together``, ``evaluate_together``) and by the loop (each member on its own).
    The two answers and the node states they leave must agree; the loop's go on, so that the engines are
    compared round after round from identical inputs, and a difference cannot grow or hide."""

    def __init__(self, client, cid, ratios: list):
        super().__init__(client, cid)
        self.ratios = ratios  # each member's fit: its difference relative to its move

    def twice(self, method: str, parameters, config):
        from flwr.common import parameters_to_ndarrays

        arrays = parameters_to_ndarrays(parameters)
        records = copy.deepcopy(self.client.records)
        self.client.vectorised = True
        together = getattr(self.client, method)(arrays, config)
        state_together = self.client.records
        self.client.use_state(records)
        self.client.vectorised = False
        alone = getattr(self.client, method)(arrays, config)
        assert_same_state(state_together, self.client.records)
        return together, alone

    def fit(self, ins, timeout, group_id):
        from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

        (got, n_got, metrics_got), (want, n_want, metrics_want) = self.twice("fit", ins.parameters, ins.config)
        sent = payload.from_parameters(ins.parameters)
        got, want = payload.from_list(got), payload.from_list(want)
        assert n_got == n_want and list(got) == list(want)
        for member in cohort.members_of(ins.config):  # each member's arrays together, and its offset alone
            prefix = cohort.member_key(member, "")
            names = [n for n in want if n.startswith(prefix)]
            for group in (names, [n for n in names if "offset" in n]):
                if group:
                    self.compare(group, got, want, {n: sent.get(n, sent.get(n[len(prefix) :])) for n in group})
        close_lines(without_timing(metrics_got), without_timing(metrics_want), "fit metrics")
        close_lines(without_timing(metrics_got), without_timing(metrics_want), "fit metrics")
        return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(payload.to_list(want)), n_want, metrics_want)

    def compare(self, names: list[str], got: dict, want: dict, start: dict) -> None:
        """The arrays ``names`` of one member: ||vmap - loop|| against how far the loop's fit moved them (from
        what the server sent to all or to this member, such as DisTrans' offset with agg avg or nn; an array it
        did not send, such as SCAFFOLD's change of c_i, from zero)."""
        flat = [
            np.concatenate([np.ravel(arrays[n]).astype(np.float64) for n in names])
            for arrays in (got, want, {n: start[n] if start[n] is not None else 0 * want[n] for n in names})
        ]
        difference, moved = np.linalg.norm(flat[0] - flat[1]), np.linalg.norm(flat[1] - flat[2])
        self.ratios.append(difference / max(moved, 1e-30))
        assert difference <= STEP_REL_ANY * moved + 1e-12, (
            f"{names[0]} (+{len(names) - 1}): {difference:.3g} against a move of {moved:.3g}"
        )

    def evaluate(self, ins, timeout, group_id):
        from flwr.common import Code, EvaluateRes, Status

        (loss_got, n_got, metrics_got), (loss, n, metrics) = self.twice("evaluate", ins.parameters, ins.config)
        assert n_got == n and loss_got == pytest.approx(loss, rel=1e-5)
        close_lines(metrics_got, metrics, "evaluate metrics")
        return EvaluateRes(Status(Code.OK, ""), loss, n, metrics)


def without_timing(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith(NOT_COMPARED_METRICS)}


def assert_same_state(got, want) -> None:
    """The node states both engines leave (MOON's previous model, SCAFFOLD's c_i, DisTrans' offset, ...)."""
    assert sorted(got) == sorted(want)
    for key in want:
        record, record_got = dict(want[key]), dict(got[key])
        assert sorted(record_got) == sorted(record), key
        for name, value in record.items():
            if hasattr(value, "numpy"):
                a, b = record_got[name].numpy().astype(np.float64), value.numpy().astype(np.float64)
                assert np.linalg.norm(a - b) <= STEP_REL_ANY * np.linalg.norm(b) + 1e-12, f"state {key}/{name}"
            else:
                assert record_got[name] == value, f"state {key}/{name}"


def lockstep_federation(settings: dict, out: Path) -> None:
    """A golden case's federation (resumed after round 2, for the resume cases) at lr 0.01 over one cohort of
    all the clients, every message answered by both engines (``Lockstep``); nearly every fit must agree to
    STEP_REL."""
    torch.set_num_threads(1)
    settings = dict(settings)
    lr = 0.01 * settings.pop("lr-scale", 1.0)
    resumed = settings.pop("resume-case", False)
    ratios: list[float] = []
    cfg = golden.case_config(
        {"model": "cnn-small", **settings, "lr": lr, **LOCKSTEP, **({"num-rounds": 4} if resumed else {})}
    )

    def run(cfg, rounds):
        strategy, _ = golden.build_server(cfg, out)
        proxies = [
            Lockstep(client, f"node-{1000 + pid}", ratios) for pid, client in enumerate(golden.build_clients(cfg))
        ]
        run_rounds(strategy, proxies, rounds, FixedClientManager(proxies), strategy.initialize_parameters(None))

    run(cfg, 3)
    if resumed:
        run({**cfg, "resume": True}, 2)
    above = [r for r in ratios if r > STEP_REL]
    assert ratios and len(above) <= RARE * len(ratios), (
        f"{len(above)} of {len(ratios)} fits differ by more "
        f"than {STEP_REL} of their move: {', '.join(f'{r:.2g}' for r in above)}"
    )


LOCKSTEP_CASES = {
    **{name: s for name, s in golden.CASES.items() if client_class(s["strategy"]).vectorised},
    **{
        name: {**s, "resume-case": True}
        for name, s in golden.RESUME_CASES.items()
        if client_class(s["strategy"]).vectorised
    },
    "fedbr-momentum-decay": {"strategy": "fedbr", "momentum": 0.9, "weight-decay": 1e-3},
    "scaffold-momentum": {"strategy": "scaffold", "momentum": 0.9},
    "dann-momentum": {"strategy": "dann", "momentum": 0.9},
    "distrans-nn-momentum": {"strategy": "distrans", "distrans-agg": "nn", "momentum": 0.9},
    "distrans-alternating-momentum": {
        "strategy": "distrans",
        "distrans-update": "alternating",
        "distrans-agg": "none",
        "momentum": 0.9,
    },
    "fedbr+fedprox": {"strategy": "fedbr", "fedbr-with": "fedprox"},
    "fedbr+several": {"strategy": "fedbr", "fedbr-with": "fedprox,fedcm,feddecorr,fedntd,mixup", "momentum": 0.9},
    "fedbr-mixture+several": {"strategy": "fedbr", "pseudo-data": "mixture", "fedbr-with": "fedcm,mixup"},
    "groupdro-cross-entropy": {"strategy": "groupdro", "groupdro-mixup": False},
    "moon-partial": {"strategy": "moon", "fraction-fit": 0.5, "num-clients": 4},
    "fedbr-six-members": {"strategy": "fedbr", "num-clients": 6, "fraction-fit": 0.67},
    "fedbr-lenet": {"strategy": "fedbr", "model": "lenet"},
    "moon-lenet": {"strategy": "moon", "model": "lenet"},
    # each member's gradient clipped on its own: per phase (DANN's two), and inside FedBR's shared-prepare step
    "feddyn-clipped": {"strategy": "feddyn", "feddyn-alpha": 0.1, "clip-grad-norm": 0.05, "partition": "dirichlet"},
    "fedbr-clipped": {"strategy": "fedbr", "clip-grad-norm": 0.05},
    "dann-clipped": {"strategy": "dann", "clip-grad-norm": 0.05},
}


@pytest.mark.parametrize("name", sorted(LOCKSTEP_CASES))
def test_the_vmapped_cohort_answers_every_message_as_the_loop_does(name, tmp_path):
    lockstep_federation(LOCKSTEP_CASES[name], tmp_path)


def test_lockstep_sees_a_vmapped_step_that_drifts_from_the_loop(tmp_path, monkeypatch):
    """A tolerance that can fail: the vectorised step's lr 2e-4 larger than the loop's, on every fit."""
    from fedbr_flwr.core import vectorised

    sgd_like = vectorised.sgd_like

    def drifting(optimizer, tensors):
        drifted = sgd_like(optimizer, tensors)
        drifted.param_groups[0]["lr"] *= 1.0002
        return drifted

    monkeypatch.setattr(vectorised, "sgd_like", drifting)
    with pytest.raises(AssertionError, match="9 of 9 fits differ by more than 0.0001 of their move"):
        lockstep_federation(LOCKSTEP_CASES["fedavg"], tmp_path)


def cohort_of(settings: dict, members: int = 3, phase_index: int = 0):
    """A vectorised cohort of ``members`` clients on this CPU, and each member's step for round 1 from the same
    global weights, each taken right after that member's ``start_fit`` (the members share the live modules)
    with its own gradients of one phase (at the round's start values) on its own first batch."""
    from flwr.common import RecordDict

    from fedbr_flwr.app.node import build_client
    from fedbr_flwr.core.vectorised import Member, snapshot

    cfg = {
        "num-clients": members,
        "engine": "cohort",
        "cohorts": 1,
        "cohort-step": "vmap",
        "device": "cpu",
        "batch-size": 4,
        "local-steps": 2,
        **settings,
    }
    cohort = build_client(cfg, {"partition-id": 0, "num-partitions": 1}, RecordDict())
    weights = cohort.algorithm.weights()
    fit_config = bare_fit_config(validate(cfg), {pid: copy.copy(cohort.member(pid)) for pid in cohort.members})
    steps, own, draws = [], [], []
    for pid in cohort.members:
        algorithm = copy.copy(cohort.member(pid))
        algorithm.components = algorithm.build_components()
        step, sampler = algorithm.start_fit(weights, fit_config(1))  # FedBR: with its pseudo-data
        inputs = step.step_inputs(*sampler())
        phase = step.phases[phase_index]
        loss, _ = phase.loss(step.groups, inputs, step.prepare(step.groups, inputs))
        tensors = [p for g in phase.groups for p in step.groups[g].values()]
        own.append(torch.autograd.grad(-loss if phase.ascent else loss, tensors))
        steps.append(Member(step, sampler, snapshot(step)))
        draws.append(inputs)
    return steps, own, draws


def vmapped_phase_gradients(members, draws, phase_index: int = 0):
    from fedbr_flwr.core.vectorised import phase_gradients, stacked

    template = members[0].step
    phase = template.phases[phase_index]
    grads, _ = phase_gradients(template, phase, stacked([m.start for m in members]), stacked(draws))
    return [[grads[g][n][i] for g in phase.groups for n in grads[g]] for i in range(len(members))]


@pytest.mark.parametrize("model", ["cnn-small", "lenet"])
@pytest.mark.parametrize("update", ["simultaneous", "alternating"])
def test_the_vmapped_offset_gradient_is_each_members_own(update, model):
    """DisTrans: each member's gradient on its own offset, under vmap, is the one its own autograd gives (an
    offset moves by ~1e-7 of the model's weights a round: a dropped or shared offset gradient would hide
    under any whole-model tolerance)."""
    members, own, draws = cohort_of(
        {"strategy": "distrans", "model": model, "distrans-agg": "none", "distrans-update": update}
    )
    offsets = [m.start["offset"]["t"] for m in members]
    assert not torch.equal(offsets[0], offsets[1])  # each member has its own offset
    for got, want in zip(vmapped_phase_gradients(members, draws), own):
        offset_got, offset_want = got[-1], want[-1]  # the offset group comes last (simultaneous) or alone
        assert offset_want.abs().sum() > 0 and offset_got.shape == offset_want.shape
        torch.testing.assert_close(offset_got, offset_want, rtol=1e-4, atol=1e-6 * offset_want.abs().max().item())
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6 * b.abs().max().item())


def tiny_backbone(name: str, num_classes: int, in_channels: int, image_size: int):
    """The backbones' own classes at tiny sizes, for 8x8 images: VGG11's layout at 1/8 of its widths with
    three of its five poolings, CCT of 2 layers of width 16, ResNet18-GN, the paper's CNN and the lenet as
    they are."""
    from fedbr_flwr.core import model

    if name == "vgg11":
        pools = [i for i, c in enumerate(model.VGG11_LAYOUT) if c == "M"][-2:]  # 8x8 images: three poolings
        layout = [c if c == "M" else c // 8 for i, c in enumerate(model.VGG11_LAYOUT) if i not in pools]
        return model.SplitModel(model.vgg11_features(in_channels, layout), 64, num_classes)
    if name == "cct":
        return model.SplitModel(model.CCTFeatures(in_channels, 8, dim=16, layers=2, heads=2), 16, num_classes)
    return model.build_model(name, num_classes, in_channels, 8)


@pytest.mark.parametrize("backbone", ["cnn", "lenet", "lenet-nonorm", "vgg11", "resnet18", "cct"])
@pytest.mark.parametrize("strategy", ["fedavg", "fedbr"])
def test_every_backbone_trains_under_vmap_as_each_member_alone(backbone, strategy, monkeypatch):
    """Beyond cnn-small (which the lockstep federations cover): the paper's CNN, VGG11, ResNet18-GN and CCT
    under vmap, at tiny sizes on 8x8 images, for FedAvg's phase and FedBR's two: every member's gradients,
    computed for all members at once, equal those of its own autograd."""
    import dataclasses

    from fedbr_flwr.app import node
    from fedbr_flwr.core import algorithm
    from fedbr_flwr.data import dataset
    from strategies import fedbr as fedbr_server

    def small_images(cfg, members, device):
        loaded, packed = load_cohort_data(cfg, members, device)

        def shrink(x):
            return torch.nn.functional.interpolate(x, size=(8, 8), mode="bilinear", align_corners=False)

        shrunk = {
            pid: dataclasses.replace(d, x_train=shrink(d.x_train).contiguous(), x_test=shrink(d.x_test))
            for pid, d in loaded.items()
        }
        return dataset.pack_partitions(shrunk, device)

    load_cohort_data = dataset.load_cohort_data
    monkeypatch.setattr(dataset, "load_cohort_data", small_images)
    monkeypatch.setattr(algorithm, "build_model", lambda name, *a: tiny_backbone(backbone, *a))
    monkeypatch.setattr(node, "cohort_members", lambda cfg, cohort_id, n: list(range(cfg["num-clients"])))
    # FedBR's server (bare_fit_config builds the pseudo-data with it) checks the clients' means against the
    # dataset's 28x28 images: these are shrunk to 8x8
    monkeypatch.setattr(fedbr_server, "images_problem", lambda *args: None)
    settings = {"strategy": strategy, "model": "cnn", "lr": 0.01}
    for phase_index in range(2 if strategy == "fedbr" else 1):  # FedBR: the max step on the head, the min step
        members, own, draws = cohort_of(settings, phase_index=phase_index)
        for got, want in zip(vmapped_phase_gradients(members, draws, phase_index), own):
            got, want = torch.cat([a.flatten() for a in got]), torch.cat([b.flatten() for b in want])
            # measured: 1e-8 to 2e-6 (CCT's pooling bias has a zero gradient, rounding only: hence norms);
            # VGG's head gradient at round 1 is itself rounding (1e-7), so it is held to that scale. The
            # initial weights come from torch's RNG, which conftest seeds: at 1 seed in 8 (ResNet18, FedBR's
            # min step) an input of a ReLU lies within rounding of 0, the two summation orders take its two
            # sides, and the gradients part by 2e-4 to 8e-3 (with GELU for ReLU, at most 2e-6)
            assert (got - want).norm() <= 1e-4 * want.norm() + 1e-6


def replay_eagerly(run):
    """``cuda_graph``'s stand-in on a CPU: the first run, and "replays" that run the step again on the same
    input buffers."""
    return run(), run


GRAPH_CASES = {
    name: CASES[name]
    for name in (
        "fedavg",
        "fedbr",
        "fedbr-momentum-decay",
        "fedbr-mixture",
        "fedbr+fedcm",
        "fedbr+mixup",
        "scaffold",
        "moon",
        "dann",
        "vhl",
        "distrans-alternating-auto",
        "fedmix",
    )
}
GRAPH_CASES["fedbr-bf16"] = {**CASES["fedbr"], "precision": "bf16"}
GRAPH_CASES.update({f"{name}-matmul": {**CASES[name], "cohort-conv": "matmul"} for name in ("fedavg", "fedbr")})


@pytest.mark.parametrize("name", sorted(GRAPH_CASES))
def test_a_replayed_step_on_fixed_input_buffers_trains_as_the_vmapped_step(name, tmp_path, monkeypatch):
    """cohort-step=graph's bookkeeping, without CUDA: the first step on the input buffers, the others after
    copying their own draws into them (MOON's constants, SCAFFOLD's and FedCM's adjustments, FedBR's two
    phases with the head's momentum, DisTrans' alternation, the matmul convolutions), bit for bit what
    cohort-step=vmap computes."""
    import functools

    from fedbr_flwr.app import node
    from fedbr_flwr.core import vectorised

    settings = {**GRAPH_CASES[name], "local-steps": 3}
    want = federation(settings, "vmap", tmp_path / "vmap")
    monkeypatch.setattr(vectorised, "cuda_graph", replay_eagerly)
    monkeypatch.setattr(
        node.CohortClient, "fit_together", functools.partialmethod(node.CohortClient.fit_together, graph=True)
    )
    got = federation(settings, "vmap", tmp_path / "replayed")
    for a, b in zip(got["global"], want["global"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert got["metrics"] == want["metrics"] and got["rounds"] == want["rounds"]


def test_fedbr_computes_its_features_once_a_step_under_vmap(tmp_path, monkeypatch):
    """FedBR's max and min steps share one feature forward (``shares_prepare``), as on the per-client path."""
    from clients.fedbr import FedBRStep
    from fedbr_flwr.core import vectorised

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
    from fedbr_flwr.core.vectorised import sgd_values

    torch.manual_seed(0)
    for hyper in (
        {"momentum": 0.0, "weight_decay": 0.0, "nesterov": False},
        {"momentum": 0.9, "weight_decay": 1e-2, "nesterov": False},
        {"momentum": 0.9, "weight_decay": 0.0, "nesterov": True},
    ):
        p = torch.randn(5, requires_grad=True)
        optimizer = torch.optim.SGD([p], lr=0.1, dampening=0.0, **hyper)
        values, buffers = {"p": p.detach().clone()}, None
        for _ in range(3):
            g = torch.randn(5)
            p.grad = g.clone()
            optimizer.step()
            values, buffers = sgd_values(values, {"p": g}, buffers, {**optimizer.param_groups[0]})
            buffers = buffers or None
            torch.testing.assert_close(values["p"], p.detach(), rtol=1e-6, atol=1e-7)


def test_a_step_input_that_changes_shape_stops_a_captured_step():
    from fedbr_flwr.core.vectorised import copy_inputs

    buffers = {"x": torch.zeros(2, 4, 3)}
    copy_inputs(buffers, {"x": torch.ones(2, 4, 3)})
    assert buffers["x"].eq(1).all()
    with pytest.raises(RuntimeError, match="'x' changed from \\(2, 4, 3\\)"):
        copy_inputs(buffers, {"x": torch.ones(2, 1, 3)})  # copy_ would broadcast it


# the cases run on a GPU below; an algorithm among them may set graph_checked_on_gpu (cohort-step=auto: graph)
GPU_GRAPH_CASES = (
    "fedavg",
    "fedbr",
    "fedbr-momentum-decay",
    "fedbr-bf16",
    "scaffold",
    "distrans-alternating-auto",
    "fedavg-matmul",
    "fedbr-matmul",
)


def test_auto_replays_a_graph_on_a_gpu_where_the_algorithms_graph_was_checked_on_one(monkeypatch):
    from fedbr_flwr.app.node import cohort_step
    from fedbr_flwr.core.config import components_of
    from fedbr_flwr.core.registry import algorithm_names

    fedbr, moon = client_class("fedbr"), client_class("moon")
    assert cohort_step("auto", "cuda", fedbr) == "graph"
    assert cohort_step("auto", "cuda", moon) == "vmap"  # vectorised; its graph not yet run on a GPU
    assert cohort_step("auto", "cpu", fedbr) == "loop"
    assert cohort_step("vmap", "cuda", fedbr) == "vmap"
    assert cohort_step("graph", "cuda", moon) == "graph"
    monkeypatch.setattr(moon, "vectorised", False)
    assert cohort_step("auto", "cuda", moon) == "loop"
    assert cohort_step("auto", "cuda", fedbr, ("fedcm",)) == "vmap"  # a component's graph is not checked on a GPU
    assert cohort_step("auto", "cuda", client_class("groupdro")) == "vmap"  # a FedAvg subclass, not checked itself
    graphed = {
        name
        for name in algorithm_names()
        if cohort_step("auto", "cuda", client_class(name), components_of(validate({"strategy": name}))) == "graph"
    }
    # by client class, not by name: an algorithm that reuses a checked client (FedAvgM on FedAvg's) is checked too
    on_gpu = {client_class(GRAPH_CASES[case]["strategy"]) for case in GPU_GRAPH_CASES}
    assert {client_class(name) for name in graphed} == on_gpu
    assert {"fedavg", "fedbr", "scaffold", "distrans"} <= graphed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", GPU_GRAPH_CASES)
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

    from fedbr_flwr.core.algorithm import call, modules_in
    from fedbr_flwr.core.vectorised import stacked

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


@pytest.mark.parametrize("name", ["fedavg", "fedbr"])
def test_bf16_training_stays_near_fp32_on_both_paths(name, tmp_path):
    """4 local steps a round, so that steps on stale bf16 weights show (with the loop's former one autocast
    region over all steps, the loop landed 58-69% of the update from fp32); the two paths, which reach bf16
    differently, agree to bf16 rounding. Measured: 3-4% of the update each, both ways."""
    settings = {**CASES[name], "local-steps": 4}
    start = federation(settings, "loop", tmp_path / "start", rounds=0)["global"]
    runs = {
        (engine, precision): federation(
            {**settings, "precision": precision}, engine, tmp_path / f"{engine}-{precision}"
        )["global"]
        for engine in ("loop", "vmap")
        for precision in ("fp32", "bf16")
    }
    for engine in ("loop", "vmap"):
        assert 1e-3 < update_difference(runs[engine, "bf16"], runs[engine, "fp32"], start) < 0.06, engine
    assert update_difference(runs["vmap", "bf16"], runs["loop", "bf16"], start) < 0.06


def test_fedbrs_min_step_sees_the_max_steps_head_in_bf16_on_both_paths(tmp_path):
    """One local step at lr 0.5: the min step's L_con ("con") is taken with the head after the max step, so it
    differs from the max step's ("con-max") by the head's move, on the loop as on vmap. A cached bf16 copy of the
    head (one autocast region over both phases) gave the loop con == con-max; CPU autocast's bf16 cosines put
    the two paths 4e-3 apart. They agree to 5e-5 now, against a move of 3e-3."""
    settings = {**CASES["fedbr"], "local-steps": 1, "precision": "bf16", "lr-scale": 50.0}
    train = {
        engine: federation(settings, engine, tmp_path / engine, rounds=1)["rounds"][0]["train"]
        for engine in ("loop", "vmap")
    }
    move = abs(train["vmap"]["con"] - train["vmap"]["con-max"])
    assert move > 1e-3
    for name in ("con", "con-max"):
        assert abs(train["loop"][name] - train["vmap"][name]) < 0.05 * move, name


def test_the_comparison_sees_a_change_of_the_training(tmp_path):
    """A tolerance that can fail: lr scaled by 1.05 moves FedBR's update by more than it allows."""
    cfg = {**golden.CASES["fedbr"]}
    start = federation(cfg, "loop", tmp_path / "start", rounds=0)["global"]
    a = federation(cfg, "loop", tmp_path / "a")["global"]
    b = federation({**cfg, "lr-scale": 1.05}, "loop", tmp_path / "b")["global"]
    assert update_difference(b, a, start) > UPDATE_REL


def test_every_built_in_algorithm_is_vectorised():
    """The built-in algorithms, those with golden files, all run vmapped (LOCKSTEP_CASES would silently drop one
    that did not); an algorithm added with a plain LocalStep (docs/adding-an-algorithm.md) runs with
    cohort-step=loop, and this test names the built-ins only."""
    built_in = sorted({settings["strategy"] for settings in golden.CASES.values()})
    assert set(built_in) <= set(algorithm_names())
    assert [name for name in built_in if not client_class(name).vectorised] == []


@pytest.mark.parametrize("stride, bias", [(1, True), (2, False)])
def test_a_matmul_convolution_under_vmap_is_each_members_own_convolution(stride, bias):
    """cohort-conv=matmul: for each member, the output and the gradients (weights, bias, input) of the matmul
    convolution equal those of that member's own F.conv2d, to rounding; strided and without bias too."""
    from torch import nn
    from torch.nn import functional as F

    from fedbr_flwr.core.vectorised import MatmulConv2d, convolutions_as, stacked

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 3, stride=stride, padding=1, bias=bias)
    states = [{k: torch.randn_like(v) for k, v in conv.named_parameters()} for _ in range(2)]
    x = torch.randn(2, 4, 3, 9, 9)

    def loss(state, x):
        out = torch.func.functional_call(conv, state, (x,))
        return (out * out.detach().sin()).sum(), out

    def own_loss(state, x):
        out = F.conv2d(x, state["weight"], state.get("bias"), stride, 1)
        return (out * out.detach().sin()).sum(), out

    with convolutions_as("matmul", [conv]):
        assert type(conv) is MatmulConv2d
        (got_state, got_x), got_out = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1), has_aux=True))(
            stacked(states), x
        )
    assert type(conv) is nn.Conv2d
    for i, state in enumerate(states):
        (want_state, want_x), want_out = torch.func.grad(own_loss, argnums=(0, 1), has_aux=True)(state, x[i])
        assert torch.allclose(got_out[i], want_out, rtol=1e-5, atol=1e-4)  # values of order 1-10
        assert torch.allclose(got_x[i], want_x, rtol=1e-5, atol=1e-4)
        for name in want_state:
            assert torch.allclose(got_state[name][i], want_state[name], rtol=1e-5, atol=1e-4), name


def test_matmul_convolutions_are_swapped_back_after_an_error_and_an_unknown_kind_is_refused():
    from torch import nn

    from fedbr_flwr.core.vectorised import convolutions_as

    conv = nn.Conv2d(1, 2, 3)
    with pytest.raises(RuntimeError, match="boom"):
        with convolutions_as("matmul", [nn.Sequential(conv), conv]):  # the same layer twice: swapped once
            raise RuntimeError("boom")
    assert type(conv) is nn.Conv2d
    with pytest.raises(ValueError, match="grouped or matmul"):
        with convolutions_as("im2col", [conv]):
            pass


@pytest.mark.parametrize("name", ["fedavg", "fedbr", "distrans-nn", "moon"])
def test_matmul_convolutions_train_as_grouped_ones(name, tmp_path):
    """3 free-running rounds with cohort-conv=matmul land where vmap's grouped convolutions do, to rounding
    (they sum in another order, so not bit for bit: which also shows the key reaches the step). MOON's step
    also runs its previous model's features, DisTrans' its double-input model."""
    settings = CASES[name]
    start = federation(settings, "vmap", tmp_path / "start", rounds=0)["global"]
    grouped = federation(settings, "vmap", tmp_path / "grouped")["global"]
    matmul = federation({**settings, "cohort-conv": "matmul"}, "vmap", tmp_path / "matmul")["global"]
    assert 0 < update_difference(matmul, grouped, start) < 1e-3


@pytest.mark.parametrize("name", ["fedavg", "fedbr"])
def test_a_compiled_vmapped_step_trains_as_the_eager_one(name, tmp_path):
    """compile=true in a vmapped cohort step: the step's gradients go through torch.compile (FedAvg's phase
    gradients, FedBR's step with its shared features), which compiles them, and 3 free-running rounds land where
    the eager step does, to rounding."""
    from torch._dynamo.utils import counters

    settings = CASES[name]
    start = federation(settings, "vmap", tmp_path / "start", rounds=0)["global"]
    eager = federation(settings, "vmap", tmp_path / "eager")["global"]
    torch._dynamo.reset()  # compiled in an earlier test, the step would run from the cache
    counters.clear()
    compiled = federation({**settings, "compile": True}, "vmap", tmp_path / "compiled")["global"]
    assert counters["frames"]["ok"] > 0
    assert update_difference(compiled, eager, start) < 1e-3


def test_a_step_that_does_not_compile_is_refused_with_compile_and_auto_loops_it():
    """DANN's gradient reversal is an autograd.Function, which torch.compile cannot trace under vmap: compile=true
    with its vmapped step stops with a message, and auto loops it (where compile reaches its feature extractor)."""
    from fedbr_flwr.app.node import cohort_step

    dann = client_class("dann")
    for step in ("vmap", "graph"):
        with pytest.raises(ConfigError, match="compile=true cannot compile the vectorised step of strategy 'dann'"):
            validate({"strategy": "dann", "engine": "cohort", "cohort-step": step, "compile": True, "device": "cuda"})
    validate({"strategy": "dann", "engine": "cohort", "cohort-step": "vmap"})
    validate({"strategy": "dann", "engine": "cohort", "cohort-step": "auto", "compile": True})
    assert cohort_step("auto", "cuda", dann, compile=True) == "loop"
    assert cohort_step("auto", "cuda", dann) == "vmap"
    assert cohort_step("auto", "cuda", client_class("fedbr"), compile=True) == "graph"


def test_matmul_convolutions_are_refused_where_no_step_is_vmapped():
    message = "cohort-conv=matmul batches the convolutions of a vmapped cohort step"
    for cfg in ({"cohort-conv": "matmul"}, {"cohort-conv": "matmul", "engine": "cohort", "cohort-step": "loop"}):
        with pytest.raises(ConfigError, match=message):
            validate(cfg)
    validate({"cohort-conv": "matmul", "engine": "cohort", "cohort-step": "vmap"})


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
    from flwr.common import RecordDict

    from fedbr_flwr.app.node import build_client

    run_config = {
        "num-clients": 4,
        "engine": "cohort",
        "cohorts": 2,
        "device": "cpu",
        "local-steps": 1,
        "batch-size": 4,
    }
    node = {"partition-id": 0, "num-partitions": 2}
    assert not build_client(run_config, node, RecordDict()).vectorised  # auto on a CPU: the loop
    assert build_client({**run_config, "cohort-step": "vmap"}, node, RecordDict()).vectorised
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="cohort-step=graph replays CUDA graphs, but this cohort's device is cpu"):
            build_client({**run_config, "device": "auto", "cohort-step": "graph"}, node, RecordDict())


def test_members_are_evaluated_at_once_as_each_alone_with_its_own_state_and_test_set():
    """Two members with different weights and test sets of different lengths (the shorter one padded and
    masked), in chunks smaller than the sets: the same loss and accuracy as evaluating each alone."""
    from fedbr_flwr.core.model import build_model
    from fedbr_flwr.core.training import evaluate
    from fedbr_flwr.core.vectorised import evaluate_members, load_module_state, module_state

    torch.manual_seed(0)
    model = build_model("cnn-small", 10, 1, 28)
    states = [module_state(model), {k: v + 0.05 * torch.randn_like(v) for k, v in module_state(model).items()}]
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, 1, 28, 28, generator=g) for n in (5, 9)]
    ys = [torch.randint(0, 10, (n,), generator=g) for n in (5, 9)]
    together = evaluate_members(model, states, xs, ys, batch_size=4)
    matmul = evaluate_members(model, states, xs, ys, batch_size=4, conv="matmul")  # cohort-conv=matmul
    for state, x, y, (loss, acc), (matmul_loss, matmul_acc) in zip(states, xs, ys, together, matmul):
        load_module_state(model, state)
        alone_loss, alone_acc = evaluate(model, x, y)
        assert loss == pytest.approx(alone_loss, rel=1e-5) and acc == alone_acc
        assert matmul_loss == pytest.approx(alone_loss, rel=1e-5) and matmul_acc == alone_acc
    assert together[0] != together[1]


def packed_members(augment: bool = False):
    """Three members with partitions of 5, 11 and 2 images, packed; each member's data as loaded, too."""
    from fedbr_flwr.data.dataset import ClientData, pack_partitions

    g = torch.Generator().manual_seed(0)
    loaded = {
        pid: ClientData(
            pid,
            torch.randn(n, 3, 8, 8, generator=g),
            torch.randint(0, 10, (n,), generator=g),
            torch.randn(2, 3, 8, 8, generator=g),
            torch.randint(0, 10, (2,), generator=g),
            10,
            augment,
            (-1.0, -2.0, -3.0),
        )
        for pid, n in ((4, 5), (7, 11), (9, 2))
    }
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
    from fedbr_flwr.core.training import BatchSampler
    from fedbr_flwr.core.vectorised import PackedBatches

    _, members, packed = packed_members(augment)
    alone = [BatchSampler(data, 4, seed=pid) for pid, data in members.items()]
    together = PackedBatches(
        [BatchSampler(data, 4, seed=pid) for pid, data in members.items()],
        list(packed.offsets.values()),
        packed.x,
        packed.y,
    )
    for _ in range(3):
        x, y = together()
        for i, sampler in enumerate(alone):
            own_x, own_y = sampler()
            assert torch.equal(x[i], own_x) and torch.equal(y[i], own_y)


def test_a_batch_stream_off_the_packed_partitions_is_refused():
    from fedbr_flwr.core.training import BatchSampler
    from fedbr_flwr.core.vectorised import PackedBatches

    loaded, _, packed = packed_members()
    with pytest.raises(ValueError, match="does not read the packed partitions at row 5"):
        PackedBatches([BatchSampler(loaded[7], 4, seed=0)], [5], packed.x, packed.y)


def test_draws_are_stacked_only_where_not_stacked_already():
    """A member's value that is its slice of the gathered batch, or the tensor it gave the step before, is
    taken as it stands (no copy); a new tensor is stacked."""
    from fedbr_flwr.core.vectorised import DrawStacker

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

    from fedbr_flwr.core.training import BatchSampler
    from fedbr_flwr.core.vectorised import DrawStacker, PackedBatches
    from fedbr_flwr.data.dataset import ClientData, pack_partitions

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    loaded = {
        pid: ClientData(
            pid,
            torch.randn(20, 1, 4, 4),
            torch.randint(0, 10, (20,)),
            torch.zeros(1, 1, 4, 4),
            torch.zeros(1, dtype=torch.long),
            10,
            False,
        )
        for pid in range(10)
    }
    members, packed = pack_partitions(loaded, "cpu")
    batches = PackedBatches(
        [BatchSampler(d, 8, seed=pid) for pid, d in members.items()], list(packed.offsets.values()), packed.x, packed.y
    )
    stack = DrawStacker()
    with Count():
        inputs = stack([{"x": xi, "y": yi} for xi, yi in stack.split(*batches())])
    assert inputs["x"].shape == (10, 8, 1, 4, 4)
    assert Count.calls <= 10 + 4 + 2  # + the two unbinds (views: no kernels)


def test_evaluation_groups_bound_the_images_of_one_forward_and_pad_little():
    from fedbr_flwr.core.vectorised import evaluation_groups

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

    from fedbr_flwr.app.node import build_client

    run_config = {
        "num-clients": 6,
        "engine": "cohort",
        "cohorts": 1,
        "device": "cpu",
        "cohort-step": "vmap",
        "model": "cnn-small",
        "partition": "dirichlet",
        "alpha": 0.5,
    }
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


def test_a_step_whose_losses_would_read_another_members_state_is_refused():
    """A vectorised cohort runs member 0's loss functions for every member: a component whose terms read a
    per-client value it holds (instead of taking it through draw or constants) would silently use member 0's.
    Equal values in separate tensors pass; a declared per-member value passes."""
    from clients.fedavg import SupervisedStep
    from fedbr_flwr.core.algorithm import LocalComponent
    from fedbr_flwr.core.model import build_model
    from fedbr_flwr.core.vectorised import Member, check_members_agree

    class ClientScale(LocalComponent):
        def __init__(self, cfg, value):
            super().__init__(cfg)
            self.scale = torch.tensor(value)

        def terms(self, view):
            return [("scaled", 1.0, self.scale * view.logits.mean())]

    cfg = validate({"device": "cpu"})
    model = build_model("cnn-small", 10, 1, 8)
    members = [Member(SupervisedStep(model, cfg, [ClientScale(cfg, v)]), None, {}) for v in (1.0, 1.0, 2.0)]
    check_members_agree(members[:2])
    with pytest.raises(
        ValueError,
        match=r"ClientScale.scale differs between members 0 and 2 .* draw\(\) or "
        r"constants\(\)",
    ):
        check_members_agree(members)
    ClientScale.per_member_state = ("scale",)
    check_members_agree(members)
