"""Losses and batch transforms shared by algorithms (Flower-free, plain tensors)."""

from __future__ import annotations

import numpy as np
import torch
from torch.nn import functional as F


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mean_i -sum_c q_ic log softmax(logits_i)_c, for soft labels q (rows summing to one)."""
    return -(target * F.log_softmax(logits, dim=1)).sum(dim=1).mean()


def mean_output_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """FedAug's AugMean (eq. 3 of the earlier version): cross-entropy between the batch's MEAN softmax
    output and the mean target (the uniform prior for RSM pseudo-data)."""
    mean_prob = F.softmax(logits, dim=1).mean(dim=0)
    return -(target.mean(dim=0) * torch.log(mean_prob.clamp_min(1e-12))).sum()


def fedbr_contrastive_loss(p_local_pseudo: torch.Tensor, p_global_pseudo: torch.Tensor,
                           p_local_real: torch.Tensor, tau1_scale: float, tau2_scale: float) -> torch.Tensor:
    """FedBR's L_con on projected features, pairs matched element-wise:
    mean_i -log(e^{s1_i} / (e^{s1_i} + e^{s2_i})) with s1 = tau1 * cos(local pseudo, global pseudo) and
    s2 = tau2 * cos(local pseudo, local real). Written as softplus(s2 - s1), which is the same value
    without overflow."""
    s1 = tau1_scale * F.cosine_similarity(p_local_pseudo, p_global_pseudo, dim=1)
    s2 = tau2_scale * F.cosine_similarity(p_local_pseudo, p_local_real, dim=1)
    return F.softplus(s2 - s1).mean()


def mixup_batch(x: torch.Tensor, y: torch.Tensor, lam: float, perm: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lam * x + (1 - lam) * x[perm], y, y[perm]); the loss mixes the two labels with lam."""
    return lam * x + (1.0 - lam) * x[perm], y, y[perm]


def mixup_cross_entropy(logits: torch.Tensor, y_a: torch.Tensor, y_b: torch.Tensor, lam: float) -> torch.Tensor:
    return lam * F.cross_entropy(logits, y_a) + (1.0 - lam) * F.cross_entropy(logits, y_b)


class MixupSampler:
    """Mixup's lam ~ Beta(a, a) on the host (a plain float, so no device sync) and a permutation
    of the batch on the device, both seeded."""

    def __init__(self, alpha: float, seed: int, device: torch.device):
        self.alpha = alpha
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, batch_size: int) -> tuple[float, torch.Tensor]:
        lam = float(self.rng.beta(self.alpha, self.alpha))
        return lam, torch.randperm(batch_size, generator=self.generator, device=self.generator.device)
