"""FedDyn's server: h <- h - alpha/m sum_k (w_k - w_round) over the clients that answered (m: all
clients); the new global model is the mean of theirs minus h / alpha. Under a robust ``aggregation`` the
mean is the rule's aggregate and the sum of the drifts |S| times its distance from w_round."""

import numpy as np

from fedbr_flwr.registry import register_strategy

from .base import FederatedStrategy


@register_strategy("feddyn")
class FedDynStrategy(FederatedStrategy):
    def __init__(self, cfg, recorder, modules, server_tests):
        super().__init__(cfg, recorder, modules, server_tests)
        self.h = {name: np.zeros_like(a) for name, a in self.initial_arrays().items()}

    def aggregate(self, updates, weights):
        alpha, m = self.settings.alpha, self.cfg["num-clients"]  # its settings, declared in clients/feddyn.py
        mean = super().aggregate(updates, weights)
        for name, h in self.h.items():
            if self.plan.is_mean:
                drift = sum(u.arrays[name] - self.round_global[name] for u in updates)
            else:
                drift = len(updates) * (mean[name] - self.round_global[name])
            self.h[name] = (h - alpha / m * drift).astype(h.dtype)
        return {name: (mean[name] - self.h[name] / alpha).astype(mean[name].dtype) for name in mean}

    def checkpoint_state(self):
        return {**super().checkpoint_state(), **{f"feddyn/h/{name}": h for name, h in self.h.items()}}

    def restore_state(self, arrays):
        super().restore_state(arrays)
        self.h = {name: arrays[f"feddyn/h/{name}"] for name in self.h}
