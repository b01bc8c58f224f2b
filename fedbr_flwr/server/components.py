"""The server part of a component (registered with ``register_server_component`` under the component's
name): arrays it sends to every sampled client each round, what it learns from each new global model,
and its state in checkpoints. FedCM's global update direction is one."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.registry import lookup_server_component

Named = dict[str, np.ndarray]


class ServerComponent:
    name = ""  # set by register_server_component

    def __init__(self, cfg: dict[str, Any], global_arrays: Named):
        self.cfg = cfg

    def round_arrays(self, server_round: int, global_arrays: Named) -> Named:
        """Arrays sent to every sampled client beside the global ones (serialised once per round)."""
        return {}

    def after_aggregate(self, new_global: Named) -> list[str]:
        """Called with the new global arrays after each round that changed them; returns warnings for the round's
        record (a state it kept instead of one it could not take)."""
        return []

    def checkpoint_state(self) -> Named:
        return {}

    def restore_state(self, arrays: Named) -> None:
        """The inverse of ``checkpoint_state``."""


def server_component_class(name: str) -> type[ServerComponent] | None:
    """The server part of component ``name``, if it has one."""
    return lookup_server_component(name)
