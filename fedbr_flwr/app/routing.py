"""How the server's instructions reach clients and their answers come back: one message per client
(``engine=clients``), or one per cohort node carrying all its sampled members (``engine=cohort``, in
the format of ``fedbr_flwr.app.cohort``). Above this module every instruction and answer is per client."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

from flwr.common import Parameters
from flwr.server.client_proxy import ClientProxy

from ..core.config import common
from ..core.errors import describe
from . import cohort, payload
from .federation import Federation
from .raycluster import NODE, reported_node


@dataclass
class Answer:
    """One client's answer to a fit: its arrays by name (or why they could not be read)."""

    pid: int
    arrays: payload.Named
    num_examples: Any  # as reported: checked (a whole number within the client's size) before use
    metrics: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None
    node: str | None = None  # where it says its work ran


@dataclass
class Evaluation:
    """One client's answer to an evaluation, as reported (checked before it is counted)."""

    pid: int
    loss: Any
    num_examples: Any
    accuracy: Any


def messages(
    federation: Federation, to_all: payload.Serialised, parts: dict[int, tuple[payload.Serialised, dict[str, Any]]]
) -> list[tuple[ClientProxy, Parameters, dict]]:
    """The messages that carry ``to_all`` plus each client's own arrays and config, in partition order."""
    out = []
    for proxy, pids in federation.group(sorted(parts)):
        if federation.is_cohort(proxy):
            own = [parts[pid][0].prefixed(cohort.member_key(pid, "")) for pid in pids]
            out.append(
                (
                    proxy,
                    payload.Serialised.joined([to_all, *own]).to_parameters(),
                    cohort.join_configs({p: parts[p][1] for p in pids}),
                )
            )
        else:
            (pid,) = pids
            out.append((proxy, (to_all + parts[pid][0]).to_parameters(), parts[pid][1]))
    return out


def fit_answers(
    federation: Federation, results: list, sampled: Collection[int], max_bytes: int | None = None
) -> list[Answer]:
    """Every client's answer in the fit results, in partition order; one for a client not ``sampled`` this round
    carries that problem. A reply over ``max_bytes`` per sampled client it carries is refused unread (its arrays
    are not decoded)."""
    answers = []
    for proxy, res in results:
        hosted = federation.members_by_cid[proxy.cid] if federation.is_cohort(proxy) else []
        clients = max(1, len(set(hosted) & set(sampled)))
        arrays, problem = read_arrays(res.parameters, max_bytes, clients)
        node = reported_node(res.metrics.get(NODE))
        if federation.is_cohort(proxy):
            (own_arrays, bad_arrays), (own_metrics, bad_metrics) = by_member(arrays), by_member(res.metrics)
            problem = problem or bad_arrays or bad_metrics
            for pid in reported_members(federation, proxy, res.metrics):
                metrics = dict(own_metrics.get(pid, {}))
                n = metrics.pop("num-examples", None)
                answers.append(Answer(pid, own_arrays.get(pid, {}), n, metrics, problem, node))
        else:
            metrics = {k: v for k, v in res.metrics.items() if k != NODE}
            pid = federation.pid_of(proxy, res.metrics)
            answers.append(Answer(pid, arrays, res.num_examples, metrics, problem, node))
    answers = [a if a.pid in sampled else replace(a, problem="not sampled this round") for a in answers]
    return sorted(answers, key=lambda a: a.pid)  # a fixed order keeps float sums, and so runs, repeatable


def by_member(values: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], str | None]:
    """A cohort reply's arrays or metrics by member, or none and why (a key that names no member)."""
    try:
        return cohort.by_member(values)[1], None
    except ValueError as exc:
        return {}, f"not a cohort reply: {exc}"


def read_arrays(parameters: Parameters, max_bytes: int | None, clients: int) -> tuple[payload.Named, str | None]:
    """A reply's arrays by name, or why they were not read: over the byte budget of its ``clients``, or not a
    named payload."""
    size = payload.nbytes(parameters)
    if max_bytes is not None and size > max_bytes * clients:
        return {}, f"{size} bytes, over the budget of {max_bytes * clients} (twice the update's size): not read"
    try:
        return payload.from_parameters(parameters), None
    except payload.PayloadError as exc:
        return {}, f"not a named payload: {exc}"


def placement(answers: list[Answer]) -> dict[str, list[int]]:
    """{node: the clients whose fit ran there} of a round's answers (those that named no node: "unknown")."""
    nodes: dict[str, list[int]] = {}
    for answer in answers:
        nodes.setdefault(answer.node or "unknown", []).append(answer.pid)
    return nodes


def evaluate_answers(federation: Federation, results: list) -> list[Evaluation]:
    """Every client's evaluation in the evaluate results, as reported, in partition order (a missing
    value is None, for the check to refuse)."""
    answers = []
    for proxy, res in results:
        if federation.is_cohort(proxy):
            own, _ = by_member(res.metrics)  # unreadable: no member's figures, which the check refuses
            for pid in reported_members(federation, proxy, res.metrics):
                mine = own.get(pid, {})
                answers.append(Evaluation(pid, mine.get("loss"), mine.get("num-examples"), mine.get("accuracy")))
        else:
            pid = federation.pid_of(proxy, res.metrics)
            answers.append(Evaluation(pid, res.loss, res.num_examples, res.metrics.get("accuracy")))
    return sorted(answers, key=lambda a: a.pid)


def reported_members(federation: Federation, proxy: ClientProxy, metrics: dict) -> list[int]:
    """The members a cohort's reply speaks for: those it names that this node hosts, each once. A reply
    that names none readably speaks for none (its sampled members then count as not answered)."""
    try:
        named = cohort.members_of(metrics)
    except (KeyError, ValueError):
        return []
    hosted = set(federation.members_by_cid.get(proxy.cid, []))
    return [pid for pid in dict.fromkeys(named) if pid in hosted]


def describe_failure(federation: Federation, failure: Any) -> str:
    """One line (at most 500 characters) saying who failed and why: Ray's multi-line errors are folded."""
    run = common(federation.cfg)
    if isinstance(failure, BaseException):  # Flower's legacy grid raises some errors of a reply
        return one_line(failure_reason(describe(failure), run.round_timeout))
    proxy, res = failure
    if federation.is_cohort(proxy):
        who = f"cohort of clients {cohort.join_members(federation.members_by_cid[proxy.cid])}"
    else:
        who = f"client {federation.pid_by_cid.get(proxy.cid, proxy.cid)}"
    return one_line(f"{who}: {failure_reason(res.status.message, run.round_timeout)}")


# Flower's reasons for a reply that never came: its message or reply outlived its TTL, which round-timeout sets
EXPIRED = ("Error: Message Unavailable", "Error: Reply Message Unavailable")


def failure_reason(message: str, round_timeout: float) -> str:
    """Flower's reason for a failed reply, in our terms where Flower's do not say what happened."""
    if round_timeout and any(reason in message for reason in EXPIRED):
        return f"timed out: no reply within round-timeout = {round_timeout:g} s"
    return message


def one_line(text: str, limit: int = 500) -> str:
    return " ".join(str(text).split())[:limit]
