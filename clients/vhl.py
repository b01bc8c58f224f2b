"""VHL, virtual homogeneity learning (Tang et al. 2022). The server draws labelled virtual data
once from an UNTRAINED class-conditional generator (``virtual_data``) and broadcasts it. The classifier
has 2C outputs: virtual class c is trained as label C + c, past the real ones. Each local step adds,
on a virtual batch of the local batch's size:

    vhl-weight * CE(omega(phi(x_v)), C + c_v)
    + vhl-align-weight * SupCon(real features -> virtual features of the same class, tau = vhl-tau).

Predictions on real data use the first C logits only."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from fedbr_flwr.losses import supervised_alignment_loss
from fedbr_flwr.model import SplitModel
from fedbr_flwr.registry import register_client
from fedbr_flwr.training import Algorithm, step_seed

from .base import BaseClient


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
            nn.ReLU(), nn.ConvTranspose2d(width, width, 4, stride=2, padding=1),
            nn.ReLU(), nn.ConvTranspose2d(width, channels, 4, stride=2, padding=1), nn.Tanh(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.up(self.project(z).view(len(z), *self.start))


@torch.no_grad()
def virtual_data(num_classes: int, channels: int, image_size: int, count: int, seed: int,
                 latent: int = 64, spread: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` virtual samples, classes in turn: class c's latents are N(m_c, spread^2 I) with a class
    mean m_c ~ N(0, I); one untrained generator, all seeded."""
    generator = torch.Generator().manual_seed(seed)
    torch_state = torch.random.get_rng_state()
    torch.manual_seed(step_seed(seed, 107))  # the generator's init, without touching the caller's stream
    net = VirtualGenerator(latent, channels, image_size).eval()
    torch.random.set_rng_state(torch_state)
    labels = torch.arange(count) % num_classes
    means = torch.randn(num_classes, latent, generator=generator)
    z = means[labels] + spread * torch.randn(count, latent, generator=generator)
    return net(z), labels


def vhl_model(backbone: SplitModel) -> SplitModel:
    """The backbone with a classifier over 2C classes (real, then virtual)."""
    c = backbone.classifier.out_features
    return SplitModel(backbone.features, backbone.feature_dim, 2 * c)


class RealClasses(nn.Module):
    """The model's logits of the C real classes only."""

    def __init__(self, model: nn.Module, num_classes: int):
        super().__init__()
        self.model, self.num_classes = model, num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)[:, :self.num_classes]


class VHL(Algorithm):
    def __init__(self, model: SplitModel, cfg: dict, virtual_x: torch.Tensor, virtual_y: torch.Tensor, seed: int):
        super().__init__(model, cfg)
        self.virtual_x, self.virtual_y = virtual_x, virtual_y
        self.num_classes = model.classifier.out_features // 2
        self.generator = torch.Generator(device=virtual_x.device)
        self.generator.manual_seed(seed)

    def update(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        idx = torch.randint(0, len(self.virtual_y), (len(y),), device=self.virtual_y.device,
                            generator=self.generator)
        x_v, y_v = self.virtual_x[idx], self.virtual_y[idx]
        z = self.model.features(torch.cat([x, x_v]))  # one pass: per-sample normalisation keeps it exact
        z_real, z_virtual = z[:len(y)], z[len(y):]
        logits = self.model.classifier(z)
        ce = F.cross_entropy(logits[:len(y)], y)
        ce_virtual = F.cross_entropy(logits[len(y):], y_v + self.num_classes)
        align = supervised_alignment_loss(z_real, y, z_virtual, y_v, self.cfg["vhl-tau"])
        loss = ce + self.cfg["vhl-weight"] * ce_virtual + self.cfg["vhl-align-weight"] * align
        self.step(loss)
        return {"loss": loss.detach(), "ce": ce.detach(), "ce-virtual": ce_virtual.detach(), "align": align.detach()}


@register_client("vhl")
class VHLClient(BaseClient):
    algorithm = VHL

    @classmethod
    def wrap_model(cls, backbone, cfg):
        return vhl_model(backbone)

    @classmethod
    def predictor(cls, model, cfg):
        return RealClasses(model, model.classifier.out_features // 2)

    def make_algorithm(self, server_round: int, config: dict) -> VHL:
        x, y = self.shared("vhl", config)
        return VHL(self.model, self.cfg, x, y.long(), step_seed(self.cfg["seed"], server_round, self.pid, 108))
