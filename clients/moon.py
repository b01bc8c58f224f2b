"""MOON (Li et al. 2021). The projection layers are part of the model: the representation is
z = P(phi(x)) with P a 2-layer MLP (moon-proj-hidden 256, moon-proj-out 128), and the classifier reads z.
Loss: CE + mu * l_con with

    l_con = -log(e^{cos(z, z_glob)/tau} / (e^{cos(z, z_glob)/tau} + e^{cos(z, z_prev)/tau})),

z_glob from the round's global model, z_prev from THIS client's own last local model (kept in
Flower's per-node state). Before a client's first round it has no last model: the global model
stands in, so l_con is the constant log 2 and adds no gradient (as in MOON's code)."""

from __future__ import annotations

import copy

import numpy as np
import torch
from flwr.common import ArrayRecord
from torch import nn
from torch.nn import functional as F

from fedbr_flwr.losses import moon_contrastive_loss
from fedbr_flwr.model import SplitModel
from fedbr_flwr.registry import register_client
from fedbr_flwr.training import Algorithm, frozen_copy, get_weights, set_weights

from .base import BaseClient


def moon_model(backbone: SplitModel, cfg: dict) -> SplitModel:
    d, hidden, out = backbone.feature_dim, cfg["moon-proj-hidden"], cfg["moon-proj-out"]
    features = nn.Sequential(backbone.features, nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, out))
    return SplitModel(features, out, backbone.classifier.out_features)


class Moon(Algorithm):
    def __init__(self, model: SplitModel, cfg: dict, previous_features: nn.Module | None):
        super().__init__(model, cfg)
        self.global_features = frozen_copy(model.features)
        self.previous_features = previous_features if previous_features is not None else self.global_features
        self.mu, self.tau = cfg["moon-mu"], cfg["moon-tau"]

    def update(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        z = self.model.features(x)
        ce = F.cross_entropy(self.model.classifier(z), y)
        with torch.no_grad():
            z_global, z_previous = self.global_features(x), self.previous_features(x)
        con = moon_contrastive_loss(z, z_global, z_previous, self.tau)
        loss = ce + self.mu * con
        self.step(loss)
        return {"loss": loss.detach(), "ce": ce.detach(), "con": con.detach()}


PREVIOUS_KEY = "moon-previous"


@register_client("moon")
class MoonClient(BaseClient):
    state_keys = (PREVIOUS_KEY,)
    algorithm = Moon

    @classmethod
    def wrap_model(cls, backbone, cfg):
        return moon_model(backbone, cfg)

    def __init__(self, cfg, data, device, state=None):
        super().__init__(cfg, data, device, state)
        self.previous = copy.deepcopy(self.model.features).requires_grad_(False)  # reloaded each round

    def make_algorithm(self, server_round: int, config: dict) -> Moon:
        previous = None
        if PREVIOUS_KEY in self.state:
            set_weights(self.previous, self.state[PREVIOUS_KEY].to_numpy_ndarrays())
            previous = self.previous.eval()
        return Moon(self.model, self.cfg, previous)

    def after_fit(self, algorithm: Moon) -> list[np.ndarray]:
        self.state[PREVIOUS_KEY] = ArrayRecord(get_weights(self.model.features))
        return []
