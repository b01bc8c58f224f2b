"""FedMix's server: before round 1 it asks every client for its mean data (a Flower
``get_parameters`` message), concatenates them in partition order and broadcasts the pool once;
the model is averaged as in FedAvg."""

from __future__ import annotations

import logging

import numpy as np

from fedbr_flwr.broadcast import SharedData
from fedbr_flwr.registry import register_strategy

from .base import FederatedStrategy

log = logging.getLogger("flwr")


@register_strategy("fedmix")
class FedMixStrategy(FederatedStrategy):
    def __init__(self, cfg, recorder, model, global_test):
        super().__init__(cfg, recorder, model, global_test)
        self.shared = SharedData("fedmix")

    def make_shared_data(self, server_round: int) -> tuple[np.ndarray, np.ndarray]:
        pids = sorted(self.clients_by_pid)
        answers = self.request_arrays({pid: {"fedmix-request": 1, "version": server_round} for pid in pids},
                                      server_round, "its mean data")
        x = np.concatenate([answers[pid][0] for pid in pids]).astype(np.float32)
        y = np.concatenate([answers[pid][1] for pid in pids]).astype(np.float32)
        log.info("[fedbr] FedMix: %d mean samples (M = %d) from %d clients, sent to each once", len(x),
                 self.cfg["fedmix-m"], len(pids))
        return x, y
