"""GroupDRO's client: FedAvg's, reporting also the loss of its first local step (``first-loss``), taken at
the global model as received, by which the server weighs the clients (as the authors' code does)."""

from __future__ import annotations

from fedbr_flwr.registry import register_client

from .fedavg import FedAvgClient


@register_client("groupdro")
class GroupDROClient(FedAvgClient):
    first_step_stats = ("loss",)
