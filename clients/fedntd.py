"""FedNTD (Lee et al. 2022): cross-entropy plus beta tau^2 KL between the round-start global model's
and the local model's softened predictions over the NOT-true classes only. A component:
``strategy=fedntd`` is FedAvg + it, ``fedbr-with=fedntd`` adds it to FedBR's min step (on the local
logits). The server is FedAvg's."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from fedbr_flwr.core.algorithm import LocalComponent, RoundContext, StepView
from fedbr_flwr.core.registry import register_component, register_variant
from fedbr_flwr.core.settings import NON_NEGATIVE, POSITIVE, Settings, setting
from fedbr_flwr.core.training import frozen_copy


@dataclass(frozen=True)
class FedNTDSettings(Settings):
    beta: float = setting("fedntd-beta", 1.0, "FedNTD: weight of the not-true distillation loss", check=NON_NEGATIVE)
    tau: float = setting("fedntd-tau", 1.0, "FedNTD: distillation temperature", check=POSITIVE)


def not_true_logits(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, C) -> (B, C-1): every logit except the true class's."""
    others = torch.arange(logits.shape[1] - 1, device=logits.device).expand(len(y), -1)
    return logits.gather(1, others + (others >= y[:, None]).long())  # an index at or past the true class: +1


def not_true_distillation_loss(
    logits: torch.Tensor, global_logits: torch.Tensor, y: torch.Tensor, tau: float
) -> torch.Tensor:
    """tau^2 KL(softmax(g~/tau) || softmax(l~/tau)) over the not-true classes only, batch mean, with g
    the round-start global model's logits."""
    local = F.log_softmax(not_true_logits(logits, y) / tau, dim=1)
    target = F.softmax(not_true_logits(global_logits, y) / tau, dim=1)
    return tau * tau * F.kl_div(local, target, reduction="batchmean")


@register_component("fedntd")
class FedNTDTerm(LocalComponent):
    Settings = FedNTDSettings

    def start_round(self, ctx: RoundContext) -> None:
        self.teacher = frozen_copy(ctx.model)  # the global model as received this round

    def terms(self, view: StepView):
        with torch.no_grad():
            global_logits = self.teacher(view.batch.x)
        ntd = not_true_distillation_loss(view.logits, global_logits, view.batch.y, self.settings.tau)
        return [("ntd", self.settings.beta, ntd)]


register_variant("fedntd", "fedavg", ("fedntd",), "FedNTD: FedAvg + not-true distillation")
