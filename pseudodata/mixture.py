"""Mixture pseudo-data (paper eq. 4, Algorithm 3): means of a public proxy dataset, mixed at each
local step with K local samples each."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch.nn import functional as F

from fedbr_flwr.core.config import common
from fedbr_flwr.data.catalog import INFO, load_raw
from fedbr_flwr.data.dataset import normalise, to_float

from . import proxy_dataset


def load_proxy(cfg: Mapping[str, Any]) -> torch.Tensor:
    """The proxy dataset's training images, converted to the run's image shape (channels averaged or
    repeated, resized bilinearly) and normalised with the run's statistics."""
    run = common(cfg)
    name = proxy_dataset(cfg)
    train = load_raw(name, run.data_dir, run.download)[0]  # the built-in ones ignore the data folder
    x = to_float(train.x)  # (N, C, H, W) in [0, 1]
    target = INFO[run.dataset]
    if x.shape[1] != target.in_channels:
        x = x.mean(dim=1, keepdim=True).expand(-1, target.in_channels, -1, -1).contiguous()
    if x.shape[-1] != target.image_size:
        x = F.interpolate(
            x, size=(target.image_size, target.image_size), mode="bilinear", antialias=True, align_corners=False
        )
    return normalise(x, target)


def mix(
    x_pseudo: torch.Tensor, y_pseudo: torch.Tensor, x_local: torch.Tensor, y_local: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x~ = (x_p + sum_k x_k) / (K + 1), y~ = (y_p + sum_k onehot(y_k)) / (K + 1).

    ``x_local`` is (K, B, ...) and ``y_local`` (K, B): the K local samples mixed into each of the B
    pseudo-samples. K = 0 returns the pseudo-data unchanged."""
    k = x_local.shape[0]
    if k == 0:
        return x_pseudo, y_pseudo
    x = (x_pseudo + x_local.sum(dim=0)) / (k + 1)
    y = (y_pseudo + F.one_hot(y_local, num_classes).to(y_pseudo.dtype).sum(dim=0)) / (k + 1)
    return x, y
