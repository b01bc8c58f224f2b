"""FedAvg + Mixup (the DG baseline): each local batch is mixed with a permutation of itself,
lam ~ Beta(a, a) (a = mixup-alpha, 0.2), and the loss mixes the two labels' cross-entropies."""

from __future__ import annotations

import torch

from fedbr_flwr.losses import MixupSampler, mixup_batch, mixup_cross_entropy
from fedbr_flwr.registry import register_client
from fedbr_flwr.training import Algorithm, step_seed

from .base import BaseClient


class Mixup(Algorithm):
    def __init__(self, model, cfg, seed: int):
        super().__init__(model, cfg)
        self.sampler = MixupSampler(cfg["mixup-alpha"], seed, next(model.parameters()).device)

    def update(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        lam, perm = self.sampler(len(y))
        x_mixed, y_a, y_b = mixup_batch(x, y, lam, perm)
        loss = mixup_cross_entropy(self.model(x_mixed), y_a, y_b, lam)
        self.step(loss)
        return {"loss": loss.detach()}


@register_client("mixup")
class MixupClient(BaseClient):
    algorithm = Mixup

    def make_algorithm(self, server_round: int, config: dict) -> Mixup:
        return Mixup(self.model, self.cfg, step_seed(self.cfg["seed"], server_round, self.pid, 104))
