"""FedCM's server part: the global update direction Delta = (x_round_start - x_new) / (lr K) over the
model's arrays (the mean client step, in gradient units; zero before the first round; with SGD momentum, K is
the steps the momentum amounts to, ``steps_along_gradient``), sent to every
sampled client as 'fedcm-delta/<key>'. A server component: with ``strategy=fedcm`` it rides on FedAvg's
strategy, with ``fedbr-with=fedcm`` on FedBR's."""

from __future__ import annotations

import numpy as np

from fedbr_flwr.core.config import common
from fedbr_flwr.core.registry import register_server_component
from fedbr_flwr.core.training import steps_along_gradient
from fedbr_flwr.server.components import ServerComponent
from fedbr_flwr.server.updates import all_finite

DELTA = "fedcm-delta"  # as the clients read it (clients/fedcm.py)
MODEL = "model/"


def global_update_direction(start: np.ndarray, new: np.ndarray, lr: float, steps: float) -> np.ndarray:
    return ((start - new) / (lr * steps)).astype(start.dtype)


@register_server_component("fedcm")
class GlobalDirection(ServerComponent):
    def __init__(self, cfg, global_arrays):
        super().__init__(cfg, global_arrays)
        self.delta = {
            name[len(MODEL) :]: np.zeros_like(a) for name, a in global_arrays.items() if name.startswith(MODEL)
        }
        self.round_start: dict[str, np.ndarray] = {}

    def round_arrays(self, server_round, global_arrays):
        self.round_start = {key: global_arrays[MODEL + key] for key in self.delta}
        return {f"{DELTA}/{key}": d for key, d in self.delta.items()}

    def after_aggregate(self, new_global):
        run = common(self.cfg)
        steps = steps_along_gradient(run.local_steps, run.momentum)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is caught below
            delta = {
                key: global_update_direction(self.round_start[key], new_global[MODEL + key], run.lr, steps)
                for key in self.delta
            }
        if not all_finite(delta):
            return ["FedCM's global direction would hold Inf: the last one is kept"]
        self.delta = delta
        return []

    def checkpoint_state(self):
        return {f"fedcm/delta/{key}": d for key, d in self.delta.items()}

    def restore_state(self, arrays):
        self.delta = {key: arrays[f"fedcm/delta/{key}"] for key in self.delta}
