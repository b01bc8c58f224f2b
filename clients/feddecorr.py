"""FedDecorr (Shi et al. 2023): cross-entropy plus w times the decorrelation loss of the batch's features,
in the official code's form (its published w = 0.1 was tuned on that scale). A component:
``strategy=feddecorr`` is FedAvg + it, ``fedbr-with=feddecorr``
adds it to FedBR's min step (on the local features). The server is FedAvg's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedbr_flwr.core.algorithm import LocalComponent, StepView
from fedbr_flwr.core.registry import register_component, register_variant
from fedbr_flwr.core.settings import NON_NEGATIVE, Settings, setting


@dataclass(frozen=True)
class FedDecorrSettings(Settings):
    weight: float = setting("feddecorr-weight", 0.1, "FedDecorr: weight of the decorrelation loss", check=NON_NEGATIVE)


def decorrelation_loss(z: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """FedDecorr's official form: each feature z-scored over the batch (unbiased variance), then the
    off-diagonal entries of z^T z (not divided by N) squared and averaged, and that mean divided by N.
    It grows with the batch size N (the published weight assumes a batch of 32 or 64); the diagonal,
    N - 1 for every feature, does not count. 0 when there is nothing to decorrelate (N or d below 2)."""
    n, d = z.shape
    if n < 2 or d < 2:
        return z.sum() * 0.0
    z = (z - z.mean(dim=0)) / torch.sqrt(z.var(dim=0) + eps)
    gram = z.T @ z
    off_diagonal = gram[~torch.eye(d, dtype=torch.bool, device=z.device)]
    return off_diagonal.pow(2).mean() / n


@register_component("feddecorr")
class FedDecorrTerm(LocalComponent):
    Settings = FedDecorrSettings

    def terms(self, view: StepView):
        return [("decorr", self.settings.weight, decorrelation_loss(view.features))]


register_variant("feddecorr", "fedavg", ("feddecorr",), "FedDecorr: FedAvg + the decorrelation loss")
