"""FedDyn (Acar et al. 2021): client k minimises L_k(w) - <g_k, w> + alpha_k/2 ||w - w_round||^2, then
g_k <- g_k - alpha_k (w_k - w_round). g_k starts at zero and lives in the client's node state; alpha_k
comes with the round's config (the server scales alpha by the client's size, as the official code does)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from clients.fedavg import SupervisedStep
from clients.fedprox import proximal_term
from fedbr_flwr.core.algorithm import ClientAlgorithm
from fedbr_flwr.core.registry import register_client
from fedbr_flwr.core.settings import POSITIVE, Settings, setting

STATE_KEY = "feddyn-g"  # g_k in the node state, by parameter name
ALPHA_K = "feddyn-alpha-k"  # alpha_k in the fit config (strategies/feddyn.py)


@dataclass(frozen=True)
class FedDynSettings(Settings):
    alpha: float = setting("feddyn-alpha", 0.01, "FedDyn: weight alpha of the dynamic regulariser", check=POSITIVE)


class FedDynStep(SupervisedStep):
    """FedAvg's step on CE + alpha_k/2 ||w - w_round||^2, with -g_k added to every gradient: the linear
    term's gradient, which does not depend on w (so it is a correction, like SCAFFOLD's, and vmaps)."""

    per_member_state = ("g", "alpha")  # each client's own (alpha_k reaches the loss as a constant); w_round: all's

    def __init__(self, model, cfg, alpha: float, g: list[torch.Tensor]):
        super().__init__(model, cfg)
        self.start = [p.detach().clone() for p in model.parameters()]  # w_round
        self.alpha, self.g = alpha, g

    def constants(self):
        return {"alpha": torch.tensor(self.alpha, device=self.start[0].device)}

    def loss(self, params, inputs, shared):
        total, stats = super().loss(params, inputs, shared)
        prox = proximal_term(list(params["model"].values()), self.start)
        total = total + inputs["alpha"] / 2 * prox
        return total, {**stats, "loss": total, "prox": prox}

    def adjust_gradients(self, grads: list[torch.Tensor]) -> None:
        torch._foreach_sub_(grads, self.g)


@register_client("feddyn")
class FedDynClient(ClientAlgorithm):
    Settings = FedDynSettings
    vectorised = True
    state_keys = (STATE_KEY,)  # kept in checkpoints

    def make_step(self, server_round, config):
        stored = self.state.arrays(STATE_KEY) or {}
        g = [
            torch.as_tensor(stored[name], device=self.device) if name in stored else torch.zeros_like(p)
            for name, p in self.model.named_parameters()
        ]
        return FedDynStep(self.model, self.cfg, float(config.get(ALPHA_K, self.settings.alpha)), g)

    def after_fit(self, step):
        self.state.put_arrays(
            STATE_KEY,
            {
                name: (g - step.alpha * (p.detach() - s)).cpu().numpy()
                for (name, p), g, s in zip(self.model.named_parameters(), step.g, step.start)
            },
        )
        return {}, {}  # no arrays beside the model's, no metrics beside the step's
