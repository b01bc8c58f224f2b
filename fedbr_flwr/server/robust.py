"""Robust aggregation rules over named arrays (Flower-free, plain NumPy), and the one place every mean the
strategies take goes through (``RoundPlan.combine``).

Coordinate-wise rules (``median``, ``trimmed-mean``) act on each coordinate of each array alone. Whole-update
rules (``krum``, ``multi-krum``, ``norm-bound``) decide per client from its model update (all of its global
arrays minus the round's, flattened together) and from every other group of arrays the strategy averages
(``JudgedGroup``: SCAFFOLD's control-variate changes, DisTrans' offsets), each group judged in its own scale.
That decision (which clients Krum keeps, how far norm-bound shrinks each group) is made once a round and then
applies to every payload the strategy averages.
docs/robust-aggregation.md describes the rules, their assumptions and their cost."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from .updates import ClientUpdate, Named, named_mean, weighted_mean

RULES = ("mean", "median", "trimmed-mean", "krum", "multi-krum", "norm-bound")
WEIGHTED_RULES = ("mean", "multi-krum", "norm-bound")  # the rules with a weighted form


# ---------------------------------------------------------------- the rules on stacked values


def coordinate_median(stack: np.ndarray) -> np.ndarray:
    """The median of each coordinate over the first axis (the mean of the two middle values for an even count)."""
    return np.median(stack, axis=0)


def trimmed_count(n: int, fraction: float) -> int:
    """How many values trimmed-mean cuts at each end: floor(fraction * n), of the decimal fraction (0.29 * 100 is
    28.999... in binary)."""
    return int(np.floor(fraction * n + 1e-9))


def trimmed_mean(stack: np.ndarray, fraction: float) -> np.ndarray:
    """The mean of each coordinate over the first axis after cutting its ``trimmed_count`` lowest and highest values."""
    cut = trimmed_count(len(stack), fraction)
    return np.sort(stack, axis=0)[cut : len(stack) - cut].mean(axis=0)


def squared_distances(flat: np.ndarray) -> np.ndarray:
    """||x_i - x_j||^2 of the rows of ``flat``, pairwise (pair by pair: one row's worth of memory at a time)."""
    n = len(flat)
    dist = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1, n):
            diff = flat[i] - flat[j]
            dist[i, j] = dist[j, i] = float(diff @ diff)
    return dist


def pooled_distances(groups: Sequence[np.ndarray], byzantine: int) -> np.ndarray:
    """Pairwise squared distances of the rows, over several groups of columns: one group's are ``squared_distances``;
    with more, each group's is divided by the median of its own Krum scores, so that every group counts in its own
    scale and none by its units (more than half the scores are honest clients', whatever f attackers send)."""
    if len(groups) == 1:
        return squared_distances(groups[0])
    total = np.zeros((len(groups[0]), len(groups[0])))
    for flat in groups:
        dist = squared_distances(flat)
        typical = float(np.median(krum_scores(dist, byzantine)))
        total += dist / typical if typical > 0 else dist
    return total


def krum_scores(dist: np.ndarray, byzantine: int) -> np.ndarray:
    """Krum's score of each update (Blanchard et al. 2017) from their pairwise squared distances: the sum of its
    distances to its n - f - 2 closest others."""
    n = len(dist)
    neighbours = n - byzantine - 2
    if n < minimum_updates("krum", byzantine):
        raise ValueError(f"krum needs more than 2f + 2 = {2 * byzantine + 2} updates, got {n}")
    others = np.sort(dist + np.diag(np.full(n, np.inf)), axis=1)[:, :neighbours]
    return others.sum(axis=1)


def krum_select(dist: np.ndarray, byzantine: int, keep: int) -> list[int]:
    """The ``keep`` updates of lowest Krum score (ties: the lower index), in index order."""
    order = np.argsort(krum_scores(dist, byzantine), kind="stable")
    return sorted(int(i) for i in order[:keep])


def clip_scales(norms: np.ndarray, bound: float) -> np.ndarray:
    """min(1, bound / ||u_i||) for each update norm (1 for a zero update)."""
    norms = np.asarray(norms, dtype=np.float64)
    return np.minimum(1.0, np.divide(bound, norms, out=np.ones_like(norms), where=norms > bound))


def minimum_updates(rule: str, byzantine: int, trim: float = 0.1, bound: float = 0.0, judged: bool = False) -> int:
    """The fewest updates the rule can aggregate and still be itself, not the mean of what an attacker chose:
    Krum's n > 2f + 2; three for the median and for norm-bound's multiple of the median norm (of two, the
    median is their mean), which also bounds ``judged`` groups whatever the model's bound; for trimmed-mean,
    enough that it cuts a value at each end; else one."""
    if rule in ("krum", "multi-krum"):
        return 2 * byzantine + 3
    if rule == "median" or (rule == "norm-bound" and (bound <= 0 or judged)):
        return 3
    if rule == "trimmed-mean" and trim > 0:
        return next(n for n in itertools.count(3) if trimmed_count(n, trim) >= 1)
    return 1


# ---------------------------------------------------------------- a round's plan over named arrays


def flat_update(arrays: Mapping[str, np.ndarray], reference: Mapping[str, np.ndarray]) -> np.ndarray:
    """A client's model update as one float64 vector: each floating array minus the round's global one."""
    parts = [
        (arrays[n].astype(np.float64) - reference[n].astype(np.float64)).ravel()
        for n in sorted(reference)
        if reference[n].dtype.kind == "f"
    ]
    return np.concatenate(parts) if parts else np.zeros(0)


@dataclass(frozen=True)
class JudgedGroup:
    """Arrays a client returns beside its model update that the strategy averages, and so that a whole-update rule
    judges too: changes from zero (SCAFFOLD's Delta c_i), or ``centred`` values that update nothing the server
    sent (DisTrans' offsets), whose size is their distance from the round's coordinate-wise median."""

    names: tuple[str, ...]
    centred: bool = False

    def flat(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([arrays[n].astype(np.float64).ravel() for n in self.names])


@dataclass(frozen=True)
class RobustRule:
    """The configured rule and its parameters (``aggregation``, ``trim-fraction``, ``byzantine-clients``,
    ``norm-bound``, ``norm-bound-multiple``)."""

    name: str = "mean"
    trim: float = 0.1
    byzantine: int = 1
    bound: float = 0.0  # 0: a multiple of the round's median update norm
    multiple: float = 1.0

    def plan(
        self,
        updates: Sequence[Mapping[str, np.ndarray]],
        reference: Mapping[str, np.ndarray],
        judged: Sequence[JudgedGroup] = (),
    ) -> "RoundPlan":
        """This round's per-client decisions, from each update's arrays relative to ``reference`` (the round's
        global arrays) and the ``judged`` groups beside them."""
        if self.name not in ("krum", "multi-krum", "norm-bound"):
            return RoundPlan(self)
        if self.name != "norm-bound":
            keep = 1 if self.name == "krum" else len(updates) - self.byzantine
            model = np.stack([flat_update(u, reference) for u in updates])
            dist = pooled_distances([model, *(np.stack([g.flat(u) for u in updates]) for g in judged)], self.byzantine)
            return RoundPlan(self, selected=tuple(krum_select(dist, self.byzantine, keep)))
        norms = np.array([np.linalg.norm(flat_update(u, reference)) for u in updates])  # one update in memory at a time
        bound = self.bound if self.bound > 0 else self.multiple * float(np.median(norms))
        scales = clip_scales(norms, bound)
        group_scales: dict[str, tuple[float, ...]] = {}
        centres: dict[str, np.ndarray] = {}
        for group in judged:
            own, centre = self.clip_group(group, updates, scales)
            group_scales.update({n: tuple(float(x) for x in own) for n in group.names})
            centres.update(centre)
        return RoundPlan(
            self, scales=tuple(float(x) for x in scales), bound=bound, group_scales=group_scales, centres=centres
        )

    def fewest_updates(self, judged: bool = False) -> int:
        """``minimum_updates`` of this rule, with ``judged`` groups beside the model or without."""
        return minimum_updates(self.name, self.byzantine, self.trim, self.bound, judged)

    def clip_group(
        self, group: JudgedGroup, updates: Sequence[Mapping[str, np.ndarray]], model_scales: np.ndarray
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """norm-bound's scale of each client's arrays in a judged ``group``: min(1, B_g / size) with B_g the
        ``multiple`` of the group's median size (in its own units), and at most its model update's scale; and the
        centres of a centred group's arrays (their coordinate-wise medians)."""
        centres = (
            {n: coordinate_median(np.stack([u[n] for u in updates])) for n in group.names} if group.centred else {}
        )
        origin = group.flat(centres) if centres else 0.0
        sizes = np.array([np.linalg.norm(group.flat(u) - origin) for u in updates])
        own = clip_scales(sizes, self.multiple * float(np.median(sizes)))
        return np.minimum(model_scales, own), centres


@dataclass(frozen=True)
class RoundPlan:
    """One round's aggregation: the rule and, for whole-update rules, what it decided per client (by position in
    the round's update list): the clients Krum keeps, or norm-bound's scale of each model update and, in
    ``group_scales``, of each judged array beside it (by name), with the ``centres`` of the centred ones."""

    rule: RobustRule = RobustRule()
    selected: tuple[int, ...] | None = None
    scales: tuple[float, ...] | None = None
    bound: float | None = None
    group_scales: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    centres: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def is_mean(self) -> bool:
        return self.rule.name == "mean"

    def used(self, count: int) -> tuple[int, ...]:
        """The positions, among ``count`` updates, of those the aggregate is made of: the ones Krum keeps, else
        all (a per-coordinate rule sorts every update, norm-bound scales them)."""
        return self.selected if self.selected is not None else tuple(range(count))

    def combine(
        self,
        arrays: Sequence[Mapping[str, np.ndarray]],
        weights: list[float],
        names: list[str],
        relative_to: Mapping[str, np.ndarray] | None = None,
    ) -> Named:
        """The aggregate of the arrays called ``names`` in each of ``arrays`` (one per client, in the round's
        order) under the rule. ``relative_to``: what the arrays are updates of (the round's global arrays;
        None: they are changes themselves, from zero), which norm-bound clips; a judged group's arrays are clipped
        by the group's scales. Under ``mean`` this is ``named_mean``, bit for bit."""
        rule = self.rule.name
        if rule == "mean":
            return named_mean(arrays, weights, names)
        if rule in ("krum", "multi-krum"):
            assert self.selected is not None
            return named_mean([arrays[i] for i in self.selected], [weights[i] for i in self.selected], names)
        if rule == "norm-bound":
            return {n: self.clipped_mean([a[n] for a in arrays], weights, relative_to, n) for n in names}
        out = {}
        for n in names:
            stack = np.stack([a[n].astype(np.float64) for a in arrays])
            value = coordinate_median(stack) if rule == "median" else trimmed_mean(stack, self.rule.trim)
            out[n] = value.astype(arrays[0][n].dtype)
        return out

    def clipped_mean(
        self, values: list[np.ndarray], weights: list[float], relative_to: Mapping[str, np.ndarray] | None, name: str
    ) -> np.ndarray:
        """The weighted mean of ref + s_i (a_i - ref) (ref: ``relative_to[name]``, a judged array's centre, or
        zero; s_i: the model update's scale, or the judged array's); arrays that are not floating (counters) are
        averaged as they are."""
        if values[0].dtype.kind != "f":
            (mean,) = weighted_mean([[v] for v in values], weights)
            return mean
        scales = self.group_scales.get(name, self.scales)
        assert scales is not None
        centre = self.centres.get(name, relative_to[name] if relative_to is not None else None)
        ref = centre.astype(np.float64) if centre is not None else 0.0
        clipped = [ref + s * (v.astype(np.float64) - ref) for v, s in zip(values, scales)]
        (mean,) = weighted_mean([[c] for c in clipped], weights)
        return mean.astype(values[0].dtype)

    def round_entry(self, pids: list[int], skipped: bool) -> dict[str, Any]:
        """rounds.jsonl's ``aggregation`` entry for a round that aggregated ``pids``' updates (none if it skipped)."""
        entry = {} if skipped else self.record(pids)
        return {"aggregation": entry} if entry else {}

    def record(self, pids: list[int]) -> dict[str, Any]:
        """What rounds.jsonl says of this round's aggregation (nothing under ``mean``)."""
        if self.is_mean:
            return {}
        out: dict[str, Any] = {"rule": self.rule.name}
        if self.selected is not None:
            out["selected"] = [pids[i] for i in self.selected]
        if self.scales is not None:
            out["bound"] = self.bound
            smallest = np.min([self.scales, *self.group_scales.values()], axis=0)  # any array of the client clipped
            out["clipped"] = [pid for pid, s in zip(pids, smallest) if s < 1.0]
        if self.rule.name == "trimmed-mean":  # 0 where a round's failures left too few updates to cut one
            out["cut"] = trimmed_count(len(pids), self.rule.trim)
        return out


@dataclass(frozen=True)
class AggregationRound:
    """One round as a strategy's ``aggregate`` sees it: its number, the global arrays sent in it, the accepted
    updates (in partition order), their weights, and the rule's plan for them."""

    number: int
    sent: Named
    updates: list[ClientUpdate]
    weights: list[float]
    plan: RoundPlan

    def combine(self, names: list[str], relative_to: Named | None = None, weights: list[float] | None = None) -> Named:
        """The aggregate of the arrays called ``names`` over the round's updates under the configured rule
        (``aggregation``; ``mean``: the weighted mean): every mean a strategy takes goes through here.
        ``relative_to``: what they are updates of (None: changes, from zero; ``RoundPlan.combine``); ``weights``:
        others than the round's."""
        arrays = [u.arrays for u in self.updates]
        return self.plan.combine(arrays, self.weights if weights is None else weights, names, relative_to)

    @property
    def used(self) -> list[ClientUpdate]:
        """The updates the round's aggregate is made of (``RoundPlan.used``): Krum's picks, else all."""
        return [self.updates[i] for i in self.plan.used(len(self.updates))]
