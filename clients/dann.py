"""DANN (Ganin et al. 2015) in FL: a domain discriminator (3-layer MLP, width dann-hidden) predicts the
client id from the features through a gradient-reversal layer, so one SGD step trains it to tell
clients apart and the feature extractor to hide which client a sample comes from. Loss:
CE + dann-weight * CE(D(reverse(phi(x))), client id). The discriminator travels after the model and
is averaged like it. A client holds one domain only: the signal to separate clients comes from the
averaged discriminator."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from fedbr_flwr.losses import reverse_gradient
from fedbr_flwr.model import SplitModel
from fedbr_flwr.registry import register_client
from fedbr_flwr.training import Algorithm, round_sgd

from .base import BaseClient


def build_discriminator(feature_dim: int, hidden: int, num_domains: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(feature_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, num_domains))


class DANN(Algorithm):
    def __init__(self, model: SplitModel, cfg: dict, discriminator: nn.Module, domain: int):
        super().__init__(model, cfg)
        params = list(model.parameters()) + list(discriminator.parameters())
        self.optimizer = round_sgd(model, params, cfg)
        self.discriminator = discriminator
        self.domain = domain

    def update(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        z = self.model.features(x)
        ce = F.cross_entropy(self.model.classifier(z), y)
        domain_logits = self.discriminator(reverse_gradient(z))
        domain = torch.full_like(y, self.domain)
        domain_ce = F.cross_entropy(domain_logits, domain)
        loss = ce + self.cfg["dann-weight"] * domain_ce
        self.step(loss)
        return {"loss": loss.detach(), "ce": ce.detach(), "domain-ce": domain_ce.detach()}


@register_client("dann")
class DANNClient(BaseClient):
    algorithm = DANN

    def __init__(self, cfg, data, device, state=None):
        super().__init__(cfg, data, device, state)
        self.discriminator = build_discriminator(self.model.feature_dim, cfg["dann-hidden"],
                                                 cfg["num-clients"]).to(device)

    def weight_modules(self) -> list[nn.Module]:
        return [self.model, self.discriminator]

    def make_algorithm(self, server_round: int, config: dict) -> DANN:
        self.discriminator.train()
        return DANN(self.model, self.cfg, self.discriminator, self.pid)
