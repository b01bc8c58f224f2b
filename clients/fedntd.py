"""FedNTD (Lee et al. 2022): cross-entropy plus beta tau^2 KL between the round-start global model's
and the local model's softened predictions over the NOT-true classes only. The server is FedAvg's."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from fedbr_flwr.losses import not_true_distillation_loss
from fedbr_flwr.registry import register_client
from fedbr_flwr.training import Algorithm, frozen_copy

from .base import BaseClient


class FedNTD(Algorithm):
    def __init__(self, model, cfg):
        super().__init__(model, cfg)
        self.global_model = frozen_copy(model)  # as received this round

    def update(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.model(x)
        ce = F.cross_entropy(logits, y)
        with torch.no_grad():
            global_logits = self.global_model(x)
        ntd = not_true_distillation_loss(logits, global_logits, y, self.cfg["fedntd-tau"])
        loss = ce + self.cfg["fedntd-beta"] * ntd
        self.step(loss)
        return {"loss": loss.detach(), "ce": ce.detach(), "ntd": ntd.detach()}


@register_client("fedntd")
class FedNTDClient(BaseClient):
    algorithm = FedNTD
