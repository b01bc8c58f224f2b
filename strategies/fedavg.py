"""FedAvg: the global model is the (uniform or sample-weighted) mean of the returned models."""

from __future__ import annotations

from fedbr_flwr.core.registry import register_strategy

from .base import FederatedStrategy


@register_strategy("fedavg")
class FedAvgStrategy(FederatedStrategy):
    """``FederatedStrategy``'s hooks are FedAvg's; algorithms without a strategy file use this one."""
