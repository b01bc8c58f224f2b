"""FedCM's server: FedAvg of the model, plus the global update direction
Delta = (x_round_start - x_new) / (lr K) (the mean client step, in gradient units; zero before the
first round), sent after the model with the next fit instructions. ``GlobalMomentumMixin`` adds this to
any strategy: FedBR uses it for fedbr-with=fedcm."""

from __future__ import annotations

import numpy as np
from flwr.common import parameters_to_ndarrays

from fedbr_flwr.checkpoint import flatten, unflatten
from fedbr_flwr.registry import register_strategy
from fedbr_flwr.training import get_weights

from .base import FederatedStrategy


def global_update_direction(start: list[np.ndarray], new: list[np.ndarray], lr: float, steps: int
                            ) -> list[np.ndarray]:
    return [((s - n) / (lr * steps)).astype(s.dtype) for s, n in zip(start, new)]


class GlobalMomentumMixin:
    """For a FederatedStrategy: keeps Delta over the model's arrays when ``momentum_on``."""
    momentum_on = False

    def init_momentum(self) -> None:
        self.momentum = [np.zeros_like(a) for a in get_weights(self.model)]
        self.round_start: list[np.ndarray] = []

    def configure_fit(self, server_round, parameters, client_manager):
        if self.momentum_on:
            self.round_start = parameters_to_ndarrays(parameters)[:self.num_model_arrays]
        return super().configure_fit(server_round, parameters, client_manager)

    def fit_extras(self) -> list[np.ndarray]:
        return self.momentum if self.momentum_on else super().fit_extras()

    def checkpoint_state(self):
        state = super().checkpoint_state()
        return {**state, **flatten("fedcm/momentum", self.momentum)} if self.momentum_on else state

    def restore_state(self, arrays):
        super().restore_state(arrays)
        if self.momentum_on:
            self.momentum = unflatten(arrays, "fedcm/momentum")

    def aggregate(self, arrays, weights):
        new = super().aggregate(arrays, weights)
        if self.momentum_on:
            self.momentum = global_update_direction(self.round_start, new[:self.num_model_arrays], self.cfg["lr"],
                                                    self.cfg["local-steps"])
        return new


@register_strategy("fedcm")
class FedCMStrategy(GlobalMomentumMixin, FederatedStrategy):
    momentum_on = True

    def __init__(self, cfg, recorder, model, global_test):
        super().__init__(cfg, recorder, model, global_test)
        self.init_momentum()
