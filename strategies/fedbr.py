"""FedBR's server (Algorithm 1 lines 13-15): phi, omega and theta are all averaged (the base rule
over the whole array list: model arrays, then the projection head's). It also builds and
distributes the pseudo-data:

* ``rsm``: at round 1 (or every round with ``pseudo-refresh=every-round``) the server asks every
  client, through a Flower ``get_parameters`` message, for its share of the B means of M samples,
  and assembles them in partition order.
* ``mixture``: the server averages M samples of the public proxy dataset, B times.

The pseudo-batch rides in the fit config (``pseudo-payload``) only to clients that have not yet
confirmed its current version; they keep it in Flower's per-node state.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from flwr.common import GetParametersIns, parameters_to_ndarrays

from clients.fedbr import build_head
from fedbr_flwr.registry import register_strategy
from fedbr_flwr.run_io import save_npz_atomically
from fedbr_flwr.training import get_weights
from pseudodata import build as build_pseudo_data
from pseudodata import encode
from pseudodata.mixture import load_proxy

from .base import FederatedStrategy

log = logging.getLogger("flwr")


@register_strategy("fedbr")
class FedBRStrategy(FederatedStrategy):
    def __init__(self, cfg, recorder, model, global_test):
        super().__init__(cfg, recorder, model, global_test)
        self.head = build_head(cfg, model.feature_dim)  # built right after the seeded model
        self.pseudo: tuple[np.ndarray, np.ndarray] | None = None
        self.pseudo_version = 0
        self.payload = b""
        self.proxy: torch.Tensor | None = None  # the public proxy dataset (mixture), loaded once
        self.client_version: dict[int, int] = {}  # pseudo-data version each client confirmed holding

    def extra_initial_weights(self) -> list[np.ndarray]:
        return [] if self.head is None else get_weights(self.head)

    def configure_fit(self, server_round, parameters, client_manager):
        if not self.clients_by_pid:
            self._discover(client_manager)
        if self.pseudo is None or self.cfg["pseudo-refresh"] == "every-round":
            self.refresh_pseudo_data(server_round)
        return super().configure_fit(server_round, parameters, client_manager)

    def fit_config(self, server_round: int, pid: int) -> dict[str, Any]:
        config = {**super().fit_config(server_round, pid), "pseudo-version": self.pseudo_version}
        if self.client_version.get(pid) != self.pseudo_version:
            config["pseudo-payload"] = self.payload
        return config

    def aggregate_fit(self, server_round, results, failures):
        returned = set()
        for _, res in results:
            pid = int(res.metrics["partition-id"])
            returned.add(pid)
            self.client_version[pid] = int(res.metrics.get("pseudo-version", -1))
        for pid in set(self.sampled) - returned:  # it may have lost its state: send it again next time
            self.client_version.pop(pid, None)
        return super().aggregate_fit(server_round, results, failures)

    # ------------------------------------------------------------ pseudo-data
    def refresh_pseudo_data(self, server_round: int) -> None:
        if self.cfg["pseudo-data"] == "mixture" and self.proxy is None:
            self.proxy = load_proxy(self.cfg)
        x, y = build_pseudo_data(self.cfg, server_round, list(self.clients_by_pid), self.collect_rsm, self.proxy)
        self.pseudo, self.pseudo_version, self.payload = (x, y), server_round, encode(x, y)
        save_npz_atomically(self.recorder.out_dir / "pseudo_data.npz", x=x, y=y, version=server_round)
        log.info("[fedbr] round %d: %s pseudo-data, %d samples of %d inputs each, sent to clients as needed",
                 server_round, self.cfg["pseudo-data"], len(x), int(np.prod(x.shape[1:])))

    def collect_rsm(self, counts: dict[int, int], version: int) -> list[np.ndarray]:
        """Ask each client for its share of the means through a Flower message, in parallel."""

        def ask(pid: int) -> np.ndarray:
            ins = GetParametersIns({"pseudo-request": "rsm", "count": counts[pid], "pseudo-m": self.cfg["pseudo-m"],
                                    "version": version})
            try:
                res = self.clients_by_pid[pid].get_parameters(ins, None, version)
            except Exception as exc:  # the node's ClientApp raised: its message says why
                raise RuntimeError(f"client {pid} could not send its pseudo-data means: {exc}") from None
            if res.status.code.value != 0:
                raise RuntimeError(f"client {pid} could not send its pseudo-data means: {res.status.message}")
            (means,) = parameters_to_ndarrays(res.parameters)
            if len(means) != counts[pid]:
                raise RuntimeError(f"client {pid} sent {len(means)} means, {counts[pid]} were asked for")
            return means

        with ThreadPoolExecutor(max_workers=min(32, len(counts))) as pool:
            return list(pool.map(ask, list(counts)))
