"""DANN's server: the model and the domain discriminator (sent after it) are both averaged."""

from __future__ import annotations

import numpy as np

from clients.dann import build_discriminator
from fedbr_flwr.config import ConfigError
from fedbr_flwr.registry import register_strategy
from fedbr_flwr.training import get_weights

from .base import FederatedStrategy


@register_strategy("dann")
class DANNStrategy(FederatedStrategy):
    def extra_initial_weights(self) -> list[np.ndarray]:
        if not self.cfg["num-clients"]:
            raise ConfigError("DANN's discriminator has one output per client: set num-clients")
        # built after the seeded model: the run seed fixes its initial weights too
        discriminator = build_discriminator(self.model.feature_dim, self.cfg["dann-hidden"], self.cfg["num-clients"])
        return get_weights(discriminator)
