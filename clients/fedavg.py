"""FedAvg's client: K SGD steps on cross-entropy. Its step carries components, so FedProx, FedDecorr,
FedNTD, FedCM and Mixup are FedAvg plus their component (each registered in its own file as a variant:
``strategy=fedprox`` is FedAvg + the fedprox component)."""

from __future__ import annotations

import torch

from fedbr_flwr.algorithm import Batch, ClientAlgorithm, LocalStep, StepView
from fedbr_flwr.registry import register_client


class SupervisedStep(LocalStep):
    """Cross-entropy of classifier(features(x)) plus the components' terms; one SGD step on all of it."""

    def __init__(self, model, cfg, components=()):
        super().__init__(model, cfg, components)
        self.params = list(model.parameters())

    def update(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        batch = self.transform(Batch(x, y))
        z = self.model.features(batch.x)
        logits = self.model.classifier(z)
        ce = batch.cross_entropy(logits)
        terms: dict[str, torch.Tensor] = {}
        total = self.add_terms(ce, terms, StepView(batch, z, logits, self.params))
        self.optimizer.zero_grad(set_to_none=True)
        total.backward()
        self.adjust_gradients(self.params)
        self.optimizer.step()
        if not terms:
            return {"loss": total.detach()}
        return {"loss": total.detach(), "ce": ce.detach(), **{k: v.detach() for k, v in terms.items()}}


@register_client("fedavg")
class FedAvgClient(ClientAlgorithm):
    def make_step(self, server_round: int, config: dict) -> SupervisedStep:
        return SupervisedStep(self.model, self.cfg, self.start_components(server_round))
