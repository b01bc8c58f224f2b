"""Client updates by name, the checks an update must pass before it is averaged in, and the weighted
mean (Flower-free)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from ..core.errors import quoted
from ..data.catalog import DatasetInfo

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


def byte_budget(spec: Mapping[str, tuple[int, ...]] | None, dtypes: Mapping[str, np.dtype] | None) -> int | None:
    """The most bytes one client's update may take on the wire before the server reads it: twice the arrays
    it must return (names and headers fit in the extra MiB); None before the first round sets the spec."""
    if spec is None or dtypes is None:
        return None
    return 2 * sum(math.prod(shape) * np.dtype(dtypes[name]).itemsize for name, shape in spec.items()) + 2**20


NUMERIC_KINDS = "biuf"  # bool, integer, unsigned, float: what an array in an update may hold at all
# a client reports a few dozen metrics with short names, and each one a round averages becomes a key of that
# round's rounds.jsonl line (and a tracked scalar): more, or longer names, are no client of ours
MAX_METRICS, MAX_METRIC_NAME = 256, 100
MAX_COUNT = 2**63  # a sample count past int64 is no client's, and a weight of it overflows float64's mean


def update_problem(
    arrays: Mapping[str, np.ndarray],
    expected: Mapping[str, tuple[int, ...]] | None,
    metrics: Mapping[str, Any],
    required_metrics: tuple[str, ...] = (),
    dtypes: Mapping[str, np.dtype] | None = None,
) -> str | None:
    """Why a client's update must not be averaged in, or None when it may be (``expected``: the names
    and shapes it must hold, None: not known; ``required_metrics``: metrics the server reads, which must
    be numbers >= 0 (losses); ``dtypes``: the dtype each named array must have, exactly: a cast would change the model
    of every client)."""
    if expected is not None:
        missing = [n for n in expected if n not in arrays]
        if missing:
            return (
                f"missing arrays {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''} "
                f"({len(missing)} of {len(expected)})"
            )
        extra = [n for n in arrays if n not in expected]
        if extra:
            return f"unexpected arrays {', '.join(quoted(n, 60) for n in extra[:3])}{' ...' if len(extra) > 3 else ''}"
    for name, a in arrays.items():
        if a.dtype.kind not in NUMERIC_KINDS:
            return f"array {quoted(name, 60)} holds {a.dtype} values, not real numbers"
        if dtypes is not None and name in dtypes and a.dtype != dtypes[name]:
            return f"array {quoted(name, 60)} has dtype {a.dtype}, expected {dtypes[name]}"
        if expected is not None and tuple(a.shape) != tuple(expected[name]):
            return f"array {quoted(name, 60)} has shape {tuple(a.shape)}, expected {tuple(expected[name])}"
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            return f"array {quoted(name, 60)} holds NaN or Inf"
    absent = [k for k in required_metrics if not is_real(metrics.get(k)) or metrics[k] < 0]
    if absent:
        return f"metric '{absent[0]}' is missing or not a number >= 0"
    if len(metrics) > MAX_METRICS or any(len(k) > MAX_METRIC_NAME or not k.isprintable() for k in metrics):
        return (
            f"reports {len(metrics)} metrics: at most {MAX_METRICS}, with names of at most {MAX_METRIC_NAME} "
            "printable characters"
        )
    odd = sorted(k for k, v in metrics.items() if not is_real(v))  # a client's metrics are all numbers
    if odd:
        return f"metric '{odd[0]}' is {quoted(metrics[odd[0]], 60)}, not a number"
    bad = sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))
    if bad:
        return f"metrics {', '.join(bad)} are NaN or Inf"
    return None


def images_problem(x: Any, count: int | None, info: DatasetInfo) -> str | None:
    """Why arrays a client sent as model inputs for every client (its pseudo-data means, FedMix's mean data)
    must not be used: not a float array, not ``count`` images of ``info``'s shape (None: any number), or a
    value outside the range of its normalised images (per channel; NaN and Inf included). One such value in
    the shared inputs would derail every client's training."""
    if not isinstance(x, np.ndarray) or x.dtype.kind != "f":
        return f"inputs of type {getattr(x, 'dtype', type(x).__name__)}, not floats"
    shape = (count, *info.image_shape)
    if x.ndim != len(shape) or any(want is not None and got != want for got, want in zip(x.shape, shape)):
        return f"inputs of shape {tuple(x.shape)}, expected {tuple('any' if n is None else n for n in shape)}"
    low, high = (np.asarray(bound, dtype=np.float64).reshape(1, -1, 1, 1) for bound in info.input_range())
    slack = 1e-4 * (high - low)  # the rounding of a float32 mean
    inside = (x >= low - slack) & (x <= high + slack)  # False for NaN
    if not inside.all():
        return f"{int((~inside).sum())} input values outside the images' range (or NaN)"
    return None


def soft_labels_problem(y: Any, count: int, num_classes: int) -> str | None:
    """Why labels sent with such inputs must not be used: not ``count`` rows of ``num_classes`` class
    probabilities (each in [0, 1], each row summing to 1)."""
    if not isinstance(y, np.ndarray) or y.dtype.kind != "f" or y.shape != (count, num_classes):
        return f"labels of shape {getattr(y, 'shape', '?')}, expected ({count}, {num_classes}) class probabilities"
    if not (np.all((y >= 0) & (y <= 1)) and np.allclose(y.sum(axis=1), 1.0, atol=1e-3)):
        return "labels that are not class probabilities (each in [0, 1], summing to 1)"
    return None


def count_problem(n: Any, known: int | None, what: str) -> str | None:
    """Why a reported sample count is not believable: not a whole number, below 1, or above the
    ``known`` size of the client's partition (None: not known)."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        return f"reports {what} {quoted(n, 60)}, not a whole number"
    if not 1 <= n < MAX_COUNT:
        return f"reports {quoted(int(n), 60) if n < 1 else '2**63 or more'} {what}"
    if known is not None and n > known:
        return f"reports {n} {what}, but its partition holds {known}"
    return None


def all_finite(*named: Mapping[str, np.ndarray]) -> bool:
    """Whether every array of ``named`` is free of Inf and NaN: server state that accepted but huge updates summed
    past float32's largest would be sent to every client from then on."""
    return all(np.isfinite(a).all() for arrays in named for a in arrays.values())


def is_real(value: Any) -> bool:
    """A real number that a float holds (NaN and Inf included); a Python int past float's range is none: the
    server's means and checks of it would raise OverflowError."""
    if not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool):
        return False
    try:
        float(value)
    except OverflowError:
        return False
    return True


def evaluation_problem(loss: Any, n: Any, accuracy: Any, known_test: int | None) -> str | None:
    """Why a client's evaluation must not be counted: a loss that is no number or below 0 (NaN and Inf
    pass: a diverged model has them, and they are written as null), an accuracy that is not a finite
    number in [0, 1], or a test-sample count it cannot have."""
    if not is_real(loss) or loss < 0:
        return f"reports loss {quoted(loss, 60)}, not a number >= 0"
    if not is_real(accuracy) or not math.isfinite(accuracy):
        return f"reports accuracy {quoted(accuracy, 60)}, not a finite number"
    if not 0.0 <= accuracy <= 1.0:
        return f"reports accuracy {accuracy}, outside [0, 1]"
    return count_problem(n, known_test, "test samples")


def known_size(sizes: Mapping[int, tuple[int, int]], pid: int, which: int) -> int | None:
    """Client ``pid``'s training (``which`` 0) or local test (1) sample count, where known."""
    return sizes[pid][which] if pid in sizes else None


def size_share(sizes: Mapping[int, tuple[int, int]], pid: int) -> float:
    """Client ``pid``'s training samples over the mean of every client's (``sizes``: pid -> (training, local
    test)); 1.0 where its size is not known or is none."""
    mean = sum(train for train, _ in sizes.values()) / max(1, len(sizes))
    return sizes[pid][0] / mean if pid in sizes and sizes[pid][0] > 0 else 1.0


def screen_evaluations(
    answers: Sequence[Any], sizes: Mapping[int, tuple[int, int]]
) -> tuple[list[tuple[int, float, int, float]], list[dict[str, Any]]]:
    """(partition id, loss, test samples, accuracy) of the evaluations (each with ``pid``, ``loss``,
    ``num_examples`` and ``accuracy`` as reported) that may be counted, and the others with their reason:
    left out, so that the evaluation counts as missing those clients."""
    valid, rejected = [], []
    for a in answers:
        problem = evaluation_problem(a.loss, a.num_examples, a.accuracy, known_size(sizes, a.pid, 1))
        if problem is None:
            valid.append((a.pid, float(a.loss), int(a.num_examples), float(a.accuracy)))
        else:
            rejected.append({"partition": a.pid, "reason": problem})
    return valid, rejected


def mean_metrics(metrics: list[dict]) -> dict[str, float]:
    """The mean of each training metric over the clients that reported it (bookkeeping left out)."""
    keys = {
        k
        for m in metrics
        for k in m
        if k not in NOT_TRAINING_METRICS and not k.endswith("-version") and isinstance(m[k], (int, float))
    }
    return {k: float(np.mean([m[k] for m in metrics if k in m])) for k in sorted(keys)}
