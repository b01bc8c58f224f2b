"""FedProx (Li et al. 2020): cross-entropy plus mu/2 ||w - w_round_start||^2, so that each step's
gradient gains mu (w - w_round_start). A component: ``strategy=fedprox`` is FedAvg + it, and
``fedbr-with=fedprox`` adds it to FedBR's min step. The server is FedAvg's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedbr_flwr.core.algorithm import LocalComponent, RoundContext, StepView
from fedbr_flwr.core.registry import register_component, register_variant
from fedbr_flwr.core.settings import NON_NEGATIVE, Settings, setting


@dataclass(frozen=True)
class FedProxSettings(Settings):
    mu: float = setting(
        "fedprox-mu",
        0.01,
        "FedProx: weight mu of the proximal term mu/2 ||w - w_round_start||^2 (paper grid 0.001 / 0.01 / 0.1)",
        check=NON_NEGATIVE,
    )


def proximal_term(params: list[torch.Tensor], anchor: list[torch.Tensor]) -> torch.Tensor:
    """sum ||w - w_round_start||^2 over all parameters (the loss adds mu/2 times this, so its gradient
    adds mu (w - w_round_start))."""
    return torch.stack([(p - a).pow(2).sum() for p, a in zip(params, anchor)]).sum()


@register_component("fedprox")
class FedProxTerm(LocalComponent):
    Settings = FedProxSettings

    def start_round(self, ctx: RoundContext) -> None:
        self.anchor = [p.detach().clone() for p in ctx.model.parameters()]  # the weights received this round

    def terms(self, view: StepView):
        return [("prox", 0.5 * self.settings.mu, proximal_term(view.params, self.anchor))]


register_variant("fedprox", "fedavg", ("fedprox",), "FedProx: FedAvg + the proximal term")
