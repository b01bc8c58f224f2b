"""How the server's instructions reach clients and their answers come back: one message per client
(``engine=clients``), or one per cohort node carrying all its sampled members (``engine=cohort``, in
the format of ``fedbr_flwr.cohort``). Above this module every instruction and answer is per client."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flwr.common import Parameters
from flwr.server.client_proxy import ClientProxy

from .. import cohort, payload
from .federation import Federation


@dataclass
class Answer:
    """One client's answer to a fit: its arrays by name (or why they could not be read)."""

    pid: int
    arrays: payload.Named
    num_examples: int
    metrics: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None


def messages(
    federation: Federation, common: payload.Serialised, parts: dict[int, tuple[payload.Serialised, dict[str, Any]]]
) -> list[tuple[ClientProxy, Parameters, dict]]:
    """The messages that carry ``common`` plus each client's own arrays and config, in partition order."""
    out = []
    for proxy, pids in federation.group(sorted(parts)):
        if federation.is_cohort(proxy):
            own = [parts[pid][0].prefixed(cohort.member_key(pid, "")) for pid in pids]
            out.append(
                (
                    proxy,
                    payload.Serialised.joined([common, *own]).to_parameters(),
                    cohort.join_configs({p: parts[p][1] for p in pids}),
                )
            )
        else:
            (pid,) = pids
            out.append((proxy, (common + parts[pid][0]).to_parameters(), parts[pid][1]))
    return out


def fit_answers(federation: Federation, results: list) -> list[Answer]:
    """Every client's answer in the fit results, in partition order."""
    answers = []
    for proxy, res in results:
        try:
            arrays = payload.from_parameters(res.parameters)
            problem = None
        except payload.PayloadError as exc:
            arrays, problem = {}, f"not a named payload: {exc}"
        if federation.is_cohort(proxy):
            _, own_arrays = cohort.by_member(arrays)
            _, own_metrics = cohort.by_member(res.metrics)
            for pid in cohort.members_of(res.metrics):
                metrics = dict(own_metrics.get(pid, {}))
                n = int(metrics.pop("num-examples", 0))
                answers.append(Answer(pid, own_arrays.get(pid, {}), n, metrics, problem))
        else:
            answers.append(
                Answer(federation.pid_of(proxy, res.metrics), arrays, res.num_examples, dict(res.metrics), problem)
            )
    return sorted(answers, key=lambda a: a.pid)  # a fixed order keeps float sums, and so runs, repeatable


def evaluate_answers(federation: Federation, results: list) -> list[tuple[int, float, int, float]]:
    """(partition id, loss, test samples, accuracy) of every client in the evaluate results, in partition order."""
    answers = []
    for proxy, res in results:
        if federation.is_cohort(proxy):
            _, own = cohort.by_member(res.metrics)
            answers += [
                (pid, float(own[pid]["loss"]), int(own[pid]["num-examples"]), float(own[pid]["accuracy"]))
                for pid in cohort.members_of(res.metrics)
            ]
        else:
            answers.append(
                (federation.pid_of(proxy, res.metrics), res.loss, res.num_examples, float(res.metrics["accuracy"]))
            )
    return sorted(answers)


def describe_failure(federation: Federation, failure: Any) -> str:
    if isinstance(failure, BaseException):
        return f"{type(failure).__name__}: {failure}"[:500]
    proxy, res = failure
    if federation.is_cohort(proxy):
        who = f"cohort of clients {cohort.join_members(federation.members_by_cid[proxy.cid])}"
    else:
        who = f"client {federation.pid_by_cid.get(proxy.cid, proxy.cid)}"
    return f"{who}: {res.status.message}"[:500]
