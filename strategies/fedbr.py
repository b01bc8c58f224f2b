"""FedBR's server (Algorithm 1 lines 13-15): phi, omega and theta are all averaged (FedAvg's rule over
'model/...' and 'head/...'). It also builds and distributes the pseudo-data:

* ``rsm``: at round 1 (or every round with ``pseudo-refresh=every-round``) the server sends every
  client the named request 'rsm-means' for its share of the B means of M samples, and assembles them
  in partition order.
* ``mixture``: the server averages M samples of the public proxy dataset, B times.

The pseudo-batch rides in the fit config (``pseudo-payload``) only to clients that have not yet
confirmed its current version; they keep it in their node state. Components listed in ``fedbr-with``
add their server parts (FedCM's global direction) through the base class.
"""

from __future__ import annotations

import numpy as np
import torch

from fedbr_flwr.core.config import common
from fedbr_flwr.core.registry import register_strategy
from fedbr_flwr.data.catalog import INFO
from fedbr_flwr.server.updates import images_problem
from pseudodata import build as build_pseudo_data
from pseudodata.mixture import load_proxy

from .base import FederatedStrategy


@register_strategy("fedbr")
class FedBRStrategy(FederatedStrategy):
    shared_name = "pseudo"

    def __init__(self, cfg, recorder, modules, server_tests):
        super().__init__(cfg, recorder, modules, server_tests)
        self.proxy: torch.Tensor | None = None  # the public proxy dataset (mixture), loaded once

    def shared_is_stale(self, server_round: int) -> bool:
        return self.shared_data().arrays is None or self.settings.pseudo_refresh == "every-round"

    def make_shared_data(self, server_round: int) -> tuple[np.ndarray, np.ndarray]:
        if self.settings.pseudo_data == "mixture" and self.proxy is None:
            self.proxy = load_proxy(self.cfg)
        x, y = build_pseudo_data(
            self.cfg, server_round, list(self.federation.clients_by_pid), self.collect_rsm, self.proxy
        )
        self.recorder.progress.emit(
            "info",
            f"round {server_round}: {self.settings.pseudo_data} pseudo-data, {len(x)} "
            f"samples of {int(np.prod(x.shape[1:]))} inputs each, sent to clients as "
            "needed",
            round=server_round,
        )
        return x, y

    def collect_rsm(self, counts: dict[int, int], version: int) -> list[np.ndarray]:
        """Ask each client for its share of the means (a named request), in parallel; the means of those whose
        answer holds as many images of the dataset's shape and range as were asked for."""
        args = {pid: {"count": n, "pseudo-m": self.settings.pseudo_m, "version": version} for pid, n in counts.items()}
        info = INFO[common(self.cfg).dataset]

        def means_problem(pid: int, arrays: dict[str, np.ndarray]) -> str | None:
            return images_problem(arrays.get("means"), counts[pid], info)

        answers = self.federation.request("rsm-means", args, version, "its pseudo-data means", means_problem)
        return [answers[pid]["means"] for pid in counts if pid in answers]
