"""Losses several algorithms share (Flower-free, plain tensors). An algorithm's own terms live in its
client file."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def soft_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mean_i -sum_c q_ic log softmax(logits_i)_c, for soft labels q (rows summing to one): FedBR's
    balancing loss on pseudo-data, FedMix's loss on mean labels."""
    return -(target * F.log_softmax(logits, dim=1)).sum(dim=1).mean()
