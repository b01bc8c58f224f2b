"""GroupDRO in FL: the server keeps a weight p_i per client (uniform at first). After each round,
p_i <- p_i exp(eta loss_i) for every client that answered (loss_i: the training loss of its first local
step, at the global model it received, as in the authors' code: ``first-loss``, which its client, FedAvg's
otherwise, reports), then p is normalised, and the round's models are averaged with weights p_i.
Its settings (``groupdro-eta``, ``groupdro-mixup``) are declared by its client, which reads the second."""

from __future__ import annotations

import numpy as np

from fedbr_flwr.core.config import common
from fedbr_flwr.core.registry import register_strategy

from .base import FederatedStrategy


class ClientWeights:
    """Flower-free: the exponentiated-gradient weights over clients."""

    def __init__(self, num_clients: int, eta: float):
        self.p = np.full(num_clients, 1.0 / num_clients)
        self.eta = eta

    def update(self, losses: dict[int, float]) -> None:
        """p_i <- p_i exp(eta loss_i), normalised. Where a product overflows (a client that reports a loss of
        1e6, finite and well-formed), in log space: p stays a distribution instead of turning NaN for good."""
        factors = np.ones_like(self.p)
        with np.errstate(over="ignore"):
            for pid, loss in losses.items():
                factors[pid] = np.exp(self.eta * loss)
            grown = self.p * factors
        if np.all(np.isfinite(grown)):
            self.p = grown / grown.sum()
            return
        with np.errstate(divide="ignore"):  # a weight that underflowed to 0 is log 0 = -inf, and stays 0
            log_p = np.log(self.p)
        for pid, loss in losses.items():
            log_p[pid] += self.eta * loss
        grown = np.exp(log_p - log_p.max())
        self.p = grown / grown.sum()


@register_strategy("groupdro")
class GroupDROStrategy(FederatedStrategy):
    required_metrics = ("first-loss",)

    def __init__(self, cfg, recorder, modules, server_tests):
        super().__init__(cfg, recorder, modules, server_tests)
        self.client_weights: ClientWeights | None = None  # sized at discovery

    def checkpoint_state(self):
        state = super().checkpoint_state()
        return state if self.client_weights is None else {**state, "groupdro/p": self.client_weights.p.copy()}

    def restore_state(self, arrays):
        super().restore_state(arrays)
        if "groupdro/p" in arrays:
            self.client_weights = ClientWeights(common(self.cfg).num_clients, self.settings.eta)
            self.client_weights.p = arrays["groupdro/p"].astype(np.float64).copy()

    def aggregation_weights(self, updates):
        if self.client_weights is None:
            self.client_weights = ClientWeights(common(self.cfg).num_clients, self.settings.eta)
        self.client_weights.update({u.pid: float(u.metrics["first-loss"]) for u in updates})
        self.server_metrics = {f"p-{pid}": float(p) for pid, p in enumerate(self.client_weights.p)}
        return [float(self.client_weights.p[u.pid]) for u in updates]
