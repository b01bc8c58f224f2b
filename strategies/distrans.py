"""DisTrans' server (Algorithm 1 lines 15-16; SPEC section 3): the model is averaged as in FedAvg;
each client's returned offset is aggregated by ``distrans-agg``:

* ``none``: offsets stay with their clients (the server sends none back);
* ``avg``: every client receives the (uniform or sample-weighted) mean offset;
* ``nn``: a server network h maps client i's class-share embedding e_i (its share of each class's
  training samples) to an offset. Each round it takes ``distrans-nn-steps`` SGD steps on the MSE
  between h(e_i) and the offsets the clients returned, and h(e_i) becomes client i's next offset;
* ``auto``: DH (distributional heterogeneity) of the clients' reported class histograms picks
  ``none`` at DH >= ``distrans-dh-threshold`` and ``nn`` below.

Message layout: fit and evaluate instructions carry the model arrays, then client i's offset when
the server has one for it; clients return the model arrays, then their offset.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from flwr.common import Parameters, ndarray_to_bytes
from torch.nn import functional as F

from clients.distrans import offset_shape
from fedbr_flwr.checkpoint import flatten, unflatten
from fedbr_flwr.config import ConfigError
from fedbr_flwr.dataset import INFO, DatasetInfo, normalise
from fedbr_flwr.model import OffsetGenerator, WithOffset
from fedbr_flwr.partition import heterogeneity_from_counts
from fedbr_flwr.registry import register_strategy
from fedbr_flwr.run_io import save_npz_atomically
from fedbr_flwr.training import get_weights, set_weights

from .base import FederatedStrategy, weighted_mean

log = logging.getLogger("flwr")


# ---------------------------------------------------------------- the aggregation rule (Flower-free)


def class_shares(counts: np.ndarray) -> np.ndarray:
    """e_i[j] = n_ij / sum_k n_kj for a (clients, classes) count matrix; 0 for a class nobody holds."""
    counts = np.asarray(counts, dtype=np.float64)
    totals = counts.sum(axis=0, keepdims=True)
    return np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)


def resolve_mode(mode: str, dh: float, threshold: float) -> str:
    if mode != "auto":
        return mode
    return "none" if dh >= threshold else "nn"


def build_offset_network(info: DatasetInfo) -> OffsetGenerator:
    """h, with its Tanh output stretched to the value range of normalised images (pixels 0..1), the
    range the clients' offsets start in."""
    low = normalise(torch.zeros(1, info.in_channels, 1, 1), info)[0]
    high = normalise(torch.ones(1, info.in_channels, 1, 1), info)[0]
    return OffsetGenerator(info.num_classes, info.in_channels, info.image_size, low=low, high=high)


class OffsetAggregator:
    """Offsets returned this round -> the offset each client gets next (nothing in mode ``none``)."""

    def __init__(self, mode: str, shares: np.ndarray, network: OffsetGenerator | None = None,
                 lr: float = 1e-2, steps: int = 10):
        if mode not in ("none", "avg", "nn"):
            raise ValueError(f"unknown offset aggregation '{mode}'. Valid: none, avg, nn")
        if mode == "nn" and network is None:
            raise ValueError("offset aggregation 'nn' needs the aggregation network")
        self.mode = mode
        self.shares = np.asarray(shares, dtype=np.float32)
        self.network = network
        self.steps = steps
        if network is not None:
            self.optimizer = torch.optim.SGD(network.parameters(), lr=lr)

    def update(self, offsets: dict[int, np.ndarray], weights: dict[int, float]) -> tuple[dict[int, np.ndarray],
                                                                                         dict[str, float]]:
        """Returns ({client: next offset}, diagnostics)."""
        if self.mode == "none" or not offsets:
            return {}, {}
        clients = range(len(self.shares))
        if self.mode == "avg":
            pids = sorted(offsets)
            (mean,) = weighted_mean([[offsets[p]] for p in pids], [weights[p] for p in pids])
            return {pid: mean for pid in clients}, {}
        before, after = self.fit(offsets)
        return self.predict(), {"offset-nn-loss-before": before, "offset-nn-loss-after": after}

    def _device(self) -> torch.device:
        return next(self.network.parameters()).device

    def fit(self, offsets: dict[int, np.ndarray]) -> tuple[float, float]:
        """Regression of h(e_i) onto the returned offsets; the MSE before the first and after the last step."""
        pids = sorted(offsets)
        device = self._device()
        e = torch.as_tensor(self.shares[pids], device=device)
        target = torch.as_tensor(np.stack([offsets[p] for p in pids]), dtype=torch.float32, device=device)
        self.network.train()
        before = None
        for _ in range(self.steps):
            loss = F.mse_loss(self.network(e), target)
            before = float(loss.detach()) if before is None else before
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        with torch.no_grad():
            after = float(F.mse_loss(self.network(e), target))
        return before, after

    @torch.no_grad()
    def predict(self) -> dict[int, np.ndarray]:
        self.network.eval()
        out = self.network(torch.as_tensor(self.shares, device=self._device())).cpu().numpy()
        return {pid: out[pid] for pid in range(len(out))}


# ---------------------------------------------------------------- the Flower strategy


@register_strategy("distrans")
class DisTransStrategy(FederatedStrategy):
    def __init__(self, cfg, recorder, model, global_test):
        super().__init__(cfg, recorder, model, global_test)  # self.model: the double-input model
        self.info = INFO[cfg["dataset"]]
        # built right after the seeded model, so that it is seeded too; unused when auto picks none
        self.network = build_offset_network(self.info).to(self._device()) \
            if cfg["distrans-agg"] in ("nn", "auto") else None
        self.aggregator: OffsetAggregator | None = None  # needs the class histograms: built at discovery
        self.returned_offsets: dict[int, np.ndarray] = {}  # the last offset each client sent
        self.next_offsets: dict[int, np.ndarray] = {}  # what each client receives next (avg, nn)

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def after_discovery(self) -> dict[str, Any]:
        counts = self.class_count_matrix()
        if counts is None:
            raise ConfigError("DisTrans needs every client's class histogram ('class-counts' in its properties)")
        dh = heterogeneity_from_counts(counts)
        mode = resolve_mode(self.cfg["distrans-agg"], dh, self.cfg["distrans-dh-threshold"])
        self.aggregator = OffsetAggregator(mode, class_shares(counts), self.network, self.cfg["distrans-nn-lr"],
                                           self.cfg["distrans-nn-steps"])
        log.info("[fedbr] DisTrans: distributional heterogeneity DH = %.1f%%; offset aggregation '%s' "
                 "(distrans-agg = %s, threshold %.0f%%)", 100 * dh, mode, self.cfg["distrans-agg"],
                 100 * self.cfg["distrans-dh-threshold"])
        return {"distrans": {"dh": dh, "offset_agg": mode, "distrans_agg_setting": self.cfg["distrans-agg"]}}

    def aggregate(self, arrays: list[list[np.ndarray]], weights: list[float]) -> list[np.ndarray]:
        n = self.num_model_arrays
        bad = [pid for pid, a in zip(self.result_pids, arrays) if len(a) != n + 1]
        if bad:
            raise ValueError(f"DisTrans clients {bad} did not return {n} model arrays + 1 offset")
        offsets = {pid: a[n] for pid, a in zip(self.result_pids, arrays)}
        self.returned_offsets.update(offsets)
        nxt, self.server_metrics = self.aggregator.update(offsets, dict(zip(self.result_pids, weights)))
        self.next_offsets.update(nxt)
        self.save_offsets()
        return weighted_mean([a[:n] for a in arrays], weights)

    def returned_extra_shapes(self):
        return [offset_shape(self.info)]

    def checkpoint_state(self):
        """Offsets (returned and next), and the aggregation network's weights (plain SGD keeps no optimiser state)."""
        state = super().checkpoint_state()
        state.update({f"distrans/returned/{pid}": t for pid, t in self.returned_offsets.items()})
        state.update({f"distrans/next/{pid}": t for pid, t in self.next_offsets.items()})
        if self.network is not None:
            state.update(flatten("distrans/network", get_weights(self.network)))
        return state

    def restore_state(self, arrays):
        super().restore_state(arrays)
        for name, target in (("returned", self.returned_offsets), ("next", self.next_offsets)):
            prefix = f"distrans/{name}/"
            target.update({int(k[len(prefix):]): v for k, v in arrays.items() if k.startswith(prefix)})
        if self.network is not None:
            set_weights(self.network, unflatten(arrays, "distrans/network"))

    def save_offsets(self) -> None:
        """offsets.npz in the run folder: each client's last returned offset (``returned_<i>``) and,
        under avg / nn, the offset it receives next (``next_<i>``); rewritten every round."""
        arrays = {f"returned_{pid}": t for pid, t in sorted(self.returned_offsets.items())}
        arrays.update({f"next_{pid}": t for pid, t in sorted(self.next_offsets.items())})
        save_npz_atomically(self.recorder.out_dir / "offsets.npz", **arrays)

    def client_parameters(self, parameters: Parameters, pid: int) -> Parameters:
        if pid not in self.next_offsets:
            return parameters
        offset = ndarray_to_bytes(self.next_offsets[pid].astype(np.float32))
        return Parameters(tensors=[*parameters.tensors, offset], tensor_type=parameters.tensor_type)

    def global_test_module(self) -> torch.nn.Module:
        """The global test set has no client: it is seen through the mean of the clients' latest offsets."""
        if self.returned_offsets:
            t = np.mean(np.stack(list(self.returned_offsets.values())), axis=0)
        else:
            t = np.zeros(offset_shape(self.info), dtype=np.float32)
        return WithOffset(self.model, torch.as_tensor(t, dtype=torch.float32, device=self._device()))
