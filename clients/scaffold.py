"""SCAFFOLD (Karimireddy et al. 2020, Algorithm 1 with option II). Client i keeps its control variate
c_i across rounds (Flower's per-node state; zero at first). Each local step corrects the gradient:
y <- y - lr (g(y) - c_i + c). After K steps: c_i+ = c_i - c + (x - y) / (K lr). The client returns y,
then Delta c_i = c_i+ - c_i (laid out like the model's state; the server adds sum_i Delta c_i / N to c).
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.common import ArrayRecord
from torch.nn import functional as F

from fedbr_flwr.registry import register_client
from fedbr_flwr.training import Algorithm, parameter_tensors, state_arrays

from .base import BaseClient


class Scaffold(Algorithm):
    def __init__(self, model, cfg, c_global: list[torch.Tensor], c_local: list[torch.Tensor]):
        super().__init__(model, cfg)
        self.params = list(model.parameters())
        self.start = [p.detach().clone() for p in self.params]
        self.c_global, self.c_local = c_global, c_local
        self.correction = torch._foreach_sub(c_global, c_local)  # c - c_i, added to every gradient
        self.steps = 0

    def update(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = F.cross_entropy(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch._foreach_add_([p.grad for p in self.params], self.correction)
        self.optimizer.step()
        self.steps += 1
        return {"loss": loss.detach()}

    @torch.no_grad()
    def new_control_variate(self) -> list[torch.Tensor]:
        """Option II: c_i+ = c_i - c + (x - y) / (K lr)."""
        scale = 1.0 / (self.steps * self.cfg["lr"])
        return [cl - cg + (x0 - p) * scale for cl, cg, x0, p in zip(self.c_local, self.c_global, self.start,
                                                                     self.params)]


CONTROL_KEY = "scaffold-control"


@register_client("scaffold")
class ScaffoldClient(BaseClient):
    state_keys = (CONTROL_KEY,)
    algorithm = Scaffold
    takes_extras = True  # c, after the model

    def local_control(self) -> list[torch.Tensor]:
        if CONTROL_KEY in self.state:
            return [torch.as_tensor(a, device=self.device) for a in self.state[CONTROL_KEY].to_numpy_ndarrays()]
        return [torch.zeros_like(p) for p in self.model.parameters()]

    def make_algorithm(self, server_round: int, config: dict) -> Scaffold:
        c_global = parameter_tensors(self.model, self.extras, self.device)
        return Scaffold(self.model, self.cfg, c_global, self.local_control())

    def after_fit(self, algorithm: Scaffold) -> list[np.ndarray]:
        new = algorithm.new_control_variate()
        self.state[CONTROL_KEY] = ArrayRecord([c.cpu().numpy().copy() for c in new])
        return state_arrays(self.model, torch._foreach_sub(new, algorithm.c_local))
