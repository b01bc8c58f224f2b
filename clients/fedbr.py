"""FedBR (ICML 2023, Algorithm 1; SPEC section 1): local steps with pseudo-data.

Per step, on a local batch (x, y) and the pseudo-batch x_p (same size B, paired element-wise):
  z_l = phi(x), z_p = phi(x_p), z_g = phi_g(x_p) with phi_g the round's frozen global extractor;
  max step (theta only, features detached): theta <- theta + lr * grad L_con;
  min step (phi, omega; with the updated theta): L = CE(omega(z_l), y) + lam * CE_soft(omega(z_p), y_p)
                                                   + mu * L_con (+ the terms of the components it carries).
phi is applied once to cat(x, x_p): phi does not change between the two steps, so the max step's
detached features and the min step's features are the same values; the per-sample GroupNorm and
LayerNorm of our backbones keep the fused batch exact.

Combinations (paper Table 3) are components listed in ``fedbr-with`` (fedcm, feddecorr, fedntd, mixup,
fedprox): each adds its own term, batch transform or gradient change, in the listed order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar, cast

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedbr_flwr.core import seeds
from fedbr_flwr.core.algorithm import Batch, ClientAlgorithm, FunctionalStep, Phase, StepView, call
from fedbr_flwr.core.config import common
from fedbr_flwr.core.errors import ConfigError
from fedbr_flwr.core.losses import soft_cross_entropy
from fedbr_flwr.core.model import SplitModel
from fedbr_flwr.core.registry import register_client
from fedbr_flwr.core.settings import NON_NEGATIVE, Settings, setting
from fedbr_flwr.core.training import frozen_copy, round_sgd
from fedbr_flwr.data.catalog import INFO
from pseudodata import PseudoDataSettings, pseudo_size
from pseudodata.mixture import mix
from pseudodata.rsm import sample_means


@dataclass(frozen=True)
class FedBROwnSettings(Settings):
    """FedBR's keys beside the pseudo-data's. The defaults are the authors'."""

    lam: float = setting(
        "fedbr-lambda", 1.0, "weight of component 1, the balancing loss on pseudo-data", check=NON_NEGATIVE
    )
    mu: float = setting("fedbr-mu", 0.5, "weight of component 2, the contrastive loss L_con", check=NON_NEGATIVE)
    tau1: float = setting(
        "fedbr-tau1-scale", 2.0, "positive-pair similarity scale: s1 = tau1 * cos (multiplied form)", check=NON_NEGATIVE
    )
    tau2: float = setting(
        "fedbr-tau2-scale",
        2.0,
        "negative-pair similarity scale: s2 = tau2 * cos; 0 drops the negative pair's dependence",
        check=NON_NEGATIVE,
    )
    proj_hidden: int = setting(
        "fedbr-proj-hidden", 0, "projection head hidden width; 0 = 2 x feature size", check=NON_NEGATIVE
    )
    proj_out: int = setting("fedbr-proj-out", 0, "projection head output width; 0 = feature size", check=NON_NEGATIVE)
    balance: bool = setting("fedbr-balance", True, "component 1 (classifier balancing on pseudo-data)")
    contrastive: bool = setting(
        "fedbr-contrastive", True, "component 2 (min-max contrastive step with the projection head)"
    )
    max_step: bool = setting(
        "fedbr-max-step",
        True,
        "component 2's max step on the projection head (false: min step only, theta stays at its initialisation)",
    )
    balance_loss: str = setting(
        "fedbr-balance-loss",
        "soft-ce",
        "component 1's loss: per-sample soft cross-entropy "
        "(FedBR) or cross-entropy of the mean softmax output (FedAug's AugMean)",
        choices=("soft-ce", "mean-output"),
    )
    combine: tuple = setting(
        "fedbr-with",
        "none",
        "components FedBR's local steps also carry, comma-separated "
        "(paper Table 3): fedcm, feddecorr, fedntd, mixup (the Mixup backbone), fedprox",
        names=True,
    )


@dataclass(frozen=True)
class FedBRSettings(PseudoDataSettings, FedBROwnSettings):
    """FedBR's keys, then the pseudo-data's (``pseudodata.PseudoDataSettings``, which reads them there): a
    dataclass lists its bases' fields from the last base to the first."""

    @classmethod
    def check(cls, cfg):
        run, own = common(cfg), cls.from_config(cfg)
        if not own.balance and not own.contrastive:
            raise ConfigError(
                "fedbr-balance and fedbr-contrastive are both false: that is FedAvg "
                "(use strategy=fedavg, or strategy=mixup for the Mixup backbone)"
            )
        if not own.contrastive and not own.max_step:
            raise ConfigError("fedbr-max-step = false only applies with fedbr-contrastive = true")
        if own.contrastive and own.pseudo_size not in (0, run.batch_size):
            raise ConfigError(
                f"pseudo-size = {own.pseudo_size} but batch-size = {run.batch_size}: component 2 "
                "pairs pseudo-samples with local samples one to one, so they must be equal "
                "(pseudo-size = 0 follows batch-size)"
            )


# ---------------------------------------------------------------- model pieces and losses


class ProjectionHead(nn.Module):
    """FedBR's projection head theta, used only in training: d -> hidden -> hidden -> out with ReLU
    between (SPEC: 128 -> 256 -> 256 -> 128 for the MNIST CNN)."""

    def __init__(self, feature_dim: int, hidden: int = 0, out: int = 0):
        super().__init__()
        hidden = hidden or 2 * feature_dim
        out = out or feature_dim
        self.net = nn.Sequential(
            nn.Linear(feature_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, out)
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


def mean_output_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """FedAug's AugMean (eq. 3 of the earlier version): cross-entropy between the batch's MEAN softmax
    output and the mean target (the uniform prior for RSM pseudo-data)."""
    mean_prob = F.softmax(logits, dim=1).mean(dim=0)
    return -(target.mean(dim=0) * torch.log(mean_prob.clamp_min(1e-12))).sum()


def fedbr_contrastive_loss(
    p_local_pseudo: torch.Tensor,
    p_global_pseudo: torch.Tensor,
    p_local_real: torch.Tensor,
    tau1_scale: float,
    tau2_scale: float,
) -> torch.Tensor:
    """FedBR's L_con on projected features, pairs matched element-wise:
    mean_i -log(e^{s1_i} / (e^{s1_i} + e^{s2_i})) with s1 = tau1 * cos(local pseudo, global pseudo) and
    s2 = tau2 * cos(local pseudo, local real). Written as softplus(s2 - s1), which is the same value
    without overflow."""
    return contrastive_from_cosines(
        *pair_cosines(p_local_pseudo, p_global_pseudo, p_local_real), tau1_scale, tau2_scale
    )


def contrastive_from_cosines(
    positive: torch.Tensor, negative: torch.Tensor, tau1_scale: float, tau2_scale: float
) -> torch.Tensor:
    return F.softplus(tau2_scale * negative - tau1_scale * positive).mean()


def pair_cosines(
    p_local_pseudo: torch.Tensor, p_global_pseudo: torch.Tensor, p_local_real: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sample: cos(local pseudo, global pseudo), the positive pair, and cos(local pseudo, local real),
    the negative pair."""
    return (
        F.cosine_similarity(p_local_pseudo, p_global_pseudo, dim=1),
        F.cosine_similarity(p_local_pseudo, p_local_real, dim=1),
    )


T = TypeVar("T")


def required(value: T | None, what: str) -> T:
    """``value``, which the settings in use guarantee; None means the step was built without it."""
    if value is None:
        raise RuntimeError(f"FedBR's step was built without {what}")
    return value


# ---------------------------------------------------------------- the local step


class FedBRStep(FunctionalStep):
    """Groups "model" (phi, omega) and, with component 2, "head" (theta). Phases: the max step on theta
    (gradient ascent on L_con, features detached), then the min step on (phi, omega) with the updated
    theta. The features of cat(x, x_p) are computed once per step and shared by both phases."""

    per_member_state = ("local_pool",)  # the mixture's local partners, drawn in draw

    def __init__(
        self,
        model: SplitModel,
        cfg: dict,
        settings: FedBRSettings,
        head: nn.Module | None,
        pseudo_x: torch.Tensor,
        pseudo_y: torch.Tensor,
        local_pool: tuple[torch.Tensor, torch.Tensor] | None = None,
        seed: int = 0,
        components=(),
    ):
        super().__init__(model, cfg, components)  # SGD on (phi, omega)
        self.s = settings
        self.balance_loss = mean_output_cross_entropy if settings.balance_loss == "mean-output" else soft_cross_entropy
        self.num_classes = model.classifier.out_features
        self.x_p, self.y_p = pseudo_x, pseudo_y
        self.mix_k = settings.mixture_k if settings.pseudo_data == "mixture" else 0
        self.local_pool = local_pool
        self.generator = torch.Generator(device=pseudo_x.device).manual_seed(seed)
        self.head = head
        self.global_features: nn.Module | None = None
        self.z_g_fixed: torch.Tensor | None = None
        self.prepare_groups = ("model",)
        self.phases = [Phase(("model",), self.min_loss, adjust=True)]
        if settings.contrastive:
            if head is None:
                raise ValueError("component 2 needs the projection head")
            self.groups["head"] = dict(head.named_parameters())
            self.optimizers["head"] = round_sgd(head, head.parameters(), cfg)
            self.head_start = [p.detach().clone() for p in head.parameters()]
            self.global_features = frozen_copy(model.features)
            if self.mix_k == 0:  # the pseudo-batch is the same at every step: its global features too
                self.z_g_fixed = self.global_feature(self.x_p)
            if settings.max_step:
                self.phases.insert(0, Phase(("head",), self.max_loss, ascent=True))
        if self.mix_k and local_pool is None:
            raise ValueError("mixture pseudo-data with mixture-k > 0 needs the client's local samples")

    @torch.no_grad()
    def global_feature(self, x_p: torch.Tensor) -> torch.Tensor:
        return required(self.global_features, "the frozen global feature extractor (component 2)")(x_p)

    def draw(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """The local batch (transformed by the components, e.g. mixed by Mixup) and the pseudo-batch
        ("x_p", "y_p": mixed with fresh local samples for mixture pseudo-data) with, for component 2, its
        global features "z_g"."""
        x_p, y_p = self.x_p, self.y_p
        if self.mix_k:
            pool_x, pool_y = required(self.local_pool, "the client's local samples (mixture-k > 0)")
            idx = torch.randint(0, len(pool_y), (self.mix_k, len(x_p)), device=pool_y.device, generator=self.generator)
            x_p, y_p = mix(x_p, y_p, pool_x[idx], pool_y[idx], self.num_classes)
        inputs = {**self.transform(Batch(x, y)).tensors(), "x_p": x_p, "y_p": y_p}
        if self.s.contrastive:
            inputs["z_g"] = self.z_g_fixed if self.z_g_fixed is not None else self.global_feature(x_p)
        return inputs

    def prepare(self, params, inputs) -> dict[str, torch.Tensor]:
        """phi once on cat(x, x_p): the local and pseudo features ("z_l", "z_p")."""
        n = len(inputs["x"])
        z = call(self.model.features, params["model"], "features", torch.cat([inputs["x"], inputs["x_p"]]))
        return {"z_l": z[:n], "z_p": z[n:]}

    def projections(
        self, head: dict, z_p: torch.Tensor, z_g: torch.Tensor, z_l: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        projected = call(required(self.head, "the projection head"), head, "", torch.cat([z_p, z_g, z_l]))  # one call
        p_p, p_g, p_l = projected.split([len(z_p), len(z_g), len(z_l)])
        return p_p, p_g, p_l

    def max_loss(self, params, inputs, shared) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """L_con w.r.t. theta only (features detached); the phase ascends it."""
        z_p, z_l = shared["z_p"].detach(), shared["z_l"].detach()
        loss = fedbr_contrastive_loss(
            *self.projections(params["head"], z_p, inputs["z_g"], z_l), self.s.tau1, self.s.tau2
        )
        return loss, {"con-max": loss}

    def min_loss(self, params, inputs, shared) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The min step's loss and its terms; a switched-off component contributes no term at all."""
        local = Batch.from_tensors(inputs)
        z_l, z_p, model = shared["z_l"], shared["z_p"], params["model"]
        logits = call(self.model.classifier, model, "classifier", torch.cat([z_l, z_p]) if self.s.balance else z_l)
        logits_l = logits[: len(z_l)]
        ce = local.cross_entropy(logits_l)
        terms = {"ce": ce}
        total = ce
        if self.s.balance:
            terms["balance"] = self.balance_loss(logits[len(z_l) :], inputs["y_p"])
            total = total + self.s.lam * terms["balance"]
        if self.s.contrastive:
            positive, negative = pair_cosines(*self.projections(params["head"], z_p, inputs["z_g"], z_l))
            terms["con"] = contrastive_from_cosines(positive, negative, self.s.tau1, self.s.tau2)
            total = total + self.s.mu * terms["con"]
            # is component 2 doing anything? (reported, not trained on)
            terms["con-cos-pos"], terms["con-cos-neg"] = positive.detach().mean(), negative.detach().mean()
        terms["loss"] = self.add_terms(total, terms, StepView(local, z_l, logits_l, list(model.values())))
        return terms["loss"], terms


# ---------------------------------------------------------------- the client side


@register_client("fedbr")
class FedBRClient(ClientAlgorithm):
    """Sends (phi, omega, theta) as 'model/...' and 'head/...'; answers the server's 'rsm-means' request;
    keeps the pseudo-data it was sent in its node state, so that it travels once and not every round."""

    vectorised = True
    graph_checked_on_gpu = True
    Settings = FedBRSettings
    component_key = "fedbr-with"
    seed_streams = {"mixup": "fedbr-mixup"}

    @classmethod
    def extra_modules(cls, model, cfg):
        s = FedBRSettings.from_config(cfg)
        return {"head": ProjectionHead(model.feature_dim, s.proj_hidden, s.proj_out)} if s.contrastive else {}

    def requests(self):
        return {"rsm-means": self.rsm_means}

    def rsm_means(self, config: dict) -> dict[str, np.ndarray]:
        """Only these means leave the client, never its samples."""
        generator = seeds.torch_generator(
            "rsm-means", common(self.cfg).seed, int(config["version"]), self.pid, device=self.data.x_train.device
        )
        means = sample_means(self.data.x_train, int(config["count"]), int(config["pseudo-m"]), generator)
        return {"means": means.cpu().numpy()}

    def pseudo_data(self, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.shared("pseudo", config)
        expected = (pseudo_size(self.cfg), INFO[common(self.cfg).dataset].num_classes)
        if (len(x), y.shape[1]) != expected:
            raise RuntimeError(f"pseudo-data has {len(x)} samples of {y.shape[1]} classes, expected {expected}")
        return x, y

    def after_fit(self, step: FedBRStep) -> tuple[dict, dict[str, float]]:
        """Beside the step's terms: how far theta moved this round (||theta_end - theta_start||)."""
        returned, metrics = super().after_fit(step)
        if self.settings.contrastive:
            head = required(step.head, "the projection head")
            moved = sum(((p.detach() - p0) ** 2).sum() for p, p0 in zip(head.parameters(), step.head_start))
            metrics = {**metrics, "head-update-norm": float(torch.sqrt(cast(torch.Tensor, moved)))}
        return returned, metrics

    def make_step(self, server_round: int, config: dict) -> FedBRStep:
        x_p, y_p = self.pseudo_data(config)
        components = self.start_components(server_round)
        return FedBRStep(
            self.model,
            self.cfg,
            self.settings,
            self.modules.get("head"),
            x_p,
            y_p,
            (self.data.x_train, self.data.y_train),
            seed=self.round_seed("fedbr-steps", server_round),
            components=components,
        )
