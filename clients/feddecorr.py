"""FedDecorr (Shi et al. 2023): cross-entropy plus w ||K||_F^2 / d^2, K the correlation matrix of the
batch's z-scored features. A component: ``strategy=feddecorr`` is FedAvg + it, ``fedbr-with=feddecorr``
adds it to FedBR's min step (on the local features). The server is FedAvg's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedbr_flwr.algorithm import LocalComponent, StepView
from fedbr_flwr.registry import register_component, register_variant
from fedbr_flwr.settings import NON_NEGATIVE, Settings, setting


@dataclass(frozen=True)
class FedDecorrSettings(Settings):
    weight: float = setting("feddecorr-weight", 0.1, "FedDecorr: weight of the decorrelation loss", check=NON_NEGATIVE)


def decorrelation_loss(z: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """||K||_F^2 / d^2 with K the d x d correlation matrix of the batch's features, each dimension
    z-scored over the batch."""
    n, d = z.shape
    z = (z - z.mean(dim=0)) / torch.sqrt(z.var(dim=0, unbiased=False) + eps)
    corr = z.T @ z / n
    return corr.pow(2).sum() / (d * d)


@register_component("feddecorr")
class FedDecorrTerm(LocalComponent):
    Settings = FedDecorrSettings

    def terms(self, view: StepView):
        return [("decorr", self.settings.weight, decorrelation_loss(view.features))]


register_variant("feddecorr", "fedavg", ("feddecorr",), "FedDecorr: FedAvg + the decorrelation loss")
