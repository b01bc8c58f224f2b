"""DANN (Ganin et al. 2015) in FL: a domain discriminator (3-layer MLP, width dann-hidden) predicts the
client id from the features through a gradient-reversal layer, so one SGD step trains it to tell
clients apart and the feature extractor to hide which client a sample comes from. Loss:
CE + dann-weight * CE(D(reverse(phi(x))), client id). The discriminator travels beside the model as
'discriminator/<key>' and is averaged like it. A client holds one domain only: the signal to separate
clients comes from the averaged discriminator."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fedbr_flwr.algorithm import ClientAlgorithm, LocalStep
from fedbr_flwr.errors import ConfigError
from fedbr_flwr.model import SplitModel
from fedbr_flwr.registry import register_client
from fedbr_flwr.settings import NON_NEGATIVE, POSITIVE, Settings, setting
from fedbr_flwr.training import round_sgd


@dataclass(frozen=True)
class DANNSettings(Settings):
    weight: float = setting("dann-weight", 0.1, "DANN: weight of the domain (client id) discriminator loss, reversed "
                                                "for the features (paper grid 0.01 / 0.1 / 1)", check=NON_NEGATIVE)
    hidden: int = setting("dann-hidden", 256, "DANN: width of the 3-layer discriminator", check=POSITIVE)


def build_discriminator(feature_dim: int, hidden: int, num_domains: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(feature_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, num_domains))


class _ReverseGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, coeff):
        ctx.coeff = coeff
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.coeff * grad, None


def reverse_gradient(x: torch.Tensor, coeff: float = 1.0) -> torch.Tensor:
    """Identity forward; the gradient is multiplied by -coeff backward (DANN's gradient reversal)."""
    return _ReverseGradient.apply(x, coeff)


class DANNStep(LocalStep):
    def __init__(self, model: SplitModel, cfg: dict, weight: float, discriminator: nn.Module, domain: int):
        super().__init__(model, cfg)
        params = list(model.parameters()) + list(discriminator.parameters())
        self.optimizer = round_sgd(model, params, cfg)
        self.discriminator = discriminator
        self.weight = weight
        self.domain = domain

    def update(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        z = self.model.features(x)
        ce = F.cross_entropy(self.model.classifier(z), y)
        domain_logits = self.discriminator(reverse_gradient(z))
        domain = torch.full_like(y, self.domain)
        domain_ce = F.cross_entropy(domain_logits, domain)
        loss = ce + self.weight * domain_ce
        self.step(loss)
        return {"loss": loss.detach(), "ce": ce.detach(), "domain-ce": domain_ce.detach()}


@register_client("dann")
class DANNClient(ClientAlgorithm):
    Settings = DANNSettings

    @classmethod
    def extra_modules(cls, model, cfg):
        if not cfg["num-clients"]:
            raise ConfigError("DANN's discriminator has one output per client: set num-clients")
        return {"discriminator": build_discriminator(model.feature_dim, cfg["dann-hidden"], cfg["num-clients"])}

    def make_step(self, server_round: int, config: dict) -> DANNStep:
        discriminator = self.modules["discriminator"].train()
        return DANNStep(self.model, self.cfg, self.settings.weight, discriminator, self.pid)
