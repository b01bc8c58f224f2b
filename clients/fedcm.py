"""FedCM (Xu et al. 2021): client-level momentum. Every local step moves along
alpha g + (1 - alpha) Delta, where Delta is the global update direction of the previous round, sent
by the server as 'fedcm-delta/<key>' (in gradient units; zero in round 1; the server part is in
strategies/fedcm.py). A component: ``strategy=fedcm`` is FedAvg + it, ``fedbr-with=fedcm`` blends
FedBR's (phi, omega) gradient."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedbr_flwr.core.algorithm import LocalComponent, RoundContext
from fedbr_flwr.core.registry import register_component, register_variant
from fedbr_flwr.core.settings import FRACTION, Settings, setting
from fedbr_flwr.core.training import parameter_tensors

DELTA = "fedcm-delta"


@dataclass(frozen=True)
class FedCMSettings(Settings):
    alpha: float = setting(
        "fedcm-alpha", 0.1, "FedCM: client step direction alpha g + (1 - alpha) Delta_global", check=FRACTION
    )


def blend_with_global_momentum(grads: list[torch.Tensor], momentum: list[torch.Tensor], alpha: float) -> None:
    """In place: g <- alpha g + (1 - alpha) Delta_global."""
    torch._foreach_mul_(grads, alpha)
    torch._foreach_add_(grads, momentum, alpha=1.0 - alpha)


@register_component("fedcm")
class FedCMDirection(LocalComponent):
    Settings = FedCMSettings
    accepts = (f"{DELTA}/",)

    def start_round(self, ctx: RoundContext) -> None:
        self.delta = parameter_tensors(ctx.model, DELTA, ctx.received, ctx.device)

    def adjust_gradients(self, grads: list[torch.Tensor]) -> None:
        blend_with_global_momentum(grads, self.delta, self.settings.alpha)


register_variant("fedcm", "fedavg", ("fedcm",), "FedCM: FedAvg + client-level momentum")
