"""Local steps built the way a client builds them, for tests on small tensors."""

import torch

from fedbr_flwr.core.algorithm import RoundContext, component_class
from fedbr_flwr.core.config import components_of


def started_components(cfg, model, received=None, seed=0):
    """The components ``cfg`` selects, set up for a round on ``model`` with ``received`` arrays."""
    components = [component_class(name)(cfg) for name in components_of(cfg)]
    ctx = RoundContext(model, received or {}, lambda stream: seed, torch.device("cpu"))
    for component in components:
        component.start_round(ctx)
    return components


def named_like(model, prefix, fill):
    """Arrays named '<prefix>/<state key>' of ``model``, all set to ``fill``."""
    return {f"{prefix}/{k}": torch.full_like(v, fill).numpy() for k, v in model.state_dict().items()}
