"""SCAFFOLD (Karimireddy et al. 2020, Algorithm 1 with option II). Client i keeps its control variate
c_i across rounds (its node state; zero at first). The server sends c as 'control/<key>'. Each local
step corrects the gradient: y <- y - lr (g(y) - c_i + c). After K steps: c_i+ = c_i - c + (x - y) / (K lr)
(with SGD momentum, K is the steps the momentum amounts to: ``steps_along_gradient``).
The client returns y, and Delta c_i = c_i+ - c_i as 'control-delta/<key>' (the server adds
sum_i Delta c_i / N to c).
"""

from __future__ import annotations

import torch

from clients.fedavg import SupervisedStep
from fedbr_flwr.core.algorithm import ClientAlgorithm
from fedbr_flwr.core.config import common
from fedbr_flwr.core.registry import register_client
from fedbr_flwr.core.training import parameter_tensors, state_arrays, steps_along_gradient

CONTROL = "control"  # the server's c, as sent
CONTROL_DELTA = "control-delta"  # the client's change of c_i, as returned
CONTROL_KEY = "scaffold-control"  # c_i in the node state


class ScaffoldStep(SupervisedStep):
    """FedAvg's cross-entropy step with the gradient corrected by c - c_i before SGD."""

    per_member_state = ("c_local", "correction")  # read by adjust_gradients and after the fit

    def __init__(self, model, cfg, c_global: list[torch.Tensor], c_local: list[torch.Tensor]):
        super().__init__(model, cfg)
        self.params = list(model.parameters())
        self.start = [p.detach().clone() for p in self.params]
        self.c_global, self.c_local = c_global, c_local
        self.correction = torch._foreach_sub(c_global, c_local)  # c - c_i, added to every gradient

    def adjust_gradients(self, grads: list[torch.Tensor]) -> None:
        torch._foreach_add_(grads, self.correction)

    @torch.no_grad()
    def new_control_variate(self) -> list[torch.Tensor]:
        """Option II: c_i+ = c_i - c + (x - y) / (K lr), with y the weights after the K local steps."""
        run = common(self.cfg)
        scale = 1.0 / (steps_along_gradient(run.local_steps, run.momentum) * run.lr)
        return [
            cl - cg + (x0 - p) * scale for cl, cg, x0, p in zip(self.c_local, self.c_global, self.start, self.params)
        ]


@register_client("scaffold")
class ScaffoldClient(ClientAlgorithm):
    vectorised = True
    graph_checked_on_gpu = True
    state_keys = (CONTROL_KEY,)
    accepts = (f"{CONTROL}/",)

    @classmethod
    def returned_shapes(cls, model, cfg):
        return {f"{CONTROL_DELTA}/{k}": tuple(v.shape) for k, v in model.state_dict().items()}

    def local_control(self) -> list[torch.Tensor]:
        stored = self.state.arrays(CONTROL_KEY)
        if stored is not None:
            return [torch.as_tensor(stored[name], device=self.device) for name, _ in self.model.named_parameters()]
        return [torch.zeros_like(p) for p in self.model.parameters()]

    def make_step(self, server_round: int, config: dict) -> ScaffoldStep:
        c_global = parameter_tensors(self.model, CONTROL, self.received, self.device)
        return ScaffoldStep(self.model, self.cfg, c_global, self.local_control())

    def after_fit(self, step: ScaffoldStep):
        new = step.new_control_variate()
        self.state.put_arrays(
            CONTROL_KEY, {name: c.cpu().numpy().copy() for (name, _), c in zip(self.model.named_parameters(), new)}
        )
        return state_arrays(self.model, CONTROL_DELTA, list(torch._foreach_sub(new, step.c_local))), {}
