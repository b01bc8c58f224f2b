"""The Flower side every algorithm's client shares: it translates messages into calls of the
algorithm's Flower-free ``update()`` and back. Subclasses name their ``algorithm`` and, when they
train more than the model or need more than (model, cfg), override ``weight_modules`` and
``make_algorithm``."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from flwr.client import NumPyClient
from flwr.common import ArrayRecord, ConfigRecord, RecordDict
from torch import nn

from fedbr_flwr.broadcast import receive_shared
from fedbr_flwr.checkpoint import flatten, pack, unflatten, unpack
from fedbr_flwr.config import resolved_model
from fedbr_flwr.dataset import INFO, ClientData, make_partition
from fedbr_flwr.model import build_model
from fedbr_flwr.training import (Algorithm, BatchSampler, compile_features, evaluate, get_weights,
                                 peak_memory_mb, run_local_steps, set_weights, step_seed)


RESTORED_KEY = "client-state-restored"


class BaseClient(NumPyClient):
    algorithm: type[Algorithm]
    takes_extras = False  # whether the server sends arrays after the weights (SCAFFOLD, FedCM)
    state_keys: tuple[str, ...] = ()  # this client's own training state in context.state, kept in checkpoints

    # ------------------------------------------------------------ the model (the server builds the same)
    @classmethod
    def wrap_model(cls, backbone: nn.Module, cfg: dict[str, Any]) -> nn.Module:
        """The model this algorithm trains and the server averages, built around the backbone
        (MOON adds its projection layers, VHL doubles the classes, DisTrans takes two inputs)."""
        return backbone

    @classmethod
    def predictor(cls, model: nn.Module, cfg: dict[str, Any]) -> nn.Module:
        """What predicts the dataset's classes from an input (VHL: the real classes' logits only)."""
        return model

    def __init__(self, cfg: dict[str, Any], data: ClientData, device, state: RecordDict | None = None):
        self.cfg = cfg
        self.data = data
        self.pid = data.partition_id
        self.device = device
        self.state = state if state is not None else RecordDict()  # Flower's per-node context.state
        info = INFO[cfg["dataset"]]
        backbone = build_model(resolved_model(cfg), info.num_classes, info.in_channels, info.image_size)
        if cfg["compile"]:
            compile_features(backbone)
        self.model = self.wrap_model(backbone, cfg).to(device)
        self.extras: list[np.ndarray] = []  # arrays the server sent after the weights this round
        self.shared_versions: dict[str, int] = {}  # broadcast data used this round (reported back)

    # ------------------------------------------------------------ hooks for algorithms
    def weight_modules(self) -> list[nn.Module]:
        """What travels between server and client, in this order (the strategy uses the same layout)."""
        return [self.model]

    def make_algorithm(self, server_round: int, config: dict) -> Algorithm:
        return self.algorithm(self.model, self.cfg)  # optimiser state starts fresh each round

    def eval_module(self) -> nn.Module:
        """What predicts on the local test set (DisTrans: the model with this client's offset)."""
        return self.predictor(self.model, self.cfg)

    def after_fit(self, algorithm: Algorithm) -> list[np.ndarray]:
        """Arrays returned after the weights (SCAFFOLD: the change of its control variate); also the
        place to keep per-client state for the next round."""
        return []

    def shared(self, name: str, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The server's broadcast data ``name`` (FedBR's pseudo-data, FedMix's means, VHL's virtual data)
        on this client's device; the version used is reported with the fit result."""
        x, y, self.shared_versions[name] = receive_shared(self.state, name, config, self.pid)
        return torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device)

    def receive(self, parameters: list[np.ndarray]) -> list[np.ndarray]:
        """Load the weights; return what the server sent after them (SCAFFOLD's c, FedCM's Delta)."""
        n = sum(len(m.state_dict()) for m in self.weight_modules())
        if len(parameters) < n or (len(parameters) > n and not self.takes_extras):
            raise ValueError(f"client {self.pid} ({self.cfg['strategy']}) expected {n} arrays"
                             f"{' or more' if self.takes_extras else ''}, got {len(parameters)}")
        set_weights(self.weight_modules(), parameters[:n])
        return parameters[n:]

    def export_state(self) -> bytes:
        """The ``state_keys`` records of Flower's per-node state, for the server's checkpoint."""
        arrays = {}
        for key in self.state_keys:
            if key in self.state:
                arrays.update(flatten(key, self.state[key].to_numpy_ndarrays()))
        return pack(arrays)

    def restore_state(self, config: dict) -> None:
        """After a resume the server hands back the state this client had at the checkpoint, until the
        client answers; it is applied once, before anything reads the state."""
        if "client-state" not in config or RESTORED_KEY in self.state:
            return
        arrays = unpack(config["client-state"])
        for key in self.state_keys:
            if unflatten(arrays, key):
                self.state[key] = ArrayRecord(unflatten(arrays, key))
        self.state[RESTORED_KEY] = ConfigRecord({"restored": True})

    # ------------------------------------------------------------ Flower NumPyClient API
    def get_properties(self, config: dict) -> dict:
        _, phash = make_partition(self.cfg)
        counts = torch.bincount(self.data.y_train, minlength=self.data.num_classes).tolist()
        return {"partition-id": self.pid, "num-partitions": self.cfg["num-clients"], "partition-hash": phash,
                "num-train": len(self.data.y_train), "num-test": len(self.data.y_test),
                "class-counts": ",".join(map(str, counts))}

    def get_parameters(self, config: dict) -> list[np.ndarray]:
        if config.get("client-state"):
            return [np.frombuffer(self.export_state(), dtype=np.uint8)]
        return get_weights(*self.weight_modules())

    def fit(self, parameters: list[np.ndarray], config: dict) -> tuple[list[np.ndarray], int, dict]:
        self.restore_state(config)
        self.extras = self.receive(parameters)
        server_round = int(config["server-round"])
        algorithm = self.make_algorithm(server_round, config)
        sampler = BatchSampler(self.data, self.cfg["batch-size"], step_seed(self.cfg["seed"], server_round, self.pid))
        start = time.perf_counter()
        stats = run_local_steps(algorithm, sampler, self.cfg["local-steps"], self.cfg["precision"])
        metrics = {**stats, "partition-id": self.pid, "fit-seconds": time.perf_counter() - start,
                   **peak_memory_mb(self.device),
                   **{f"{name}-version": v for name, v in self.shared_versions.items()}}
        returned = get_weights(*self.weight_modules()) + self.after_fit(algorithm)
        return returned, len(self.data.y_train), metrics

    def evaluate(self, parameters: list[np.ndarray], config: dict) -> tuple[float, int, dict]:
        self.restore_state(config)
        self.receive(parameters)
        loss, acc = evaluate(self.eval_module(), self.data.x_test, self.data.y_test)
        return loss, len(self.data.y_test), {"accuracy": acc, "partition-id": self.pid}
