"""FedProx (Li et al. 2020): cross-entropy plus mu/2 ||w - w_round_start||^2, so that each step's
gradient gains mu (w - w_round_start). The server is FedAvg's."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from fedbr_flwr.losses import proximal_term
from fedbr_flwr.registry import register_client
from fedbr_flwr.training import Algorithm

from .base import BaseClient


class FedProx(Algorithm):
    def __init__(self, model, cfg):
        super().__init__(model, cfg)
        self.mu = cfg["fedprox-mu"]
        self.params = list(model.parameters())
        self.anchor = [p.detach().clone() for p in self.params]  # the weights received this round

    def update(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        ce = F.cross_entropy(self.model(x), y)
        prox = proximal_term(self.params, self.anchor)
        loss = ce + 0.5 * self.mu * prox
        self.step(loss)
        return {"loss": loss.detach(), "ce": ce.detach(), "prox": prox.detach()}


@register_client("fedprox")
class FedProxClient(BaseClient):
    algorithm = FedProx
