"""FedMix's server: before round 1 it sends every client the named request 'fedmix-means' for its mean
data, concatenates the answers in partition order and broadcasts the pool once; the model is averaged
as in FedAvg."""

from __future__ import annotations

import numpy as np

from fedbr_flwr.core.registry import register_strategy

from .base import FederatedStrategy


@register_strategy("fedmix")
class FedMixStrategy(FederatedStrategy):
    shared_name = "fedmix"

    def make_shared_data(self, server_round: int) -> tuple[np.ndarray, np.ndarray]:
        pids = sorted(self.federation.clients_by_pid)
        answers = self.federation.request(
            "fedmix-means", {pid: {"version": server_round} for pid in pids}, server_round, "its mean data"
        )
        x = np.concatenate([answers[pid]["x"] for pid in pids]).astype(np.float32)
        y = np.concatenate([answers[pid]["y"] for pid in pids]).astype(np.float32)
        self.recorder.progress.emit(
            "info",
            f"FedMix: {len(x)} mean samples (M = {self.settings.m}) from {len(pids)} clients, sent to each once",
        )
        return x, y
