"""VHL's server: draws the virtual data once from an untrained class-conditional generator (seeded by
the run seed) and broadcasts it; the model (with its 2C-way classifier) is averaged as in FedAvg."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedbr_flwr.core import seeds
from fedbr_flwr.core.config import common
from fedbr_flwr.core.registry import register_strategy
from fedbr_flwr.data.catalog import INFO

from .base import FederatedStrategy


class VirtualGenerator(nn.Module):
    """Untrained: a linear map of the latent to a (64, s/4, s/4) map, two transposed convolutions up
    to the image size, Tanh."""

    def __init__(self, latent: int, channels: int, image_size: int, width: int = 64):
        super().__init__()
        if image_size % 4:
            raise ValueError(f"image size {image_size} must be a multiple of 4")
        self.start = (width, image_size // 4, image_size // 4)
        self.project = nn.Linear(latent, width * (image_size // 4) ** 2)
        self.up = nn.Sequential(
            nn.ReLU(),
            nn.ConvTranspose2d(width, width, 4, stride=2, padding=1),
            nn.ReLU(),
            nn.ConvTranspose2d(width, channels, 4, stride=2, padding=1),
            nn.Tanh(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.up(self.project(z).view(len(z), *self.start))


@torch.no_grad()
def virtual_data(
    num_classes: int, channels: int, image_size: int, count: int, seed: int, latent: int = 64, spread: float = 0.5
) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` virtual samples, classes in turn: class c's latents are N(m_c, spread^2 I) with a class
    mean m_c ~ N(0, I); one untrained generator, all seeded."""
    generator = torch.Generator().manual_seed(seed)
    torch_state = torch.random.get_rng_state()
    torch.manual_seed(seeds.seed("vhl-generator", seed))  # the generator's init, without touching the caller's stream
    net = VirtualGenerator(latent, channels, image_size).eval()
    torch.random.set_rng_state(torch_state)
    labels = torch.arange(count) % num_classes
    means = torch.randn(num_classes, latent, generator=generator)
    z = means[labels] + spread * torch.randn(count, latent, generator=generator)
    return net(z), labels


@register_strategy("vhl")
class VHLStrategy(FederatedStrategy):
    shared_name = "vhl"

    def make_shared_data(self, server_round: int) -> tuple[np.ndarray, np.ndarray]:
        run = common(self.cfg)
        info = INFO[run.dataset]
        x, y = virtual_data(
            info.num_classes,
            info.in_channels,
            info.image_size,
            self.settings.size,
            seeds.seed("vhl-data", run.seed),
        )
        self.recorder.progress.emit(
            "info", f"VHL: {len(x)} virtual samples of {info.num_classes} classes, sent to each client once"
        )
        return x.numpy(), y.numpy().astype(np.float32)
