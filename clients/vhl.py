"""VHL, virtual homogeneity learning (Tang et al. 2022). The server draws labelled virtual data once from
an untrained class-conditional generator and broadcasts it (strategies/vhl.py). The classifier has 2C
outputs: virtual class c is trained as label C + c, past the real ones. Each local step adds, on a
virtual batch of the local batch's size:

    vhl-weight * CE(omega(phi(x_v)), C + c_v)
    + vhl-align-weight * SupCon(real features -> virtual features of the same class, tau = vhl-tau).

Predictions on real data use the first C logits only."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fedbr_flwr.core.algorithm import ClientAlgorithm, FunctionalStep, call
from fedbr_flwr.core.model import SplitModel
from fedbr_flwr.core.registry import register_client
from fedbr_flwr.core.settings import NON_NEGATIVE, POSITIVE, Settings, setting


@dataclass(frozen=True)
class VHLSettings(Settings):
    size: int = setting("vhl-size", 2000, "VHL: virtual samples, spread evenly over the classes", check=POSITIVE)
    weight: float = setting(
        "vhl-weight",
        1.0,
        "VHL: weight of the cross-entropy on virtual data (labels shifted past the real ones)",
        check=NON_NEGATIVE,
    )
    align_weight: float = setting(
        "vhl-align-weight",
        1.0,
        "VHL: weight of the feature alignment (supervised contrastive) loss",
        check=NON_NEGATIVE,
    )
    tau: float = setting("vhl-tau", 0.07, "VHL: temperature of the feature alignment loss", check=POSITIVE)


def vhl_model(backbone: SplitModel) -> SplitModel:
    """The backbone with a classifier over 2C classes (real, then virtual)."""
    c = backbone.classifier.out_features
    return SplitModel(backbone.features, backbone.feature_dim, 2 * c)


class RealClasses(nn.Module):
    """The model's logits of the C real classes only."""

    def __init__(self, model: nn.Module, num_classes: int):
        super().__init__()
        self.model, self.num_classes = model, num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)[:, : self.num_classes]


def supervised_alignment_loss(
    z_real: torch.Tensor, y_real: torch.Tensor, z_virtual: torch.Tensor, y_virtual: torch.Tensor, tau: float
) -> torch.Tensor:
    """VHL's feature alignment as a supervised contrastive loss: each real feature (anchor) against the
    batch's virtual features; positives are the virtual samples of the anchor's class. Anchors with no
    positive in the batch are left out."""
    sim = F.normalize(z_real, dim=1) @ F.normalize(z_virtual, dim=1).T / tau  # (B_real, B_virtual)
    log_prob = sim - torch.logsumexp(sim, dim=1, keepdim=True)
    positive = (y_real[:, None] == y_virtual[None, :]).to(sim.dtype)
    count = positive.sum(dim=1)
    per_anchor = -(log_prob * positive).sum(dim=1) / count.clamp_min(1)
    has = (count > 0).to(sim.dtype)
    return (per_anchor * has).sum() / has.sum().clamp_min(1)


class VHLStep(FunctionalStep):
    """One phase on the model: CE on the local batch, plus the weighted CE and alignment on a virtual batch
    of the same size drawn (in ``draw``, from this client's seeded stream) from the round's virtual data."""

    def __init__(
        self,
        model: SplitModel,
        cfg: dict,
        settings: VHLSettings,
        virtual_x: torch.Tensor,
        virtual_y: torch.Tensor,
        seed: int,
    ):
        super().__init__(model, cfg)
        self.s = settings
        self.virtual_x, self.virtual_y = virtual_x, virtual_y
        self.num_classes = model.classifier.out_features // 2
        self.generator = torch.Generator(device=virtual_x.device).manual_seed(seed)

    def draw(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """The local batch and a virtual batch of its size ("x_v", "y_v")."""
        idx = torch.randint(0, len(self.virtual_y), (len(y),), device=self.virtual_y.device, generator=self.generator)
        return {"x": x, "y": y, "x_v": self.virtual_x[idx], "y_v": self.virtual_y[idx]}

    def loss(self, params, inputs, shared):
        x, y, x_v, y_v = inputs["x"], inputs["y"], inputs["x_v"], inputs["y_v"]
        model = params["model"]
        n = len(y)
        # one pass: per-sample normalisation keeps it exact
        z = call(self.model.features, model, "features", torch.cat([x, x_v]))
        z_real, z_virtual = z[:n], z[n:]
        logits = call(self.model.classifier, model, "classifier", z)
        ce = F.cross_entropy(logits[:n], y)
        ce_virtual = F.cross_entropy(logits[n:], y_v + self.num_classes)
        align = supervised_alignment_loss(z_real, y, z_virtual, y_v, self.s.tau)
        loss = ce + self.s.weight * ce_virtual + self.s.align_weight * align
        return loss, {"loss": loss, "ce": ce, "ce-virtual": ce_virtual, "align": align}


@register_client("vhl")
class VHLClient(ClientAlgorithm):
    vectorised = True
    Settings = VHLSettings

    @classmethod
    def build_model(cls, backbone, cfg):
        return vhl_model(backbone)

    @classmethod
    def predictor(cls, model, cfg):
        return RealClasses(model, model.classifier.out_features // 2)

    def make_step(self, server_round: int, config: dict) -> VHLStep:
        x, y = self.shared("vhl", config)
        return VHLStep(self.model, self.cfg, self.settings, x, y.long(), self.round_seed("vhl-steps", server_round))
