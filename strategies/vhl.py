"""VHL's server: draws the virtual data once (``clients.vhl.virtual_data``, seeded by the run seed) and
broadcasts it; the model (with its 2C-way classifier) is averaged as in FedAvg."""

from __future__ import annotations

import logging

import numpy as np

from clients.vhl import virtual_data
from fedbr_flwr.broadcast import SharedData
from fedbr_flwr.dataset import INFO
from fedbr_flwr.registry import register_strategy
from fedbr_flwr.training import step_seed

from .base import FederatedStrategy

log = logging.getLogger("flwr")


@register_strategy("vhl")
class VHLStrategy(FederatedStrategy):
    def __init__(self, cfg, recorder, model, global_test):
        super().__init__(cfg, recorder, model, global_test)
        self.shared = SharedData("vhl")

    def make_shared_data(self, server_round: int) -> tuple[np.ndarray, np.ndarray]:
        info = INFO[self.cfg["dataset"]]
        x, y = virtual_data(info.num_classes, info.in_channels, info.image_size, self.cfg["vhl-size"],
                            step_seed(self.cfg["seed"], 109))
        log.info("[fedbr] VHL: %d virtual samples of %d classes, sent to each client once", len(x), info.num_classes)
        return x.numpy(), y.numpy().astype(np.float32)
