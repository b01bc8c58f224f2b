"""FedBR's server (Algorithm 1 lines 13-15): phi, omega and theta are all averaged (the base rule
over the whole array list: model arrays, then the projection head's). It also builds and
distributes the pseudo-data:

* ``rsm``: at round 1 (or every round with ``pseudo-refresh=every-round``) the server asks every
  client, through a Flower ``get_parameters`` message, for its share of the B means of M samples,
  and assembles them in partition order.
* ``mixture``: the server averages M samples of the public proxy dataset, B times.

The pseudo-batch rides in the fit config (``pseudo-payload``) only to clients that have not yet
confirmed its current version; they keep it in Flower's per-node state.

With ``fedbr-with=fedcm`` the server also keeps FedCM's global update direction over (phi, omega)
and sends it after the weights.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from clients.fedbr import build_head
from fedbr_flwr.broadcast import SharedData
from fedbr_flwr.registry import register_strategy
from fedbr_flwr.training import get_weights
from pseudodata import build as build_pseudo_data
from pseudodata.mixture import load_proxy

from .base import FederatedStrategy
from .fedcm import GlobalMomentumMixin

log = logging.getLogger("flwr")


@register_strategy("fedbr")
class FedBRStrategy(GlobalMomentumMixin, FederatedStrategy):
    def __init__(self, cfg, recorder, model, global_test):
        super().__init__(cfg, recorder, model, global_test)
        self.momentum_on = cfg["fedbr-with"] == "fedcm"  # FedBR + FedCM: Delta over (phi, omega)
        if self.momentum_on:
            self.init_momentum()
        self.head = build_head(cfg, model.feature_dim)  # built right after the seeded model
        self.shared = SharedData("pseudo")
        self.proxy: torch.Tensor | None = None  # the public proxy dataset (mixture), loaded once

    def extra_initial_weights(self) -> list[np.ndarray]:
        return [] if self.head is None else get_weights(self.head)

    def shared_is_stale(self, server_round: int) -> bool:
        return self.shared.arrays is None or self.cfg["pseudo-refresh"] == "every-round"

    def make_shared_data(self, server_round: int) -> tuple[np.ndarray, np.ndarray]:
        if self.cfg["pseudo-data"] == "mixture" and self.proxy is None:
            self.proxy = load_proxy(self.cfg)
        x, y = build_pseudo_data(self.cfg, server_round, list(self.clients_by_pid), self.collect_rsm, self.proxy)
        log.info("[fedbr] round %d: %s pseudo-data, %d samples of %d inputs each, sent to clients as needed",
                 server_round, self.cfg["pseudo-data"], len(x), int(np.prod(x.shape[1:])))
        return x, y

    def collect_rsm(self, counts: dict[int, int], version: int) -> list[np.ndarray]:
        """Ask each client for its share of the means through a Flower message, in parallel."""
        requests = {pid: {"pseudo-request": "rsm", "count": n, "pseudo-m": self.cfg["pseudo-m"], "version": version}
                    for pid, n in counts.items()}
        answers = self.request_arrays(requests, version, "its pseudo-data means")
        for pid, (means,) in answers.items():
            if len(means) != counts[pid]:
                raise RuntimeError(f"client {pid} sent {len(means)} means, {counts[pid]} were asked for")
        return [answers[pid][0] for pid in counts]
