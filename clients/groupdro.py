"""GroupDRO's client: FedAvg's, reporting also the loss of its first local step (``first-loss``), taken at
the global model as received, by which the server weighs the clients (as the authors' code does). As in
the FedBR authors' code, its batches are Mixup batches (the mixup component, lam ~ Beta(mixup-alpha,
mixup-alpha)) unless ``groupdro-mixup`` is false, so ``first-loss`` is the mixed loss of the first step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from fedbr_flwr.core.registry import register_client
from fedbr_flwr.core.settings import NON_NEGATIVE, Settings, setting

from .fedavg import FedAvgClient


@dataclass(frozen=True)
class GroupDROSettings(Settings):
    eta: float = setting(
        "groupdro-eta", 0.01, "GroupDRO: server weight step p_i <- p_i exp(eta loss_i)", check=NON_NEGATIVE
    )
    mixup: bool = setting(
        "groupdro-mixup",
        True,
        "GroupDRO: train (and weigh clients) on Mixup batches, as the FedBR authors' code; false: plain cross-entropy",
    )


@register_client("groupdro")
class GroupDROClient(FedAvgClient):
    Settings = GroupDROSettings
    first_step_stats = ("loss",)

    @classmethod
    def carried_components(cls, cfg: Mapping[str, Any]) -> tuple[str, ...]:
        return ("mixup",) if GroupDROSettings.from_config(cfg).mixup else ()
