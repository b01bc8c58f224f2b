"""FedMix (Yoon et al. 2021). Before round 1 each client answers the server's 'fedmix-means' request with
mean data: n_i // M means of M of its samples (disjoint groups of a seeded permutation), images and
one-hot labels averaged. The server gathers them from every client and broadcasts the pool once. Each
local step pairs the local batch with as many means drawn from the pool and takes FedMix's loss
(Mixup's first-order approximation around (1 - lam) x)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn import functional as F

from fedbr_flwr.core import seeds
from fedbr_flwr.core.algorithm import ClientAlgorithm, FunctionalStep, call
from fedbr_flwr.core.config import common
from fedbr_flwr.core.losses import soft_cross_entropy
from fedbr_flwr.core.registry import register_client
from fedbr_flwr.core.settings import BELOW_ONE, POSITIVE, Settings, setting


@dataclass(frozen=True)
class FedMixSettings(Settings):
    lam: float = setting(
        "fedmix-lambda",
        0.1,
        "FedMix: mixing weight lambda (0: plain cross-entropy; paper grid 0.01 / 0.1 / 0.2)",
        check=BELOW_ONE,
    )
    m: int = setting(
        "fedmix-m",
        10,
        "FedMix: local samples averaged into one mean sample; each client shares n_i // M",
        check=POSITIVE,
    )


def mean_data(
    x: torch.Tensor, y: torch.Tensor, m: int, num_classes: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """n // m means of m samples each (at least one mean, of all samples, when n < m), with the mean of
    the one-hot labels."""
    n = len(y)
    if n == 0:
        raise ValueError("cannot build mean data from a client with no training samples")
    groups = max(1, n // m)
    idx = torch.randperm(n, generator=generator, device=generator.device).to(x.device)[: groups * min(m, n)]
    idx = idx.view(groups, min(m, n))
    return x[idx].mean(dim=1), F.one_hot(y[idx], num_classes).float().mean(dim=1)


def fedmix_loss(
    model: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    x_mean: torch.Tensor,
    y_mean: torch.Tensor,
    lam: float,
) -> dict[str, torch.Tensor]:
    """FedMix (eq. 5): the first-order Taylor approximation of Mixup between a local sample x_i and a
    global mean sample (x_mean_j, y_mean_j), around (1 - lam) x_i:

        (1 - lam) CE(f((1 - lam) x_i), y_i) + lam CE_soft(f((1 - lam) x_i), y_mean_j)
        + lam <d [(1 - lam) CE(f(u), y_i)] / du at u = (1 - lam) x_i, x_mean_j>.

    The last term's gradient is that of the (1 - lam)-weighted batch-mean loss, as the reference
    implementations take it (the scale FedMix's published lambda was tuned with): each sample's input
    gradient thus carries a factor 1/B. Its inner product with the sample's mean is averaged over the
    batch. The gradient is per sample (our backbones have no batch-coupled layers) and kept in the graph,
    so that the term trains the model; ``taylor`` reports the batch-mean inner product. At lam = 0 this
    is plain cross-entropy.

    ``model`` is any function of the input (a module, or a ``functional_call`` of one): the input gradient
    comes from ``torch.func.grad``, which composes with autograd and with ``vmap`` over clients."""

    def weighted_ce(x_in: torch.Tensor):
        logits = model(x_in)
        ce_each = F.cross_entropy(logits, y, reduction="none")
        return (1.0 - lam) * ce_each.mean(), (logits, ce_each)

    grad_x, (logits, ce_each) = torch.func.grad(weighted_ce, has_aux=True)((1.0 - lam) * x)
    ce = ce_each.mean()
    mean_label = soft_cross_entropy(logits, y_mean)
    taylor = (grad_x * x_mean).flatten(1).sum(dim=1).mean()
    loss = (1.0 - lam) * ce + lam * mean_label + lam * taylor
    return {"loss": loss, "ce": ce, "mean-label": mean_label, "taylor": taylor}


class FedMixStep(FunctionalStep):
    """One phase on the "model" group; each step's means are drawn from the broadcast pool in ``draw``."""

    def __init__(self, model, cfg, lam: float, mean_x: torch.Tensor, mean_y: torch.Tensor, seed: int):
        super().__init__(model, cfg)
        self.mean_x, self.mean_y = mean_x, mean_y
        self.lam = lam
        self.generator = torch.Generator(device=mean_x.device).manual_seed(seed)

    def draw(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        idx = torch.randint(0, len(self.mean_y), (len(y),), device=self.mean_y.device, generator=self.generator)
        return {"x": x, "y": y, "x_mean": self.mean_x[idx], "y_mean": self.mean_y[idx]}

    def loss(self, params, inputs, shared):
        terms = fedmix_loss(
            lambda u: call(self.model, params["model"], "", u),
            inputs["x"],
            inputs["y"],
            inputs["x_mean"],
            inputs["y_mean"],
            self.lam,
        )
        return terms["loss"], terms


@register_client("fedmix")
class FedMixClient(ClientAlgorithm):
    vectorised = True
    Settings = FedMixSettings

    def requests(self):
        return {"fedmix-means": self.mean_data}

    def mean_data(self, config: dict):
        """Only means leave the client."""
        generator = seeds.torch_generator(
            "fedmix-means", common(self.cfg).seed, int(config["version"]), self.pid, device=self.data.x_train.device
        )
        x, y = mean_data(self.data.x_train, self.data.y_train, self.settings.m, self.data.num_classes, generator)
        return {"x": x.cpu().numpy(), "y": y.cpu().numpy()}

    def make_step(self, server_round: int, config: dict) -> FedMixStep:
        x, y = self.shared("fedmix", config)
        return FedMixStep(self.model, self.cfg, self.settings.lam, x, y, self.round_seed("fedmix-steps", server_round))
