"""FedAvg client: K plain SGD steps on cross-entropy."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from fedbr_flwr.registry import register_client
from fedbr_flwr.training import Algorithm

from .base import BaseClient


class FedAvg(Algorithm):
    def update(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = F.cross_entropy(self.model(x), y)
        self.step(loss)
        return {"loss": loss}


@register_client("fedavg")
class FedAvgClient(BaseClient):
    algorithm = FedAvg
