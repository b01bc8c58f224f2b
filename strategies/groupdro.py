"""GroupDRO in FL: the server keeps a weight p_i per client (uniform at first). After each round,
p_i <- p_i exp(eta loss_i) for every client that answered (loss_i: the training loss of its first local
step, at the global model it received, as in the authors' code: ``first-loss``, which its client, FedAvg's
otherwise, reports), then p is normalised, and the round's models are averaged with weights p_i. Under
multi-Krum only the clients it keeps move p: the others' updates, and so their reports, are not used.
Its settings (``groupdro-eta``, ``groupdro-mixup``) are declared by its client, which reads the second."""

from __future__ import annotations

import numpy as np

from fedbr_flwr.core.config import common
from fedbr_flwr.core.registry import register_strategy

from .base import FederatedStrategy

LOG_BOUND = 1e300  # a log-weight beyond it (e^1e300) is no weight any client can tell apart


class ClientWeights:
    """Flower-free: the exponentiated-gradient weights over clients, p, and their logs up to a constant, which
    keep the ratios of weights that underflow to 0 in p next to a much larger one."""

    def __init__(self, num_clients: int, eta: float):
        self.p = np.full(num_clients, 1.0 / num_clients)
        self.log_w = np.zeros(num_clients)  # log p + a constant (0 at the largest)
        self.eta = eta

    def update(self, losses: dict[int, float]) -> None:
        """p_i <- p_i exp(eta loss_i), normalised. Where the products overflow (a client that reports a loss of
        1e6, finite and well-formed) or all underflow (losses of -1e6), from the logs: p stays a distribution
        instead of turning NaN for good."""
        factors = np.ones_like(self.p)
        with np.errstate(over="ignore"):
            for pid, loss in losses.items():
                factors[pid] = np.exp(self.eta * loss)
                self.log_w[pid] = np.clip(self.log_w[pid] + self.eta * loss, -LOG_BOUND, LOG_BOUND)
            grown = self.p * factors
        self.log_w -= self.log_w.max()  # in [-2 LOG_BOUND, 0]: finite, whatever losses were reported
        total = grown.sum()
        if not (np.isfinite(total) and total > 0):
            grown = np.exp(self.log_w)  # the largest is e^0 = 1: the sum is at least 1
            total = grown.sum()
        self.p = grown / total

    def weights(self, pids: list[int], used: list[int]) -> list[float]:
        """p_i for each of ``pids``, where a mean takes those of ``used``; if theirs all underflowed to 0 (another
        client's loss took the whole weight), their ratios from the logs (0 for the others)."""
        if self.p[used].sum() > 0:
            return [float(self.p[pid]) for pid in pids]
        top = self.log_w[used].max()
        return [float(np.exp(self.log_w[pid] - top)) if pid in used else 0.0 for pid in pids]


@register_strategy("groupdro")
class GroupDROStrategy(FederatedStrategy):
    required_metrics = ("first-loss",)

    def __init__(self, cfg, recorder, modules, server_tests):
        super().__init__(cfg, recorder, modules, server_tests)
        self.client_weights: ClientWeights | None = None  # sized at its first round

    def checkpoint_state(self):
        state = super().checkpoint_state()
        if self.client_weights is None:
            return state
        return {**state, "groupdro/p": self.client_weights.p.copy(), "groupdro/log-w": self.client_weights.log_w.copy()}

    def restore_state(self, arrays):
        super().restore_state(arrays)
        if "groupdro/p" in arrays:
            weights = self.client_weights = ClientWeights(common(self.cfg).num_clients, self.settings.eta)
            weights.p = arrays["groupdro/p"].astype(np.float64).copy()
            tiny = np.finfo(np.float64).tiny  # a checkpoint from before the logs: from p
            weights.log_w = arrays["groupdro/log-w"].copy() if "groupdro/log-w" in arrays else np.log(weights.p + tiny)

    def aggregate(self, rnd):
        """p moves by the first-step losses of the updates the round uses (a client Krum drops is not believed),
        and the round's models are averaged with weights p_i."""
        if self.client_weights is None:
            self.client_weights = ClientWeights(common(self.cfg).num_clients, self.settings.eta)
        self.client_weights.update({u.pid: float(u.metrics["first-loss"]) for u in rnd.used})
        self.server_metrics = {f"p-{pid}": float(p) for pid, p in enumerate(self.client_weights.p)}
        weights = self.client_weights.weights([u.pid for u in rnd.updates], [u.pid for u in rnd.used])
        return rnd.combine(self.global_names, relative_to=rnd.sent, weights=weights)
