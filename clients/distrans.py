"""DisTrans (ECCV 2022, Algorithm 1; SPEC section 3): each client trains the double-input-channel
model and its own input offset t on cross-entropy of

    model(x, t) = omega([phi((1 - alpha) x + alpha t), phi((1 + alpha) x - alpha t)]),

and evaluates its local test set with the same offset. The offset stays with its client across
rounds (its node state); the server may replace it (``distrans-agg`` avg / nn) by sending an
'offset' array with the model. Every client returns its offset as 'offset'.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedbr_flwr.core import seeds
from fedbr_flwr.core.algorithm import ClientAlgorithm, FunctionalStep, Phase, call
from fedbr_flwr.core.config import common
from fedbr_flwr.core.model import SplitModel
from fedbr_flwr.core.registry import register_client
from fedbr_flwr.core.settings import FRACTION, OPEN_FRACTION, POSITIVE, Settings, setting
from fedbr_flwr.core.training import round_sgd
from fedbr_flwr.data.catalog import INFO, DatasetInfo
from fedbr_flwr.data.dataset import normalise

OFFSET = "offset"  # the array's name in messages
OFFSET_KEY = "distrans-offset"  # its record in the node state


@dataclass(frozen=True)
class DisTransSettings(Settings):
    """The defaults are the paper's (the model's learning rate is the common 'lr')."""

    alpha: float = setting(
        "distrans-alpha", 0.3, "blend weight of the offset in the two input channels", check=OPEN_FRACTION
    )
    offset_lr: float = setting("distrans-offset-lr", 1e-3, "client SGD learning rate of the offset t", check=POSITIVE)
    update: str = setting(
        "distrans-update",
        "simultaneous",
        "model and offset from one backward pass per batch "
        "(authors' code), or alternating: offset step, then model step (paper)",
        choices=("simultaneous", "alternating"),
    )
    agg: str = setting(
        "distrans-agg",
        "auto",
        "server offset aggregation: none (offsets stay with their clients), "
        "avg (the mean to all), nn (aggregation network), auto (none if DH >= threshold, else nn)",
        choices=("auto", "none", "avg", "nn"),
    )
    dh_threshold: float = setting(
        "distrans-dh-threshold", 0.5, "auto picks none at DH >= this, nn below", check=FRACTION
    )
    nn_lr: float = setting(
        "distrans-nn-lr", 1e-2, "SGD learning rate of the server's offset aggregation network", check=POSITIVE
    )
    nn_steps: int = setting(
        "distrans-nn-steps", 10, "full-batch regression steps of the aggregation network per round", check=POSITIVE
    )


# ---------------------------------------------------------------- model pieces


class DoubleInputModel(nn.Module):
    """DisTrans' double-input-channel model: the SAME feature extractor on x1 = (1 - alpha) x + alpha t and
    x2 = (1 + alpha) x - alpha t, the two feature vectors concatenated, then one linear classifier over
    2d features."""

    def __init__(self, features: nn.Module, feature_dim: int, num_classes: int, alpha: float):
        super().__init__()
        self.features = features
        self.feature_dim = 2 * feature_dim
        self.alpha = alpha
        self.classifier = nn.Linear(2 * feature_dim, num_classes)

    @classmethod
    def from_backbone(cls, backbone: SplitModel, alpha: float) -> "DoubleInputModel":
        """Reuses the backbone's feature extractor; the 2d -> C classifier is new (drawn from torch's RNG)."""
        return cls(backbone.features, backbone.feature_dim, backbone.classifier.out_features, alpha)

    def channels(self, x: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.alpha
        return (1 - a) * x + a * t, (1 + a) * x - a * t

    def double_features(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x1, x2 = self.channels(x, t)
        z1, z2 = self.features(torch.cat([x1, x2])).chunk(2)  # one pass; per-sample norms keep it exact
        return torch.cat([z1, z2], dim=1)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.double_features(x, t))


class Offset(nn.Module):
    """One client's offset t, shaped like one input image; it broadcasts over a batch."""

    def __init__(self, shape: tuple[int, ...]):
        super().__init__()
        self.t = nn.Parameter(torch.zeros(shape))


class WithOffset(nn.Module):
    """``model(x, t)`` as a one-input module, so that evaluation code need not know about offsets."""

    def __init__(self, model: DoubleInputModel, t: torch.Tensor):
        super().__init__()
        self.model = model
        self.t = t

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, self.t)


def initial_offset(info: DatasetInfo, seed: int) -> np.ndarray:
    """uniform[0, 1) image, normalised like the data (SPEC section 3)."""
    generator = torch.Generator().manual_seed(seed)
    u = torch.rand((1, *info.image_shape), generator=generator)
    return normalise(u, info)[0].numpy()


# ---------------------------------------------------------------- the local step


class DisTransStep(FunctionalStep):
    """One step on the groups "model" and "offset". ``simultaneous`` (the authors' code): one backward pass
    feeds both SGD steps. ``alternating`` (the paper's Algorithm 1): an offset step with the model fixed,
    then a model step on the moved offset."""

    def __init__(self, model: DoubleInputModel, offset: Offset, cfg: dict, settings: DisTransSettings):
        super().__init__(model, cfg)  # SGD on the model at the common lr
        self.offset = offset
        self.groups["offset"] = {"t": offset.t}
        self.optimizers["offset"] = round_sgd(offset, offset.parameters(), cfg, lr=settings.offset_lr, weight_decay=0.0)
        if settings.update == "alternating":
            self.phases = [Phase(("offset",), self.offset_loss), Phase(("model",), self.loss)]
        else:
            self.phases = [Phase(("model", "offset"), self.loss)]

    def cross_entropy(self, params, inputs) -> torch.Tensor:
        return F.cross_entropy(call(self.model, params["model"], "", inputs["x"], params["offset"]["t"]), inputs["y"])

    def loss(self, params, inputs, shared):
        loss = self.cross_entropy(params, inputs)
        return loss, {"loss": loss}

    def offset_loss(self, params, inputs, shared):
        loss = self.cross_entropy(params, inputs)
        return loss, {"offset-loss": loss}


# ---------------------------------------------------------------- the client side


@register_client("distrans")
class DisTransClient(ClientAlgorithm):
    """Returns its offset beside the model. Takes the server's offset when one is sent; otherwise it
    uses the offset it kept in its node state (drawn fresh the first time)."""

    vectorised = True
    graph_checked_on_gpu = True
    Settings = DisTransSettings
    state_keys = (OFFSET_KEY,)
    accepts = (OFFSET,)

    @classmethod
    def build_model(cls, backbone, cfg):
        return DoubleInputModel.from_backbone(backbone, DisTransSettings.from_config(cfg).alpha)

    @classmethod
    def returned_shapes(cls, model, cfg):
        return {OFFSET: INFO[common(cfg).dataset].image_shape}

    @classmethod
    def with_offset(cls, model: DoubleInputModel, t: torch.Tensor) -> nn.Module:
        """The model as a one-input predictor seeing ``t`` (the server's global test uses the mean offset)."""
        return WithOffset(model, t)

    def __init__(self, cfg, data, device, state=None):
        super().__init__(cfg, data, device, state)
        self.info = INFO[common(cfg).dataset]
        self.offset = Offset(self.info.image_shape).to(self.device)
        self.fresh_offset = False
        self.start_offset: np.ndarray | None = None

    def receive(self, arrays):
        """The model, and the offset to use: the server's when it sent one, else our own."""
        super().receive(arrays)
        self.fresh_offset = False
        t = self.received.get(OFFSET)
        if t is None:
            t = self.stored_offset()
        with torch.no_grad():
            self.offset.t.copy_(torch.as_tensor(t))
        self.start_offset = np.asarray(t)

    def stored_offset(self) -> np.ndarray:
        stored = self.state.arrays(OFFSET_KEY)
        if stored is not None:
            return stored["t"]
        self.fresh_offset = True
        return initial_offset(self.info, seeds.seed("distrans-offset", common(self.cfg).seed, self.pid))

    def store_offset(self) -> np.ndarray:
        t = self.offset.t.detach().cpu().numpy().copy()  # no view of t
        self.state.put_arrays(OFFSET_KEY, {"t": t})
        return t

    def make_step(self, server_round: int, config: dict) -> DisTransStep:
        return DisTransStep(self.model, self.offset, self.cfg, self.settings)

    def after_fit(self, step):
        t = self.store_offset()
        change = float((torch.as_tensor(t) - torch.as_tensor(self.start_offset)).pow(2).mean().sqrt())
        # averaged over clients: the share that started from a freshly drawn offset (round 1, or lost state)
        return {OFFSET: t}, {"offset-rms-change": change, "offset-fresh": float(self.fresh_offset)}

    def after_evaluate(self) -> None:
        self.store_offset()  # a server-sent offset is this client's from now on

    def eval_module(self) -> nn.Module:
        return WithOffset(self.model, self.offset.t)
