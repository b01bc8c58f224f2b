"""FedDyn's server: h <- h - alpha/m sum_k (w_k - w_round) over the clients that answered (m: all
clients); the new global model is the mean of theirs minus h / alpha (under a robust ``aggregation``, the
rule's aggregate; the sum is over the clients Krum keeps, the only ones that keep their new g_k, and under the
other rules n = |S| times the aggregate's distance from w_round). Client k trains with alpha_k = alpha * n_mean / n_k
(sent in its fit config), and the model evaluated is the mean of the round's client models, as in the
official code (the served model's global test accuracy: served_global_acc)."""

import numpy as np

from fedbr_flwr.core.config import common
from fedbr_flwr.core.registry import register_strategy
from fedbr_flwr.server.updates import size_share

from .base import FederatedStrategy

ALPHA_K = "feddyn-alpha-k"  # as clients/feddyn.py reads it


@register_strategy("feddyn")
class FedDynStrategy(FederatedStrategy):
    def __init__(self, cfg, recorder, modules, server_tests):
        super().__init__(cfg, recorder, modules, server_tests)
        self.h = {name: np.zeros_like(a) for name, a in self.initial_arrays().items()}
        self.mean = None  # the mean of the last aggregated round's client models: what is reported

    def fit_config(self, server_round, pid):  # alpha_k = alpha / (n_k / n_mean)
        alpha_k = self.settings.alpha / size_share(self.federation.sizes, pid)
        return {**super().fit_config(server_round, pid), ALPHA_K: alpha_k}

    def aggregate(self, rnd):
        alpha, m = self.settings.alpha, common(self.cfg).num_clients  # its settings, declared in clients/feddyn.py
        mean, moved = super().aggregate(rnd), {}
        with np.errstate(over="ignore", invalid="ignore"):  # an Inf is caught by finite_or_kept
            for name, h in self.h.items():
                if rnd.plan.is_mean or rnd.plan.selected is not None:  # the sum itself, over the updates used
                    drift = sum(u.arrays[name] - rnd.sent[name] for u in rnd.used)
                else:  # a per-coordinate rule's or a clipped mean's estimate of it
                    drift = len(rnd.used) * (mean[name] - rnd.sent[name])
                moved[name] = (h - alpha / m * drift).astype(h.dtype)
            new = {name: (mean[name] - moved[name] / alpha).astype(mean[name].dtype) for name in mean}
        self.mean, self.h = mean, self.finite_or_kept(rnd, "FedDyn's h", moved, self.h, new)
        return new if self.h is moved else mean  # h kept: this round serves the clients' mean

    def reported_arrays(self, served):
        return served if self.mean is None else self.mean

    def checkpoint_state(self):
        mean = {f"feddyn/mean/{name}": a for name, a in (self.mean or {}).items()}
        return {**super().checkpoint_state(), **{f"feddyn/h/{name}": h for name, h in self.h.items()}, **mean}

    def restore_state(self, arrays):
        super().restore_state(arrays)
        self.h = {name: arrays[f"feddyn/h/{name}"] for name in self.h}
        if any(key.startswith("feddyn/mean/") for key in arrays):
            self.mean = {name: arrays[f"feddyn/mean/{name}"] for name in self.h}
