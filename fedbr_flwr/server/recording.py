"""The lines a round writes to rounds.jsonl and an evaluation to metrics.jsonl, from plain Python."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.errors import ConfigError
from ..runfiles.metrics import CLIENT_METRICS
from .updates import ClientUpdate, mean_metrics


def peak_client_memory(metrics: list[dict]) -> dict[str, float]:
    """The largest peak memory any client process reported this round (keys as in rounds.jsonl)."""
    names = {"peak-rss-mb": "client_peak_rss_mb", "peak-gpu-mb": "client_peak_gpu_mb"}
    return {
        name: max(m[key] for m in metrics if key in m) for key, name in names.items() if any(key in m for m in metrics)
    }


def node_key(client_key: str) -> str:
    """The rounds.jsonl key of a per-node figure: client_peak_rss_mb -> node_peak_rss_mb."""
    return "node_" + client_key.removeprefix("client_")


def peak_memory_by_node(nodes: dict[str, list[int]], accepted: list[ClientUpdate]) -> dict[str, dict[str, float]]:
    """With clients on more than one node: each node's largest peak memory reported this round."""
    if len(nodes) < 2:
        return {}
    by_pid = {u.pid: u.metrics for u in accepted}
    out: dict[str, dict[str, float]] = {}
    for node, pids in nodes.items():
        for name, value in peak_client_memory([by_pid[p] for p in pids if p in by_pid]).items():
            out.setdefault(node_key(name), {})[node] = value
    return out


def round_record(
    server_round: int,
    accepted: list[ClientUpdate],
    failures: int,
    missing: list[int],
    errors: list[str],
    rejected: list[dict],
    skipped: bool,
    seconds: float,
    bytes_down: int,
    bytes_up: int,
    server_metrics: dict[str, float],
    nodes: dict[str, list[int]] | None = None,
) -> dict[str, Any]:
    """One rounds.jsonl line: who was averaged in, what failed and why, the training means, time and
    traffic, where each answering client's fit ran (``nodes``), and what the strategy measured (``server``)."""
    failed = sorted(set(missing) | {r["partition"] for r in rejected})  # every client whose update did not count
    faults = {"failed_clients": failed, "errors": errors, "rejected": rejected} if failed or errors else {}
    return {
        "round": server_round,
        "clients": len(accepted),
        "failures": failures + len(rejected),
        **faults,
        **({"skipped": True} if skipped else {}),
        "train": mean_metrics([u.metrics for u in accepted]),
        "seconds": round(seconds, 4),
        "client_fit_seconds": max((u.metrics.get("fit-seconds", 0.0) for u in accepted), default=0.0),
        "bytes_down": bytes_down,
        "bytes_up": bytes_up,
        **peak_client_memory([u.metrics for u in accepted]),
        **({"nodes": nodes, **peak_memory_by_node(nodes, accepted)} if nodes else {}),
        **({"server": server_metrics} if server_metrics else {}),
    }


def eval_record(
    server_round: int,
    results: list[tuple[int, float, int, float]],
    failures: int,
    all_pids: list[int],
    train: dict[str, float],
    server_fields: dict[str, Any],
) -> dict[str, Any]:
    """One metrics.jsonl line from (partition id, loss, test samples, accuracy) of each client that answered,
    and what the server's own tests gave this round (``server_test_fields``; empty: none ran).
    ``clients_evaluated`` of ``clients_expected`` says whether it is complete: the accuracies of an
    evaluation some client missed are over the others only (the summary does not count it)."""
    per_client = {pid: acc for pid, _, _, acc in results}
    n = sum(num for _, _, num, _ in results)
    accs, sizes = [acc for _, _, _, acc in results], [num for _, _, num, _ in results]
    missing = sorted(set(all_pids) - set(per_client))
    metrics = {name: metric.compute(accs, sizes) for name, metric in CLIENT_METRICS.items()}
    fields = {
        "loss": sum(loss * num for _, loss, num, _ in results) / max(n, 1),
        "global_acc": None,
        "global_loss": None,
        **server_fields,
        "train": train,
        "per_client_acc": {str(k): per_client[k] for k in sorted(per_client)},
        "eval_failures": failures,
        "clients_evaluated": len(per_client),
        "clients_expected": len(set(all_pids) | set(per_client)),
        **({"eval_failed_clients": missing} if failures or missing else {}),
    }
    if clash := sorted(set(metrics) & {"round", *fields}):  # the field would silently replace the metric
        raise ConfigError(f"client metric(s) {', '.join(clash)} have the name of a metrics.jsonl field: rename them")
    return {"round": server_round, **metrics, **fields}


def check_client_metric_names() -> None:
    """The check of each evaluation's record, made before a run starts: one record with every field."""
    eval_record(0, [(0, 0.0, 1, 0.0)], 0, [0], {}, server_test_fields({0: (0.0, 0.0)}, [(0.0, 0.0)]))


def server_test_fields(
    by_angle: dict[int, tuple[float, float]], extra_local: list[tuple[float, float]]
) -> dict[str, Any]:
    """The metrics.jsonl fields of the server's tests from their (loss, accuracy): the balanced global
    test's mean over its angle copies (``global_acc``, ``global_loss``), each copy's accuracy and the worst
    angle; the extra local tests' mean, each set's accuracy and the worst. A test that did not run adds
    nothing."""
    fields: dict[str, Any] = {}
    if by_angle:
        accs = {angle: acc for angle, (_, acc) in by_angle.items()}
        worst = min(accs, key=lambda angle: (accs[angle], angle))
        fields |= {
            "global_acc": float(np.mean(list(accs.values()))),
            "global_loss": float(np.mean([loss for loss, _ in by_angle.values()])),
            "global_acc_by_angle": {str(angle): accs[angle] for angle in sorted(accs)},
            "global_worst_acc": accs[worst],
            "global_worst_angle": worst,
        }
    if extra_local:
        accs_k = [acc for _, acc in extra_local]
        fields |= {
            "extra_local_acc": float(np.mean(accs_k)),
            "extra_local_loss": float(np.mean([loss for loss, _ in extra_local])),
            "extra_local_acc_by_set": {str(k): acc for k, acc in enumerate(accs_k)},
            "extra_local_worst_acc": min(accs_k),
        }
    return fields
