"""FedCM (Xu et al. 2021): client-level momentum. Every local step moves along
alpha g + (1 - alpha) Delta, where Delta is the global update direction of the previous round
(sent by the server after the model, in gradient units; zero in round 1)."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from fedbr_flwr.losses import blend_with_global_momentum
from fedbr_flwr.registry import register_client
from fedbr_flwr.training import Algorithm, parameter_tensors

from .base import BaseClient


class FedCM(Algorithm):
    def __init__(self, model, cfg, global_momentum: list[torch.Tensor]):
        super().__init__(model, cfg)
        self.params = list(model.parameters())
        self.global_momentum = global_momentum
        self.alpha = cfg["fedcm-alpha"]

    def update(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = F.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        blend_with_global_momentum([p.grad for p in self.params], self.global_momentum, self.alpha)
        self.optimizer.step()
        return {"loss": loss.detach()}


@register_client("fedcm")
class FedCMClient(BaseClient):
    algorithm = FedCM
    takes_extras = True  # Delta, after the model

    def make_algorithm(self, server_round: int, config: dict) -> FedCM:
        return FedCM(self.model, self.cfg, parameter_tensors(self.model, self.extras, self.device))
