"""SCAFFOLD's server: the model is averaged (global lr 1); the server control variate c, laid out
like the model's state and zero at first, is sent after the model to every sampled client and moves
by the clients' returned changes: c <- c + (1/N) sum_{i in S} Delta c_i, N = all clients."""

from __future__ import annotations

import numpy as np

from fedbr_flwr.checkpoint import flatten, unflatten
from fedbr_flwr.registry import register_strategy
from fedbr_flwr.training import get_weights

from .base import FederatedStrategy, weighted_mean


def update_server_control(control: list[np.ndarray], deltas: list[list[np.ndarray]], num_clients: int
                          ) -> list[np.ndarray]:
    """c + sum_i Delta c_i / N (Karimireddy et al. 2020, Algorithm 1 line 17)."""
    return [(c + sum(d[k] for d in deltas) / num_clients).astype(c.dtype) for k, c in enumerate(control)]


@register_strategy("scaffold")
class ScaffoldStrategy(FederatedStrategy):
    def __init__(self, cfg, recorder, model, global_test):
        super().__init__(cfg, recorder, model, global_test)
        self.control = [np.zeros_like(a) for a in get_weights(self.model)]

    def fit_extras(self) -> list[np.ndarray]:
        return self.control

    def returned_extra_shapes(self):
        return [c.shape for c in self.control]

    def checkpoint_state(self):
        return {**super().checkpoint_state(), **flatten("scaffold/control", self.control)}

    def restore_state(self, arrays):
        super().restore_state(arrays)
        self.control = unflatten(arrays, "scaffold/control")

    def aggregate(self, arrays: list[list[np.ndarray]], weights: list[float]) -> list[np.ndarray]:
        n = self.num_model_arrays
        bad = [pid for pid, a in zip(self.result_pids, arrays) if len(a) != 2 * n]
        if bad:
            raise ValueError(f"SCAFFOLD clients {bad} did not return {n} model arrays + {n} control-variate changes")
        self.control = update_server_control(self.control, [a[n:] for a in arrays], self.cfg["num-clients"])
        self.server_metrics = {"control-norm": float(np.sqrt(sum(float((c ** 2).sum()) for c in self.control)))}
        return weighted_mean([a[:n] for a in arrays], weights)
