"""GroupDRO's client: FedAvg's, reporting also the loss of its first local step (``first-loss``), taken at
the global model as received, by which the server weighs the clients (as the authors' code does). As in
the FedBR authors' code, its batches are Mixup batches (the mixup component, lam ~ Beta(mixup-alpha,
mixup-alpha)) unless ``groupdro-mixup`` is false, so ``first-loss`` is the mixed loss of the first step."""

from __future__ import annotations

from typing import Any, Mapping

from fedbr_flwr.core.registry import register_client

from .fedavg import FedAvgClient


@register_client("groupdro")
class GroupDROClient(FedAvgClient):
    first_step_stats = ("loss",)

    @classmethod
    def carried_components(cls, cfg: Mapping[str, Any]) -> tuple[str, ...]:
        return ("mixup",) if cfg["groupdro-mixup"] else ()
