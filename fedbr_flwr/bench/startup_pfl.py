"""``python -m fedbr_flwr.bench.startup_pfl ITEMS``: the ``fedbr-bench --startup`` workload in pfl-research 0.6.0
(Apple's ``pfl``, https://github.com/apple/pfl-research), one process, simulated FL on its PyTorch backend: its
``FederatedAveraging`` with a central SGD of lr 1.0 (the new global model is the average of the local models),
the clients weighted as the bare loop weighs them (``weighting``: uniform, or by training samples), this
project's model (its model factory and the server's seeded initial weights, as ``bare.bare_loop`` builds
them) and this project's partition of the dataset, no evaluation until the end, then the mean local-test
accuracy. It prints the milestones ``startup.phases`` reads (``pfl-research: ...``, ``[pfl] ...``) and writes
the rounds' seconds to ``output-dir/rounds.jsonl`` (what ``startup.steady_round_seconds`` reads), as the bare
loop (``startup.bare_main``) does.

pfl is an optional extra (``pip install -e '.[pfl]'``); this is the only module that imports it."""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import sys
import time
from typing import Any, Sequence

import torch
from torch import nn
from torch.nn import functional as F

try:
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightingStrategy
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import MinimizeReuseUserSampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, StringMetricName, Weighted, get_overall_value
    from pfl.model.pytorch import PyTorchModel
except ModuleNotFoundError as exc:  # run as a script only: say what to install instead of a traceback
    raise SystemExit(
        f"fedbr_flwr.bench.startup_pfl: {exc}; install pfl-research: pip install -e '.[pfl]' (or 'pfl[pytorch]==0.6.0')"
    ) from None

from ..core import seeds
from ..core.algorithm import client_class
from ..core.config import common
from ..core.training import BatchSampler, load_module_arrays
from ..data.dataset import ClientData, load_client_data
from ..launch.plan import build_config
from .bare import BareServer, synchronize
from .startup import milestone_main


class PflModule(nn.Module):
    """This project's model as pfl's ``PyTorchModel`` takes it: ``loss(x, y)`` (a training step's
    cross-entropy) and ``metrics(x, y)`` (summed loss and correct predictions, weighted by the samples)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.training:
            self.train()
        return F.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        self.eval()
        logits = self(x)
        return {
            "loss": Weighted(float(F.cross_entropy(logits, y, reduction="sum")), len(y)),
            "accuracy": Weighted(float((logits.argmax(1) == y).sum()), len(y)),
        }


class RoundData:
    """pfl's ``make_dataset_fn``: a client's dataset for its next round, which is exactly the ``local-steps``
    batches of ``batch-size`` that the bare loop's client draws that round (its ``BatchSampler``, seeded by
    the run's seed, the round and the client), in order.

    Why not the client's whole partition with ``local_num_steps``: pfl slices a user's dataset into batches
    in order, without shuffling, so that would train on the same first samples every round, and it stops
    early on a client with fewer than steps x batch samples. With this dataset and ``local_num_epochs=1``,
    ``local_batch_size=batch-size``, one epoch is exactly ``local-steps`` steps of ``batch-size``. Every
    client is in every round (``MinimizeReuseUserSampler`` over all ids, cohort = all clients), so the n-th
    call for a client is its round n."""

    def __init__(self, cfg: dict, clients: list[ClientData]):
        self.cfg, self.clients = cfg, clients
        self.rounds = [0] * len(clients)

    def __call__(self, pid: int) -> Dataset:
        self.rounds[pid] += 1
        run = common(self.cfg)
        seed = seeds.seed("batches", run.seed, self.rounds[pid], pid)
        sample = BatchSampler(self.clients[pid], run.batch_size, seed)
        batches = [sample() for _ in range(run.local_steps)]
        return Dataset((torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])), user_id=pid)


class WeightByTrainingSamples(WeightingStrategy):
    """``weighting=samples``: a client's update counts by its partition's training samples, as in the bare
    loop (pfl's ``WeightByDatapoints`` would count the round's drawn samples, the same for every client)."""

    def __init__(self, sizes: list[int]):
        self.sizes = sizes

    def postprocess_one_user(self, *, stats, user_context):
        stats.reweight(self.sizes[user_context.user_id])
        return stats, Metrics()


class FedAvgNoLocalEvaluation(FederatedAveraging):
    """pfl's FedAvg, except that no central iteration evaluates: pfl evaluates every user before and after
    its local training whenever ``iteration % evaluation_frequency == 0``, which is always true of the first
    one; the workload evaluates once, at the end."""

    def get_next_central_contexts(self, *args, **kwargs):
        contexts, model, metrics = super().get_next_central_contexts(*args, **kwargs)
        if contexts is not None:
            contexts = tuple(dataclasses.replace(c, do_evaluation=False) for c in contexts)
        return contexts, model, metrics


class RoundTimer(TrainingProcessCallback):
    """Calls ``on_round(round, seconds)`` after each central iteration, with its seconds from the end of the one
    before (the first: from the start of training)."""

    def __init__(self, device: torch.device, on_round=None):
        self.device, self.on_round = device, on_round
        self.last = time.perf_counter()

    def on_train_begin(self, *, model):
        self.last = time.perf_counter()
        return Metrics()

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        synchronize(self.device)
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        if self.on_round:
            self.on_round(central_iteration + 1, seconds)
        return False, Metrics()


def pfl_loop(cfg: dict, device: torch.device, on_start=None, on_round=None) -> tuple[Any, list[ClientData]]:
    """``num-rounds`` rounds of pfl's FedAvg on this project's model and client data (see the module's
    docstring); ``on_start()`` once the clients are built, ``on_round(round, seconds)`` after each round.
    Returns pfl's trained ``PyTorchModel`` and the clients' data."""
    run = common(cfg)
    rounds, n = run.num_rounds, run.num_clients
    os.environ["PFL_PYTORCH_DEVICE"] = str(device)  # where pfl puts the model and every batch
    initial = BareServer(cfg).initial_arrays()  # the server's seeded initial weights
    model = client_class(run.strategy).build_modules(cfg, run.compile)["model"]
    load_module_arrays(model, "model", initial)
    module = PflModule(model).to(device)
    pfl_model = PyTorchModel(
        module,
        local_optimizer_create=functools.partial(
            torch.optim.SGD, momentum=run.momentum, weight_decay=run.weight_decay
        ),  # a new one for every client and round, as the bare loop's step starts without momentum
        central_optimizer=torch.optim.SGD(module.parameters(), lr=1.0),  # model + mean(local - model)
        amp_dtype=torch.bfloat16 if run.precision == "bf16" else None,
    )
    clients = [load_client_data(cfg, pid, device) for pid in range(n)]
    data = FederatedDataset(RoundData(cfg, clients), MinimizeReuseUserSampler(list(range(n))))
    sizes = [len(c.y_train) for c in clients]
    backend = SimulatedBackend(
        training_data=data,
        val_data=None,
        postprocessors=[WeightByTrainingSamples(sizes)] if run.weighting == "samples" else [],
    )  # else pfl's default: every client's update weighs 1, the bare loop's uniform weighting
    if on_start:
        on_start()
    trained = FedAvgNoLocalEvaluation().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=rounds, evaluation_frequency=rounds, train_cohort_size=n, val_cohort_size=None
        ),
        backend=backend,
        model=pfl_model,
        model_train_params=NNTrainHyperParams(
            local_batch_size=run.batch_size, local_num_epochs=1, local_learning_rate=run.lr
        ),  # one epoch of RoundData's dataset: exactly local-steps steps of batch-size
        callbacks=[RoundTimer(device, on_round)],
        send_metrics_to_platform=False,  # else pfl prints every iteration's metrics
    )
    return trained, clients


def mean_local_accuracy(pfl_model: Any, clients: list[ClientData]) -> float:
    """The mean over clients of the model's accuracy on each one's local test set, evaluated by pfl."""
    eval_params = NNEvalHyperParams(local_batch_size=512)
    return statistics.mean(
        get_overall_value(
            pfl_model.evaluate(Dataset((c.x_test, c.y_test)), eval_params=eval_params)[StringMetricName("accuracy")]
        )
        for c in clients
    )


def pfl_main(argv: Sequence[str]) -> int:
    """The pfl-research variant as a process of its own (``startup.milestone_main``, as the bare loop)."""
    cfg = build_config(argv)
    run = common(cfg)
    if run.strategy != "fedavg":
        print(f"fedbr_flwr.bench.startup_pfl: runs strategy=fedavg only, not {run.strategy}", file=sys.stderr)
        return 2

    def train(cfg, device, on_start, on_round) -> float:
        return mean_local_accuracy(*pfl_loop(cfg, device, on_start, on_round))

    return milestone_main(cfg, "pfl-research", "pfl", train)


if __name__ == "__main__":
    sys.exit(pfl_main(sys.argv[1:]))
