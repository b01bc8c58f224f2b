"""FedBR (ICML 2023, Algorithm 1; SPEC section 1): local steps with pseudo-data.

Per step, on a local batch (x, y) and the pseudo-batch x_p (same size B, paired element-wise):
  z_l = phi(x), z_p = phi(x_p), z_g = phi_g(x_p) with phi_g the round's frozen global extractor;
  max step (theta only, features detached): theta <- theta + lr * grad L_con;
  min step (phi, omega; with the updated theta): L = CE(omega(z_l), y) + lam * CE_soft(omega(z_p), y_p)
                                                   + mu * L_con.
phi is applied once to cat(x, x_p): phi does not change between the two steps, so the max step's
detached features and the min step's features are the same values; the per-sample GroupNorm and
LayerNorm of our backbones keep the fused batch exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedbr_flwr.config import pseudo_size
from fedbr_flwr.dataset import INFO
from fedbr_flwr.losses import (MixupSampler, blend_with_global_momentum, decorrelation_loss, fedbr_contrastive_loss,
                               mean_output_cross_entropy, mixup_batch, mixup_cross_entropy,
                               not_true_distillation_loss, soft_cross_entropy)
from fedbr_flwr.model import ProjectionHead, SplitModel
from fedbr_flwr.registry import register_client
from fedbr_flwr.training import Algorithm, frozen_copy, parameter_tensors, round_sgd, step_seed
from pseudodata.mixture import mix
from pseudodata.rsm import sample_means

from .base import BaseClient


@dataclass
class StepBatch:
    """One step's inputs: the local batch (mixed when Mixup is on: targets y_a, y_b with weight lam)
    and the pseudo-batch with its soft labels and, for component 2, its global features."""
    x: torch.Tensor
    y_a: torch.Tensor
    y_b: torch.Tensor
    lam: float
    x_p: torch.Tensor
    y_p: torch.Tensor
    z_g: torch.Tensor | None


class FedBR(Algorithm):
    def __init__(self, model: SplitModel, cfg: dict, head: nn.Module | None, pseudo_x: torch.Tensor,
                 pseudo_y: torch.Tensor, local_pool: tuple[torch.Tensor, torch.Tensor] | None = None,
                 seed: int = 0, global_momentum: list[torch.Tensor] | None = None):
        super().__init__(model, cfg)  # SGD on (phi, omega)
        self.params = [p for p in model.parameters()]
        self.balance = cfg["fedbr-balance"]
        self.contrastive = cfg["fedbr-contrastive"]
        self.use_max_step = cfg["fedbr-max-step"]
        self.balance_loss = mean_output_cross_entropy if cfg["fedbr-balance-loss"] == "mean-output" \
            else soft_cross_entropy
        self.lam, self.mu = cfg["fedbr-lambda"], cfg["fedbr-mu"]
        self.tau1, self.tau2 = cfg["fedbr-tau1-scale"], cfg["fedbr-tau2-scale"]
        self.num_classes = model.classifier.out_features
        self.x_p, self.y_p = pseudo_x, pseudo_y
        self.mix_k = cfg["mixture-k"] if cfg["pseudo-data"] == "mixture" else 0
        self.local_pool = local_pool
        device = pseudo_x.device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.mixup = MixupSampler(cfg["mixup-alpha"], seed + 1, device) if cfg["mixup"] else None
        self.head = head
        self.combined = cfg["fedbr-with"]  # paper Table 3: one more method's local term
        if self.combined == "fedcm" and global_momentum is None:
            raise ValueError("fedbr-with=fedcm needs the server's global update direction")
        self.global_momentum = global_momentum
        self.global_model: nn.Module | None = None  # FedNTD's teacher: the model as received this round
        if self.combined == "fedntd":
            self.global_model = frozen_copy(model)
        self.global_features: nn.Module | None = None
        self.z_g_fixed: torch.Tensor | None = None
        if self.contrastive:
            if head is None:
                raise ValueError("component 2 needs the projection head")
            self.head_optimizer = round_sgd(head, head.parameters(), cfg)
            self.global_features = self.global_model.features if self.global_model is not None \
                else frozen_copy(model.features)
            if self.mix_k == 0:  # the pseudo-batch is the same at every step: its global features too
                self.z_g_fixed = self.global_feature(self.x_p)
        if self.mix_k and local_pool is None:
            raise ValueError("mixture pseudo-data with mixture-k > 0 needs the client's local samples")

    @torch.no_grad()
    def global_feature(self, x_p: torch.Tensor) -> torch.Tensor:
        return self.global_features(x_p)

    def make_batch(self, x: torch.Tensor, y: torch.Tensor) -> StepBatch:
        x_p, y_p = self.x_p, self.y_p
        if self.mix_k:
            pool_x, pool_y = self.local_pool
            idx = torch.randint(0, len(pool_y), (self.mix_k, len(x_p)), device=pool_y.device,
                                generator=self.generator)
            x_p, y_p = mix(x_p, y_p, pool_x[idx], pool_y[idx], self.num_classes)
        z_g = None
        if self.contrastive:
            z_g = self.z_g_fixed if self.z_g_fixed is not None else self.global_feature(x_p)
        y_b, lam = y, 1.0
        if self.mixup is not None:
            lam, perm = self.mixup(len(y))
            x, _, y_b = mixup_batch(x, y, lam, perm)
        return StepBatch(x, y, y_b, lam, x_p, y_p, z_g)

    def features(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.model.features(torch.cat([batch.x, batch.x_p]))
        return z[:len(batch.x)], z[len(batch.x):]

    def contrastive_loss(self, z_p: torch.Tensor, z_g: torch.Tensor, z_l: torch.Tensor) -> torch.Tensor:
        p_p, p_g, p_l = self.head(torch.cat([z_p, z_g, z_l])).split([len(z_p), len(z_g), len(z_l)])  # one call
        return fedbr_contrastive_loss(p_p, p_g, p_l, self.tau1, self.tau2)

    def max_step(self, z_p: torch.Tensor, z_g: torch.Tensor, z_l: torch.Tensor) -> torch.Tensor:
        """Gradient ASCENT on L_con w.r.t. theta only (features are detached); returns L_con before it."""
        loss = self.contrastive_loss(z_p.detach(), z_g, z_l.detach())
        self.head_optimizer.zero_grad(set_to_none=True)
        (-loss).backward()
        self.head_optimizer.step()
        return loss.detach()

    def objective(self, batch: StepBatch, z_l: torch.Tensor, z_p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The min step's loss and its terms; a switched-off component contributes no term at all."""
        logits = self.model.classifier(torch.cat([z_l, z_p]) if self.balance else z_l)
        logits_l = logits[:len(z_l)]
        ce = mixup_cross_entropy(logits_l, batch.y_a, batch.y_b, batch.lam) if self.mixup is not None \
            else F.cross_entropy(logits_l, batch.y_a)
        terms = {"ce": ce}
        total = ce
        if self.balance:
            terms["balance"] = self.balance_loss(logits[len(z_l):], batch.y_p)
            total = total + self.lam * terms["balance"]
        if self.contrastive:
            terms["con"] = self.contrastive_loss(z_p, batch.z_g, z_l)
            total = total + self.mu * terms["con"]
        if self.combined == "feddecorr":
            terms["decorr"] = decorrelation_loss(z_l)
            total = total + self.cfg["feddecorr-weight"] * terms["decorr"]
        elif self.combined == "fedntd":
            with torch.no_grad():
                global_logits = self.global_model(batch.x)
            terms["ntd"] = not_true_distillation_loss(logits_l, global_logits, batch.y_a, self.cfg["fedntd-tau"])
            total = total + self.cfg["fedntd-beta"] * terms["ntd"]
        terms["loss"] = total
        return terms

    def min_step(self, loss: torch.Tensor) -> None:
        """SGD on (phi, omega) only: gradients are not even accumulated into theta."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward(inputs=self.params)
        if self.global_momentum is not None:  # FedCM's step direction on (phi, omega)
            blend_with_global_momentum([p.grad for p in self.params], self.global_momentum, self.cfg["fedcm-alpha"])
        self.optimizer.step()

    def update(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        batch = self.make_batch(x, y)
        z_l, z_p = self.features(batch)
        stats = {}
        if self.contrastive and self.use_max_step:
            stats["con-max"] = self.max_step(z_p, batch.z_g, z_l)
        terms = self.objective(batch, z_l, z_p)
        self.min_step(terms["loss"])
        return {**stats, **{k: v.detach() for k, v in terms.items()}}


def build_head(cfg: dict[str, Any], feature_dim: int) -> ProjectionHead | None:
    if not cfg["fedbr-contrastive"]:
        return None
    return ProjectionHead(feature_dim, cfg["fedbr-proj-hidden"], cfg["fedbr-proj-out"])


@register_client("fedbr")
class FedBRClient(BaseClient):
    """Sends (phi, omega, theta); answers the server's request for RSM means; keeps the pseudo-data it
    was sent in Flower's per-node state, so that it travels once and not every round."""
    algorithm = FedBR

    def __init__(self, cfg, data, device, state=None):
        super().__init__(cfg, data, device, state)
        self.takes_extras = cfg["fedbr-with"] == "fedcm"  # FedCM's Delta comes after the weights
        head = build_head(cfg, self.model.feature_dim)
        self.head = head.to(device) if head is not None else None

    def weight_modules(self) -> list[nn.Module]:
        return [self.model] if self.head is None else [self.model, self.head]

    def get_parameters(self, config: dict) -> list[np.ndarray]:
        if config.get("pseudo-request") == "rsm":
            return [self.rsm_means(int(config["count"]), int(config["pseudo-m"]), int(config["version"]))]
        return super().get_parameters(config)

    def rsm_means(self, count: int, m: int, version: int) -> np.ndarray:
        """Only these means leave the client, never its samples."""
        generator = torch.Generator(device=self.data.x_train.device)
        generator.manual_seed(step_seed(self.cfg["seed"], version, self.pid, 101))
        return sample_means(self.data.x_train, count, m, generator).cpu().numpy()

    def pseudo_data(self, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.shared("pseudo", config)
        expected = (pseudo_size(self.cfg), INFO[self.cfg["dataset"]].num_classes)
        if (len(x), y.shape[1]) != expected:
            raise RuntimeError(f"pseudo-data has {len(x)} samples of {y.shape[1]} classes, expected {expected}")
        return x, y

    def make_algorithm(self, server_round: int, config: dict) -> FedBR:
        x_p, y_p = self.pseudo_data(config)
        momentum = parameter_tensors(self.model, self.extras, self.device) if self.takes_extras else None
        return FedBR(self.model, self.cfg, self.head, x_p, y_p, (self.data.x_train, self.data.y_train),
                     seed=step_seed(self.cfg["seed"], server_round, self.pid, 102), global_momentum=momentum)
