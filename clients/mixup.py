"""Mixup (Zhang et al. 2018) as a component: each local batch is mixed with a permutation of itself,
lam ~ Beta(a, a) (a = mixup-alpha, 0.2), and the loss mixes the two labels' cross-entropies.
``strategy=mixup`` is FedAvg + Mixup (the DG baseline); ``fedbr-with=mixup`` is FedBR on the Mixup
backbone (the local batch is mixed; the pseudo-data is not)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedbr_flwr.core.algorithm import Batch, LocalComponent, RoundContext
from fedbr_flwr.core.registry import register_component, register_variant
from fedbr_flwr.core.settings import POSITIVE, Settings, setting


@dataclass(frozen=True)
class MixupSettings(Settings):
    alpha: float = setting("mixup-alpha", 0.2, "Mixup's Beta(a, a) parameter", check=POSITIVE)


def mixup_batch(
    x: torch.Tensor, y: torch.Tensor, lam: float, perm: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lam * x + (1 - lam) * x[perm], y, y[perm]); the loss mixes the two labels with lam."""
    return lam * x + (1.0 - lam) * x[perm], y, y[perm]


class MixupSampler:
    """lam ~ Beta(a, a) on the host (a plain float, so no device sync) and a permutation of the batch
    on the device, both seeded."""

    def __init__(self, alpha: float, seed: int, device: torch.device):
        self.alpha = alpha
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, batch_size: int) -> tuple[float, torch.Tensor]:
        lam = float(self.rng.beta(self.alpha, self.alpha))
        return lam, torch.randperm(batch_size, generator=self.generator, device=self.generator.device)


@register_component("mixup")
class Mixup(LocalComponent):
    Settings = MixupSettings

    def start_round(self, ctx: RoundContext) -> None:
        self.sampler = MixupSampler(self.settings.alpha, ctx.seed("mixup"), ctx.device)

    def transform(self, batch: Batch) -> Batch:
        lam, perm = self.sampler(len(batch.y))
        x, y_a, y_b = mixup_batch(batch.x, batch.y, lam, perm)
        return Batch(x, y_a, y_b, lam, 1.0 - lam)


register_variant("mixup", "fedavg", ("mixup",), "FedAvg + Mixup")
