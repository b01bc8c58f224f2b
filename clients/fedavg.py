"""FedAvg's client: K SGD steps on cross-entropy. Its step carries components, so FedProx, FedDecorr,
FedNTD, FedCM and Mixup are FedAvg plus their component (each registered in its own file as a variant:
``strategy=fedprox`` is FedAvg + the fedprox component)."""

from __future__ import annotations

import torch

from fedbr_flwr.core.algorithm import Batch, ClientAlgorithm, FunctionalStep, StepView, call
from fedbr_flwr.core.registry import register_client


class SupervisedStep(FunctionalStep):
    """Cross-entropy of classifier(features(x)) plus the components' terms; one SGD step on all of it."""

    def draw(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.transform(Batch(x, y)).tensors()

    def loss(self, params, inputs, shared):
        batch = Batch.from_tensors(inputs)
        model = params["model"]
        z = call(self.model.features, model, "features", batch.x)
        logits = call(self.model.classifier, model, "classifier", z)
        ce = batch.cross_entropy(logits)
        terms: dict[str, torch.Tensor] = {}
        total = self.add_terms(ce, terms, StepView(batch, z, logits, list(model.values())))
        if not terms:
            return total, {"loss": total}
        return total, {"loss": total, "ce": ce, **terms}


@register_client("fedavg")
class FedAvgClient(ClientAlgorithm):
    vectorised = True
    graph_checked_on_gpu = True

    def make_step(self, server_round: int, config: dict) -> SupervisedStep:
        return SupervisedStep(self.model, self.cfg, self.start_components(server_round))
