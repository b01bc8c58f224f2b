"""Client updates by name, the checks an update must pass before it is averaged in, and the weighted
mean (Flower-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

Named = dict[str, np.ndarray]
# bookkeeping, not averaged (nor are "*-version")
NOT_TRAINING_METRICS = ("partition-id", "fit-seconds", "peak-rss-mb", "peak-gpu-mb")


@dataclass
class ClientUpdate:
    """What one client returned from a fit: its arrays by name, its number of training samples and metrics."""

    pid: int
    arrays: Named
    num_examples: int
    metrics: dict[str, Any] = field(default_factory=dict)


def weighted_mean(arrays: list[list[np.ndarray]], weights: list[float]) -> list[np.ndarray]:
    """Layer-wise sum_i w_i * arrays_i / sum_i w_i (in float64, cast back to each layer's dtype)."""
    if not arrays:
        raise ValueError("nothing to average")
    w = np.asarray(weights, dtype=np.float64)
    if len(w) != len(arrays):
        raise ValueError(f"{len(arrays)} updates but {len(w)} weights")
    if not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError(f"averaging weights must be >= 0 with a positive sum, got {weights}")
    w = w / w.sum()
    out = []
    for layers in zip(*arrays):
        acc = np.zeros(layers[0].shape, dtype=np.float64)
        for wi, layer in zip(w, layers):
            acc += wi * layer
        out.append(acc.astype(layers[0].dtype))
    return out


def named_mean(named: Sequence[Mapping[str, np.ndarray]], weights: list[float], names: list[str]) -> Named:
    """``weighted_mean`` of the arrays called ``names`` in each of ``named``."""
    return dict(zip(names, weighted_mean([[arrays[n] for n in names] for arrays in named], weights)))


def update_problem(
    arrays: Mapping[str, np.ndarray],
    expected: Mapping[str, tuple[int, ...]] | None,
    metrics: Mapping[str, Any],
    required_metrics: tuple[str, ...] = (),
) -> str | None:
    """Why a client's update must not be averaged in, or None when it may be (``expected``: the names
    and shapes it must hold, None: not known; ``required_metrics``: metrics the server reads, which must
    be numbers)."""
    if expected is not None:
        missing = [n for n in expected if n not in arrays]
        if missing:
            return (
                f"missing arrays {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                f"({len(missing)} of {len(expected)})"
            )
        extra = [n for n in arrays if n not in expected]
        if extra:
            return f"unexpected arrays {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}"
    for name, a in arrays.items():
        if expected is not None and tuple(a.shape) != tuple(expected[name]):
            return f"array '{name}' has shape {tuple(a.shape)}, expected {tuple(expected[name])}"
        if a.dtype.kind in "fc" and not np.isfinite(a).all():
            return f"array '{name}' holds NaN or Inf"
    absent = [
        k for k in required_metrics if not isinstance(metrics.get(k), (int, float)) or isinstance(metrics.get(k), bool)
    ]
    if absent:
        return f"metric '{absent[0]}' is missing or not a number"
    bad = sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))
    if bad:
        return f"metrics {', '.join(bad)} are NaN or Inf"
    return None


def mean_metrics(metrics: list[dict]) -> dict[str, float]:
    """The mean of each training metric over the clients that reported it (bookkeeping left out)."""
    keys = {
        k
        for m in metrics
        for k in m
        if k not in NOT_TRAINING_METRICS and not k.endswith("-version") and isinstance(m[k], (int, float))
    }
    return {k: float(np.mean([m[k] for m in metrics if k in m])) for k in sorted(keys)}
