"""The cohort engine (engine=cohort): one Flower node trains a cohort of clients in one process. Every
strategy and combination, and the checkpoint/resume runs, must give exactly what the client engine gave
(the golden runs); a cohort's answers are split into per-client results that are validated, recorded
and checkpointed as the client engine's are."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from flwr.common import Code, FitRes, RecordDict, Status

from fedbr_flwr.app import payload
from fedbr_flwr.app.node import CohortClient, build_client, cohort_members
from fedbr_flwr.app.server_app import build_strategy
from fedbr_flwr.core.broadcast import SharedData
from fedbr_flwr.core.config import ConfigError, validate
from fedbr_flwr.launch.plan import build_config, size_resources

import golden
from fakes import FixedClientManager, InProcessProxy
from test_golden import FILES, close_arrays, close_json, close_records, to_reproduce

COHORTS = {"engine": "cohort", "cohorts": 2}  # 3 clients: cohort 0 hosts clients 0 and 2, cohort 1 client 1

# Cases whose clients differ from another case's only in their local loss. On a CPU the cohort engine loops over
# the client engine's own local step (node.cohort_step), so what a cohort run checks is the routing of arrays,
# configs, state and shared data, which these send as the case named beside them does: they run with -m long.
SAME_ROUTING = {
    "fedprox": "fedavg",
    "feddecorr": "fedavg",
    "fedntd": "fedavg",
    "mixup": "fedavg",
    "fedbr-no-balance": "fedbr",
    "fedbr-no-contrastive": "fedbr",
    "fedbr-no-max-step": "fedbr",
    "fedaug-mean-output": "fedbr",
    "fedbr-scales-widths": "fedbr",
    "fedbr+feddecorr": "fedbr",
    "fedbr+fedntd": "fedbr",
    "fedbr+mixup": "fedbr",
}
COHORT_CASES = [
    pytest.param(
        p,
        id=p.stem,
        marks=[pytest.mark.xdist_group(p.stem), *([pytest.mark.long] if p.stem in SAME_ROUTING else [])],
    )
    for p in FILES
]


def test_each_case_left_to_the_long_run_has_its_routing_twin_in_ci():
    stems = {p.stem for p in FILES}
    assert set(SAME_ROUTING) <= stems and set(SAME_ROUTING.values()) <= stems - set(SAME_ROUTING)


@pytest.mark.parametrize("path", COHORT_CASES)
def test_the_cohort_engine_gives_exactly_the_golden_runs(path, tmp_path):
    want, exact = to_reproduce(path)
    close_records(golden.record(want["case"], tmp_path, **COHORTS), want, exact)


@pytest.mark.parametrize(
    "first, then", [({}, COHORTS), (COHORTS, {})], ids=["clients-then-cohort", "cohort-then-clients"]
)
@pytest.mark.parametrize("name", ["resume-scaffold", "resume-moon"])
def test_a_run_stopped_under_one_engine_resumes_under_the_other(name, first, then, tmp_path):
    """Per-client state travels through the checkpoint, not through the engine's nodes."""
    want, exact = to_reproduce(golden.GOLDEN_DIR / f"{name}.json")
    torch.set_num_threads(1)
    cfg = golden.case_config({**golden.RESUME_CASES[name], "num-rounds": 4})
    golden.federate({**cfg, **first}, tmp_path, 3)
    got = golden.run_record(tmp_path, golden.federate({**cfg, **then, "resume": True}, tmp_path, 2))
    close_arrays(got["global"], want["global"], "global", exact)
    close_json(got["rounds"], want["rounds"], "rounds", exact)
    close_json(got["metrics"], want["metrics"], "metrics", exact)


def test_a_cohort_hosts_every_kth_client_and_reports_each_as_a_client_of_its_own():
    cfg = validate(
        {"num-clients": 5, "engine": "cohort", "cohorts": 2, "local-steps": 1, "batch-size": 4, "device": "cpu"}
    )
    assert cohort_members(cfg, 0, 2) == [0, 2, 4] and cohort_members(cfg, 1, 2) == [1, 3]
    node = build_client(cfg, {"partition-id": 1, "num-partitions": 2}, RecordDict())
    assert isinstance(node, CohortClient) and sorted(node.members) == [1, 3]
    assert node.member(3) is node.member(1)  # one model serves every member in turn
    assert node.member(3).pid == 3 and node.member(3).data is node.members[3]
    props = node.get_properties({})
    assert props["members"] == "1,3" and props["num-partitions"] == 5
    assert set(props) >= {"member/1/class-counts", "member/3/class-counts", "partition-hash"}


def test_one_message_per_cohort_carries_the_global_arrays_once_and_each_members_own(tmp_path):
    cfg = validate(
        {
            "strategy": "distrans",
            "distrans-agg": "avg",
            "num-clients": 3,
            "engine": "cohort",
            "cohorts": 2,
            "local-steps": 1,
            "batch-size": 4,
            "global-test": False,
            "device": "cpu",
        }
    )
    strategy = build_strategy({**cfg, "output-dir": str(tmp_path)})
    nodes = [build_client(cfg, {"partition-id": c, "num-partitions": 2}, RecordDict()) for c in range(2)]
    proxies = [InProcessProxy(n, f"cohort-{c}") for c, n in enumerate(nodes)]
    manager = FixedClientManager(proxies)
    parameters = strategy.initialize_parameters(None)
    for server_round in (1, 2):
        ins = strategy.configure_fit(server_round, parameters, manager)
        assert [proxy.cid for proxy, _ in ins] == ["cohort-0", "cohort-1"]  # one message per cohort
        assert [i.config["members"] for _, i in ins] == ["0,2", "1"]
        sent = payload.from_parameters(ins[0][1].parameters)
        assert sum(name.startswith("model/") for name in sent) == len(strategy.global_names)  # once
        if server_round == 2:  # avg: each member is sent the mean offset under its own name
            assert {"member/0/offset", "member/2/offset"} <= set(sent)
        new, _ = strategy.aggregate_fit(server_round, [(p, p.fit(i, None, server_round)) for p, i in ins], [])
        parameters = new
    record = json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[-1])
    assert record["clients"] == 3 and record["failures"] == 0
    assert sorted(strategy.returned_offsets) == [0, 1, 2]  # every client's offset, by partition id


def cohort_strategy(tmp_path):
    cfg = validate(
        {
            "num-clients": 4,
            "engine": "cohort",
            "cohorts": 2,
            "local-steps": 1,
            "batch-size": 4,
            "global-test": False,
            "device": "cpu",
            "output-dir": str(tmp_path),
        }
    )
    strategy = build_strategy(cfg)
    nodes = [build_client(cfg, {"partition-id": c, "num-partitions": 2}, RecordDict()) for c in range(2)]
    proxies = [InProcessProxy(n, f"cohort-{c}") for c, n in enumerate(nodes)]
    ins = strategy.configure_fit(1, strategy.initialize_parameters(None), FixedClientManager(proxies))
    return strategy, ins


def test_a_members_nan_update_is_rejected_and_its_cohort_mates_are_averaged_in(tmp_path):
    strategy, ins = cohort_strategy(tmp_path)
    results = [(p, p.fit(i, None, 1)) for p, i in ins]
    proxy, res = results[0]  # cohort 0: clients 0 and 2
    arrays = payload.from_parameters(res.parameters)
    first = next(k for k in arrays if k.startswith("member/2/model/"))
    arrays[first] = np.full_like(arrays[first], np.nan)
    results[0] = (proxy, FitRes(res.status, payload.to_parameters(arrays), res.num_examples, res.metrics))
    strategy.aggregate_fit(1, results, [])
    record = json.loads((tmp_path / "rounds.jsonl").read_text())
    assert record["clients"] == 3 and record["rejected"] == [
        {"partition": 2, "reason": f"array '{first.removeprefix('member/2/')}' holds NaN or Inf"}
    ]
    assert all(np.isfinite(a).all() for a in strategy.latest.values())


@pytest.mark.parametrize("part", ["arrays", "metrics"])
@pytest.mark.parametrize("key", ["member/abc/loss", "member/5"])
def test_a_cohort_reply_with_a_key_that_names_no_member_rejects_its_members_and_raises_nothing(tmp_path, part, key):
    """Splitting such a key by member raised out of the server's aggregate_fit, and so stopped the run."""
    strategy, ins = cohort_strategy(tmp_path)
    results = [(p, p.fit(i, None, 1)) for p, i in ins]
    proxy, res = results[0]  # cohort 0: clients 0 and 2
    arrays, metrics = payload.from_parameters(res.parameters), dict(res.metrics)
    if part == "arrays":
        arrays[key] = np.zeros(1, np.float32)
    else:
        metrics[key] = 1.0
    results[0] = (proxy, FitRes(res.status, payload.to_parameters(arrays), res.num_examples, metrics))
    strategy.aggregate_fit(1, results, [])
    record = json.loads((tmp_path / "rounds.jsonl").read_text())
    assert record["clients"] == 2 and [r["partition"] for r in record["rejected"]] == [0, 2]
    assert all(f"{key!r} names no member" in r["reason"] for r in record["rejected"])
    evaluated = [(p, p.evaluate(i, None, 1)) for p, i in strategy.configure_evaluate(2, ins[0][1].parameters, None)]
    evaluated[0][1].metrics[key] = 1.0
    strategy.aggregate_evaluate(2, evaluated, [])  # its members' figures are not read, and nothing raises


def test_a_cohort_reply_for_a_member_not_sampled_this_round_is_not_used(tmp_path):
    """A cohort's reply named every member it hosts, and each was averaged in and marked as having used its update:
    fraction-fit was bypassed and the node got the weight of clients the server had not asked."""
    strategy, ins = cohort_strategy(tmp_path)
    results = [(p, p.fit(i, None, 1)) for p, i in ins]
    strategy.sampled = [0, 1, 3]  # as if client 2 (cohort 0, beside client 0) had not been asked
    strategy.checkpointer.pending = {pid: b"its state at the checkpoint" for pid in range(4)}  # as after a resume
    strategy.shared = SharedData("pseudo")  # as FedBR's: which version of its data each client says it holds
    strategy.aggregate_fit(1, results, [])
    record = json.loads((tmp_path / "rounds.jsonl").read_text())
    assert record["clients"] == 3 and record["rejected"] == [{"partition": 2, "reason": "not sampled this round"}]
    assert sorted(strategy.checkpointer.used_rounds) == [0, 1, 3]
    assert list(strategy.checkpointer.pending) == [2]  # not sent its saved state, so it is still handed back
    assert sorted(strategy.shared.held) == [0, 1, 3]  # nor is what it says it holds believed


def test_a_cohort_reply_speaks_once_for_each_member_it_hosts_and_for_no_other(tmp_path):
    """A mutation audit found that nothing held a reply's list of members to this: a member named twice could be
    averaged in twice, a reply could answer for a client of another cohort, and a list that cannot be read could
    raise out of the server."""
    strategy, ins = cohort_strategy(tmp_path)
    results = [(p, p.fit(i, None, 1)) for p, i in ins]
    honest, _ = strategy.aggregate_fit(1, results, [])
    proxy, res = results[0]  # cohort 0: clients 0 and 2; cohort 1 hosts 1 and 3
    arrays, metrics = payload.from_parameters(res.parameters), dict(res.metrics)

    def as_member_1(values, change=lambda v: v):
        return {k.replace("member/0/", "member/1/"): change(v) for k, v in values.items() if k.startswith("member/0/")}

    forged_arrays, forged_metrics = (
        {**arrays, **as_member_1(arrays, lambda a: a + 1)},
        {**metrics, **as_member_1(metrics)},
    )
    for members, tampered_arrays, tampered_metrics in (
        ("0,2,0", arrays, metrics),
        ("0,2,1", forged_arrays, forged_metrics),
    ):
        reply = FitRes(res.status, payload.to_parameters(tampered_arrays), res.num_examples, {**tampered_metrics})
        reply.metrics["members"] = members
        again, _ = strategy.aggregate_fit(1, [(proxy, reply), results[1]], [])
        record = json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[-1])
        assert record["clients"] == 4 and "rejected" not in record, members
        for name, value in payload.from_parameters(honest).items():
            np.testing.assert_array_equal(payload.from_parameters(again)[name], value)
    unreadable = FitRes(res.status, res.parameters, res.num_examples, {**metrics, "members": "0,x"})
    strategy.aggregate_fit(1, [(proxy, unreadable), results[1]], [])  # its members count as not answered
    record = json.loads((tmp_path / "rounds.jsonl").read_text().splitlines()[-1])
    assert record["clients"] == 2 and record["failed_clients"] == [0, 2] and record["rejected"] == []


def test_a_cohort_reply_is_held_to_the_byte_budget_of_the_members_sampled_from_it(tmp_path):
    """One update's budget per member the server asked, not per member the node hosts: a mutation audit found that
    a budget over every hosted member passed the tests."""
    from fedbr_flwr.server.updates import byte_budget

    strategy, ins = cohort_strategy(tmp_path)
    results = [(p, p.fit(i, None, 1)) for p, i in ins]
    strategy.sampled = [0, 1, 3]  # client 2 (cohort 0, beside client 0) not asked: cohort 0 has one budget
    budget = byte_budget(strategy.update_spec, strategy.update_dtypes)
    proxy, res = results[0]
    padding = np.zeros(budget - payload.nbytes(res.parameters) + 1024, np.uint8)  # not a member's: never read
    padded = payload.to_parameters({**payload.from_parameters(res.parameters), "padding": padding})
    assert budget < payload.nbytes(padded) < 2 * budget
    strategy.aggregate_fit(1, [(proxy, FitRes(res.status, padded, res.num_examples, res.metrics)), results[1]], [])
    record = json.loads((tmp_path / "rounds.jsonl").read_text())
    assert record["clients"] == 2 and [r["partition"] for r in record["rejected"]] == [0, 2]
    assert record["rejected"][0]["reason"] == (
        f"{payload.nbytes(padded)} bytes, over the budget of {budget} (twice the update's size): not read"
    )


def test_a_failed_cohort_marks_each_of_its_sampled_clients_failed(tmp_path):
    strategy, ins = cohort_strategy(tmp_path)
    (p0, i0), (p1, i1) = ins
    crashed = FitRes(Status(Code.FIT_NOT_IMPLEMENTED, "worker died"), payload.to_parameters({}), 0, {})
    strategy.aggregate_fit(1, [(p1, p1.fit(i1, None, 1))], [(p0, crashed)])
    record = json.loads((tmp_path / "rounds.jsonl").read_text())
    assert record["clients"] == 2 and record["failed_clients"] == [0, 2]
    assert record["errors"] == ["cohort of clients 0,2: worker died"]


def test_requests_reach_every_member_through_its_cohort(tmp_path):
    strategy, _ = cohort_strategy(tmp_path)
    states = strategy.federation.request("client-state", {pid: {} for pid in range(4)}, 0, "its state")
    assert sorted(states) == [0, 1, 2, 3] and all(a["state"].dtype == np.uint8 for a in states.values())


def test_the_cohorts_share_the_machine():
    cpu = size_resources(build_config(["engine=cohort"]), cuda_available=False, cpu_count=2)
    assert (cpu["cohorts"], cpu["client-cpus"], cpu["client-gpus"]) == (2, 1, 0.0)  # side by side, a core each
    wide = size_resources(build_config(["engine=cohort", "client-cpus=4"]), cuda_available=False, cpu_count=16)
    assert (wide["cohorts"], wide["client-cpus"]) == (4, 4)
    one = size_resources(build_config(["engine=cohort", "cohorts=1"]), cuda_available=False, cpu_count=2)
    assert (one["cohorts"], one["client-cpus"]) == (1, 2)  # one cohort: every core
    gpus = size_resources(build_config(["engine=cohort"]), cuda_available=True, cpu_count=16, gpu_count=4)
    assert (gpus["cohorts"], gpus["client-cpus"], gpus["client-gpus"]) == (4, 4, 1.0)  # one cohort per GPU
    two = size_resources(build_config(["engine=cohort", "cohorts=8"]), cuda_available=True, cpu_count=16, gpu_count=4)
    assert (two["cohorts"], two["client-gpus"]) == (8, 0.5)
    assert size_resources(build_config(["engine=cohort", "num-clients=3", "cohorts=8"]), False, 2)["cohorts"] == 3


def test_a_deployment_refuses_the_cohort_engine(capsys, tmp_path):
    from fedbr_flwr.commands import deploy

    assert deploy.main(["local", "engine=cohort", f"output-dir={tmp_path / 'run'}"]) == 2
    assert "engine=cohort runs in simulation only" in capsys.readouterr().err


@pytest.mark.parametrize(
    "node, message",
    [
        ({"partition-id": 0, "num-partitions": 3}, "cohorts = 2, but this SuperNode is 0 of 3"),
        ({"partition-id": 2, "num-partitions": 2}, "this SuperNode is 2 of 2"),
    ],
)
def test_a_cohort_node_outside_the_configured_cohorts_stops_with_a_clear_message(node, message):
    cfg = validate({"num-clients": 4, "engine": "cohort", "cohorts": 2, "device": "cpu"})
    with pytest.raises(ConfigError, match=message):
        build_client(cfg, node, RecordDict())


def test_binding_a_member_forgets_what_the_previous_member_received():
    """A member reports only the broadcast versions it used itself (the server sends the data to the
    clients that have not confirmed holding it)."""
    cfg = validate({"strategy": "fedbr", "num-clients": 4, "engine": "cohort", "cohorts": 2, "device": "cpu"})
    node = build_client(cfg, {"partition-id": 0, "num-partitions": 2}, RecordDict())
    first = node.member(0)
    first.shared_versions["pseudo"], first.received["extra"] = 3, np.zeros(1)
    second = node.member(2)
    assert second.pid == 2 and second.shared_versions == {} and second.received == {}
