"""FedMix's server: before round 1 it sends every client the named request 'fedmix-means' for its mean
data, concatenates the answers in partition order and broadcasts the pool once; the model is averaged
as in FedAvg."""

from __future__ import annotations

import numpy as np

from fedbr_flwr.core.config import common
from fedbr_flwr.core.registry import register_strategy
from fedbr_flwr.data.catalog import INFO
from fedbr_flwr.server.updates import images_problem, known_size, soft_labels_problem

from .base import FederatedStrategy


@register_strategy("fedmix")
class FedMixStrategy(FederatedStrategy):
    shared_name = "fedmix"

    def make_shared_data(self, server_round: int) -> tuple[np.ndarray, np.ndarray]:
        pids = sorted(self.federation.clients_by_pid)
        info = INFO[common(self.cfg).dataset]

        def mean_data_problem(pid: int, arrays: dict[str, np.ndarray]) -> str | None:
            x = arrays.get("x")
            n = known_size(self.federation.sizes, pid, 0)  # its n // M means (clients/fedmix.py), where n is known
            problem = images_problem(x, None if n is None else max(1, n // self.settings.m), info)
            if problem is not None or x is None:
                return problem
            return soft_labels_problem(arrays.get("y"), len(x), info.num_classes)

        answers = self.federation.request(
            "fedmix-means",
            {pid: {"version": server_round} for pid in pids},
            server_round,
            "its mean data",
            mean_data_problem,
        )
        if not answers:
            raise RuntimeError("no client sent mean data that can be used (the lines above say why)")
        x = np.concatenate([answers[pid]["x"] for pid in pids if pid in answers]).astype(np.float32)
        y = np.concatenate([answers[pid]["y"] for pid in pids if pid in answers]).astype(np.float32)
        self.recorder.progress.emit(
            "info",
            f"FedMix: {len(x)} mean samples (M = {self.settings.m}) from {len(answers)} clients, sent to each once",
        )
        return x, y
