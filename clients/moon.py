"""MOON (Li et al. 2021). The projection layers are part of the model: the representation is
z = P(phi(x)) with P a 2-layer MLP (moon-proj-hidden 256, moon-proj-out 128), and the classifier reads z.
Loss: CE + mu * l_con with

    l_con = -log(e^{cos(z, z_glob)/tau} / (e^{cos(z, z_glob)/tau} + e^{cos(z, z_prev)/tau})),

z_glob from the round's global model, z_prev from THIS client's own last local model (kept in its
node state). Before a client's first round it has no last model: the global model stands in, so l_con
is the constant log 2 and adds no gradient (as in MOON's code)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from fedbr_flwr.core.algorithm import ClientAlgorithm, FunctionalStep, call
from fedbr_flwr.core.model import SplitModel
from fedbr_flwr.core.registry import register_client
from fedbr_flwr.core.settings import NON_NEGATIVE, POSITIVE, Settings, setting
from fedbr_flwr.core.training import frozen_copy, load_module_arrays, module_arrays

PREVIOUS_KEY = "moon-previous"
PREVIOUS_PREFIX = "prev/"  # the previous features' tensors among a step's inputs


@dataclass(frozen=True)
class MoonSettings(Settings):
    mu: float = setting(
        "moon-mu", 1.0, "MOON: weight of the model-contrastive loss (paper grid 0.01-10)", check=NON_NEGATIVE
    )
    tau: float = setting("moon-tau", 0.5, "MOON: temperature of the model-contrastive loss", check=POSITIVE)
    proj_hidden: int = setting(
        "moon-proj-hidden", 256, "MOON: width of the projection layers added to the feature extractor", check=POSITIVE
    )
    proj_out: int = setting(
        "moon-proj-out", 128, "MOON: output width of the projection layers (the representation)", check=POSITIVE
    )


def moon_model(backbone: SplitModel, settings: MoonSettings) -> SplitModel:
    d, hidden, out = backbone.feature_dim, settings.proj_hidden, settings.proj_out
    features = nn.Sequential(backbone.features, nn.Linear(d, hidden), nn.ReLU(), nn.Linear(hidden, out))
    return SplitModel(features, out, backbone.classifier.out_features)


def moon_contrastive_loss(
    z: torch.Tensor, z_global: torch.Tensor, z_previous: torch.Tensor, tau: float
) -> torch.Tensor:
    """mean_i -log(e^{cos(z, z_glob)/tau} / (e^{cos(z, z_glob)/tau} + e^{cos(z, z_prev)/tau})), as softplus of
    the difference (same value, no overflow)."""
    pos = F.cosine_similarity(z, z_global, dim=1) / tau
    neg = F.cosine_similarity(z, z_previous, dim=1) / tau
    return F.softplus(neg - pos).mean()


class MoonStep(FunctionalStep):
    """CE + mu * l_con in one phase on the "model" group. The global features are the same for every
    client of a round (read from the frozen copy); this client's previous features come as per-client
    constants ("prev/<name>", copied when the step is made: a cohort's members share the module that
    holds them), evaluated with ``previous_features`` as the template."""

    per_member_state = ("previous", "previous_features")  # as constants; the module is a template

    def __init__(self, model: SplitModel, cfg: dict, settings: MoonSettings, previous_features: nn.Module | None):
        super().__init__(model, cfg)
        self.global_features = frozen_copy(model.features)
        self.previous_features = previous_features if previous_features is not None else self.global_features
        self.previous = {
            PREVIOUS_PREFIX + name: t.detach().clone()
            for name, t in [*self.previous_features.named_parameters(), *self.previous_features.named_buffers()]
        }
        self.mu, self.tau = settings.mu, settings.tau

    def constants(self) -> dict[str, torch.Tensor]:
        return self.previous

    def loss(self, params, inputs, shared):
        x, y, model = inputs["x"], inputs["y"], params["model"]
        z = call(self.model.features, model, "features", x)
        ce = F.cross_entropy(call(self.model.classifier, model, "classifier", z), y)
        previous = {k[len(PREVIOUS_PREFIX) :]: v for k, v in inputs.items() if k.startswith(PREVIOUS_PREFIX)}
        with torch.no_grad():
            z_global, z_previous = self.global_features(x), call(self.previous_features, previous, "", x)
        con = moon_contrastive_loss(z, z_global, z_previous, self.tau)
        loss = ce + self.mu * con
        return loss, {"loss": loss, "ce": ce, "con": con}


@register_client("moon")
class MoonClient(ClientAlgorithm):
    vectorised = True
    Settings = MoonSettings
    state_keys = (PREVIOUS_KEY,)

    @classmethod
    def build_model(cls, backbone, cfg):
        return moon_model(backbone, MoonSettings.from_config(cfg))

    def __init__(self, cfg, data, device, state=None):
        super().__init__(cfg, data, device, state)
        self.previous = copy.deepcopy(self.model.features).requires_grad_(False)  # reloaded each round

    def make_step(self, server_round: int, config: dict) -> MoonStep:
        previous = None
        stored = self.state.arrays(PREVIOUS_KEY)
        if stored is not None:
            load_module_arrays(self.previous, "features", stored)
            previous = self.previous.eval()
        return MoonStep(self.model, self.cfg, self.settings, previous)

    def after_fit(self, step: MoonStep):
        self.state.put_arrays(PREVIOUS_KEY, module_arrays("features", self.model.features))
        return {}, {}
