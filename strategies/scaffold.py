"""SCAFFOLD's server: the model is averaged (global lr 1); the server control variate c, named like the
model's state and zero at first, is sent to every sampled client as 'control/<key>' and moves by the
clients' returned changes ('control-delta/<key>'): c <- c + (1/N) sum_{i in S} Delta c_i, N = all clients.
Under a robust ``aggregation`` the sum is n times the rule's aggregate of the Delta c_i (changes, from zero),
n the number of updates the aggregate is made of: |S|, or the clients Krum keeps, the only ones that keep their
new c_i. Krum and norm-bound judge each client's Delta c_i beside its model update (``judged_groups``): Krum
from both, norm-bound scaling each Delta c_i by the smaller of its model update's scale and its own."""

from __future__ import annotations

import numpy as np

from fedbr_flwr.core.config import common
from fedbr_flwr.core.registry import register_strategy
from fedbr_flwr.server.robust import JudgedGroup

from .base import FederatedStrategy

CONTROL, CONTROL_DELTA = "control", "control-delta"  # as the clients name them (clients/scaffold.py)
MODEL = "model/"


def update_server_control(control: np.ndarray, deltas: list[np.ndarray], num_clients: int) -> np.ndarray:
    """c + sum_i Delta c_i / N (Karimireddy et al. 2020, Algorithm 1 line 17)."""
    return (control + sum(deltas) / num_clients).astype(control.dtype)


@register_strategy("scaffold")
class ScaffoldStrategy(FederatedStrategy):
    def __init__(self, cfg, recorder, modules, server_tests):
        super().__init__(cfg, recorder, modules, server_tests)
        self.control = {
            name[len(MODEL) :]: np.zeros_like(a) for name, a in self.initial_arrays().items() if name.startswith(MODEL)
        }

    def round_arrays(self, server_round, global_arrays):
        return {
            **super().round_arrays(server_round, global_arrays),
            **{f"{CONTROL}/{key}": c for key, c in self.control.items()},
        }

    def delta_names(self) -> tuple[str, ...]:
        """The arrays of a client's Delta c_i, as it returns them."""
        return tuple(f"{CONTROL_DELTA}/{key}" for key in self.control)

    @classmethod
    def may_judge_groups(cls, cfg):
        return True

    def judged_groups(self):
        return (JudgedGroup(self.delta_names()),)

    def aggregate(self, rnd):
        if rnd.plan.is_mean:
            deltas = {key: [u.arrays[f"{CONTROL_DELTA}/{key}"] for u in rnd.updates] for key in self.control}
        else:
            # a sum over S by its math: unweighted
            robust = rnd.combine(list(self.delta_names()), weights=[1.0] * len(rnd.updates))
            deltas = {key: [len(rnd.used) * robust[f"{CONTROL_DELTA}/{key}"]] for key in self.control}
        num_clients = common(self.cfg).num_clients
        with np.errstate(over="ignore"):  # an Inf is caught by finite_or_kept
            moved = {key: update_server_control(c, deltas[key], num_clients) for key, c in self.control.items()}
        self.control = self.finite_or_kept(rnd, "the server control variate", moved, self.control)
        with np.errstate(over="ignore"):  # a norm past float32's range is recorded as null
            norm = np.sqrt(sum(float((c**2).sum()) for c in self.control.values()))
        self.server_metrics = {"control-norm": float(norm)}
        return super().aggregate(rnd)

    def checkpoint_state(self):
        return {**super().checkpoint_state(), **{f"scaffold/control/{key}": c for key, c in self.control.items()}}

    def restore_state(self, arrays):
        super().restore_state(arrays)
        self.control = {key: arrays[f"scaffold/control/{key}"] for key in self.control}
