"""DisTrans (ECCV 2022, Algorithm 1; SPEC section 3): each client trains the double-input-channel
model and its own input offset t on cross-entropy of

    model(x, t) = omega([phi((1 - alpha) x + alpha t), phi((1 + alpha) x - alpha t)]),

and evaluates its local test set with the same offset. The offset stays with its client across
rounds (Flower's per-node ``context.state``); the server may replace it (``distrans-agg`` avg / nn)
by sending one after the model arrays.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.common import ArrayRecord
from torch import nn
from torch.nn import functional as F

from fedbr_flwr.dataset import INFO, DatasetInfo, normalise
from fedbr_flwr.model import DoubleInputModel, Offset, WithOffset
from fedbr_flwr.registry import register_client
from fedbr_flwr.training import Algorithm, round_sgd, step_seed

from .base import BaseClient


class DisTrans(Algorithm):
    """One step on (model, offset). ``simultaneous`` (the authors' code): one backward pass feeds
    both SGD steps. ``alternating`` (the paper's Algorithm 1): an offset step with the model fixed,
    then a model step on the moved offset."""

    def __init__(self, model: DoubleInputModel, offset: Offset, cfg: dict):
        super().__init__(model, cfg)  # SGD on the model at the common lr
        self.offset = offset
        self.offset_optimizer = round_sgd(offset, offset.parameters(), cfg, lr=cfg["distrans-offset-lr"],
                                          weight_decay=0.0)
        self.alternating = cfg["distrans-update"] == "alternating"
        self.model_params = list(model.parameters())

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(x, self.offset.t), y)

    def update(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.alternating:
            offset_loss = self.loss(x, y)
            self.offset_optimizer.zero_grad(set_to_none=True)
            offset_loss.backward(inputs=[self.offset.t])
            self.offset_optimizer.step()
            loss = self.loss(x, y)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward(inputs=self.model_params)
            self.optimizer.step()
            return {"loss": loss.detach(), "offset-loss": offset_loss.detach()}
        loss = self.loss(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        self.offset_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.offset_optimizer.step()
        return {"loss": loss.detach()}


def offset_shape(info: DatasetInfo) -> tuple[int, int, int]:
    return info.in_channels, info.image_size, info.image_size


def initial_offset(info: DatasetInfo, seed: int) -> np.ndarray:
    """uniform[0, 1) image, normalised like the data (SPEC section 3)."""
    generator = torch.Generator().manual_seed(seed)
    u = torch.rand((1, *offset_shape(info)), generator=generator)
    return normalise(u, info)[0].numpy()


def double_input_model(backbone: nn.Module, cfg: dict) -> DoubleInputModel:
    return DoubleInputModel.from_backbone(backbone, cfg["distrans-alpha"])


OFFSET_KEY = "distrans-offset"


@register_client("distrans")
class DisTransClient(BaseClient):
    """Sends (model, offset). Receives the model, plus an offset when the server aggregates them;
    otherwise it uses the offset it kept in Flower's per-node state (drawn fresh the first time)."""
    state_keys = (OFFSET_KEY,)
    algorithm = DisTrans

    @classmethod
    def wrap_model(cls, backbone, cfg):
        return double_input_model(backbone, cfg)

    def __init__(self, cfg, data, device, state=None):
        super().__init__(cfg, data, device, state)
        self.info = INFO[cfg["dataset"]]
        self.offset = Offset(offset_shape(self.info)).to(device)
        self.num_model_arrays = len(self.model.state_dict())
        self.fresh_offset = False

    def weight_modules(self) -> list[nn.Module]:
        return [self.model, self.offset]

    def make_algorithm(self, server_round: int, config: dict) -> DisTrans:
        return DisTrans(self.model, self.offset, self.cfg)

    def eval_module(self) -> nn.Module:
        return WithOffset(self.model, self.offset.t)

    def stored_offset(self) -> np.ndarray:
        if OFFSET_KEY in self.state:
            return self.state[OFFSET_KEY].to_numpy_ndarrays()[0]
        self.fresh_offset = True
        return initial_offset(self.info, step_seed(self.cfg["seed"], self.pid, 201))

    def store_offset(self) -> None:
        self.state[OFFSET_KEY] = ArrayRecord([self.offset.t.detach().cpu().numpy().copy()])  # no view of t

    def with_offset(self, parameters: list[np.ndarray]) -> list[np.ndarray]:
        """The model arrays plus the offset to use: the server's when it sent one, else our own."""
        n = self.num_model_arrays
        if len(parameters) == n + 1:
            return parameters
        if len(parameters) != n:
            raise ValueError(f"DisTrans client {self.pid} expected {n} model arrays (+ 1 offset), "
                             f"got {len(parameters)}")
        return [*parameters, self.stored_offset()]

    def fit(self, parameters, config):
        self.restore_state(config)  # before the stored offset is read
        self.fresh_offset = False
        parameters = self.with_offset(parameters)
        start = torch.as_tensor(parameters[-1])
        weights, n, metrics = super().fit(parameters, config)
        self.store_offset()
        change = float((torch.as_tensor(weights[-1]) - start).pow(2).mean().sqrt())
        # averaged over clients: the share that started from a freshly drawn offset (round 1, or lost state)
        return weights, n, {**metrics, "offset-rms-change": change, "offset-fresh": float(self.fresh_offset)}

    def evaluate(self, parameters, config):
        self.restore_state(config)
        result = super().evaluate(self.with_offset(parameters), config)
        self.store_offset()  # a server-sent offset is this client's from now on
        return result
