"""DANN (Ganin et al. 2015) in FL: a domain discriminator (3-layer MLP, width dann-hidden) predicts the
client id from the features through a gradient-reversal layer, so one SGD step trains it to tell
clients apart and the feature extractor to hide which client a sample comes from. Loss:
CE + CE(D(R(phi(x))), client id), where R is the identity forward and multiplies the gradient by
-dann-weight backward: as in DANN and DomainBed, the weight scales only the reversed gradient that reaches
the features, and the discriminator trains at full weight. The discriminator travels beside the model as
'discriminator/<key>' and is averaged like it. A client holds one domain only: the signal to separate
clients comes from the averaged discriminator."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fedbr_flwr.core.algorithm import ClientAlgorithm, FunctionalStep, Params, Phase, call
from fedbr_flwr.core.config import common
from fedbr_flwr.core.errors import ConfigError
from fedbr_flwr.core.model import SplitModel
from fedbr_flwr.core.registry import register_client
from fedbr_flwr.core.settings import NON_NEGATIVE, POSITIVE, Settings, setting
from fedbr_flwr.core.training import round_sgd


@dataclass(frozen=True)
class DANNSettings(Settings):
    weight: float = setting(
        "dann-weight",
        0.1,
        "DANN: scale of the reversed domain (client id) gradient reaching the "
        "features; the discriminator trains at full weight (paper grid 0.01 / "
        "0.1 / 1)",
        check=NON_NEGATIVE,
    )
    hidden: int = setting("dann-hidden", 256, "DANN: width of the 3-layer discriminator", check=POSITIVE)


def build_discriminator(feature_dim: int, hidden: int, num_domains: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(feature_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_domains)
    )


class _ReverseGradient(torch.autograd.Function):
    """Identity forward, gradient times -coeff backward. Written in the ``setup_context`` style with a
    generated vmap rule, so that it also works under torch.func (``grad`` and ``vmap``: a vectorised cohort)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, coeff):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.coeff = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return -ctx.coeff * grad, None


def reverse_gradient(x: torch.Tensor, coeff: float = 1.0) -> torch.Tensor:
    """Identity forward; the gradient is multiplied by -coeff backward (DANN's gradient reversal)."""
    return _ReverseGradient.apply(x, coeff)


def dann_terms(
    model: SplitModel,
    discriminator: nn.Module,
    params: Params,
    x: torch.Tensor,
    y: torch.Tensor,
    domain: torch.Tensor,
    weight: float,
) -> dict[str, torch.Tensor]:
    """CE + the discriminator's domain CE on reversed features, with the parameters ``params["model"]`` and
    ``params["discriminator"]``; ``domain`` holds each sample's domain label (the client id)."""
    z = call(model.features, params["model"], "features", x)
    ce = F.cross_entropy(call(model.classifier, params["model"], "classifier", z), y)
    domain_ce = F.cross_entropy(call(discriminator, params["discriminator"], "", reverse_gradient(z, weight)), domain)
    return {"loss": ce + domain_ce, "ce": ce, "domain-ce": domain_ce}


class DANNStep(FunctionalStep):
    """One phase: the model and the discriminator (two groups, each with its own SGD at the common lr)
    descend on CE + domain CE, the features seeing the domain gradient reversed."""

    per_member_state = ("domain",)  # the domain labels come from draw

    def __init__(self, model: SplitModel, cfg: dict, weight: float, discriminator: nn.Module, domain: int):
        super().__init__(model, cfg)  # SGD on the model
        self.discriminator = discriminator
        self.weight = weight
        self.domain = domain
        self.groups["discriminator"] = dict(discriminator.named_parameters())
        self.optimizers["discriminator"] = round_sgd(discriminator, discriminator.parameters(), cfg)
        self.phases = [Phase(("model", "discriminator"), self.loss)]

    def draw(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch and its domain labels (this client's id for every sample)."""
        return {"x": x, "y": y, "domain": torch.full_like(y, self.domain)}

    def loss(self, params, inputs, shared):
        terms = dann_terms(
            self.model, self.discriminator, params, inputs["x"], inputs["y"], inputs["domain"], self.weight
        )
        return terms["loss"], terms


@register_client("dann")
class DANNClient(ClientAlgorithm):
    vectorised = True
    # torch.compile cannot trace an autograd.Function under vmap (torch 2.14: pytorch issue 129845)
    compiles_vectorised = False
    Settings = DANNSettings

    @classmethod
    def extra_modules(cls, model, cfg):
        run = common(cfg)
        if not run.num_clients:
            raise ConfigError("DANN's discriminator has one output per client: set num-clients")
        hidden = DANNSettings.from_config(cfg).hidden
        return {"discriminator": build_discriminator(model.feature_dim, hidden, run.num_clients)}

    def make_step(self, server_round: int, config: dict) -> DANNStep:
        discriminator = self.modules["discriminator"].train()
        return DANNStep(self.model, self.cfg, self.settings.weight, discriminator, self.pid)
