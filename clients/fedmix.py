"""FedMix (Yoon et al. 2021). Before round 1 each client shares mean data: n_i // M means of M of
its samples (disjoint groups of a seeded permutation), images and one-hot labels averaged. The server
gathers them from every client and broadcasts the pool once. Each local step pairs the local batch
with as many means drawn from the pool and takes FedMix's loss (``losses.fedmix_loss``: Mixup's
first-order approximation around (1 - lam) x)."""

from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F

from fedbr_flwr.losses import fedmix_loss
from fedbr_flwr.registry import register_client
from fedbr_flwr.training import Algorithm, step_seed

from .base import BaseClient


def mean_data(x: torch.Tensor, y: torch.Tensor, m: int, num_classes: int, generator: torch.Generator
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """n // m means of m samples each (at least one mean, of all samples, when n < m), with the mean of
    the one-hot labels."""
    n = len(y)
    if n == 0:
        raise ValueError("cannot build mean data from a client with no training samples")
    groups = max(1, n // m)
    idx = torch.randperm(n, generator=generator, device=generator.device).to(x.device)[:groups * min(m, n)]
    idx = idx.view(groups, min(m, n))
    return x[idx].mean(dim=1), F.one_hot(y[idx], num_classes).float().mean(dim=1)


class FedMix(Algorithm):
    def __init__(self, model, cfg, mean_x: torch.Tensor, mean_y: torch.Tensor, seed: int):
        super().__init__(model, cfg)
        self.mean_x, self.mean_y = mean_x, mean_y
        self.lam = cfg["fedmix-lambda"]
        self.generator = torch.Generator(device=mean_x.device)
        self.generator.manual_seed(seed)

    def update(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        idx = torch.randint(0, len(self.mean_y), (len(y),), device=self.mean_y.device, generator=self.generator)
        terms = fedmix_loss(self.model, x, y, self.mean_x[idx], self.mean_y[idx], self.lam)
        self.step(terms["loss"])
        return {k: v.detach() for k, v in terms.items()}


@register_client("fedmix")
class FedMixClient(BaseClient):
    algorithm = FedMix

    def get_parameters(self, config: dict) -> list[np.ndarray]:
        if config.get("fedmix-request"):
            generator = torch.Generator(device=self.data.x_train.device)
            generator.manual_seed(step_seed(self.cfg["seed"], int(config["version"]), self.pid, 105))
            x, y = mean_data(self.data.x_train, self.data.y_train, self.cfg["fedmix-m"], self.data.num_classes,
                             generator)
            return [x.cpu().numpy(), y.cpu().numpy()]  # only means leave the client
        return super().get_parameters(config)

    def make_algorithm(self, server_round: int, config: dict) -> FedMix:
        x, y = self.shared("fedmix", config)
        return FedMix(self.model, self.cfg, x, y, step_seed(self.cfg["seed"], server_round, self.pid, 106))
