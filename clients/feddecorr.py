"""FedDecorr (Shi et al. 2023): cross-entropy plus w ||K||_F^2 / d^2, K the correlation matrix of the
batch's z-scored features. The server is FedAvg's."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from fedbr_flwr.losses import decorrelation_loss
from fedbr_flwr.registry import register_client
from fedbr_flwr.training import Algorithm

from .base import BaseClient


class FedDecorr(Algorithm):
    def update(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        z = self.model.features(x)
        ce = F.cross_entropy(self.model.classifier(z), y)
        decorr = decorrelation_loss(z)
        loss = ce + self.cfg["feddecorr-weight"] * decorr
        self.step(loss)
        return {"loss": loss.detach(), "ce": ce.detach(), "decorr": decorr.detach()}


@register_client("feddecorr")
class FedDecorrClient(BaseClient):
    algorithm = FedDecorr
