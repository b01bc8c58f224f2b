"""DisTrans' server (Algorithm 1 lines 15-16; SPEC section 3): the model is averaged as in FedAvg;
each client's returned offset is aggregated by ``distrans-agg``:

* ``none``: offsets stay with their clients (the server sends none back);
* ``avg``: every client receives the (uniform or sample-weighted) mean offset (under a robust ``aggregation``,
  the rule's aggregate: coordinate-wise for median / trimmed-mean; Krum and norm-bound judge each client's
  offset beside its model update, Krum averaging those of the clients it keeps, norm-bound clipping each offset
  towards the round's coordinate-wise median);
* ``nn``: a server network h maps client i's class-share embedding e_i (its share of each class's
  training samples) to an offset. Each round it takes ``distrans-nn-steps`` SGD steps on the MSE
  between h(e_i) and the offsets the clients returned, and h(e_i) becomes client i's next offset (a
  regression, not a mean; under a robust ``aggregation`` it fits the offsets of the clients the rule keeps,
  each clipped to the range the network outputs);
* ``auto``: DH (distributional heterogeneity) of the clients' reported class histograms picks
  ``none`` at DH >= ``distrans-dh-threshold`` and ``nn`` below.

Messages: fit and evaluate instructions carry the model's arrays and, when the server has one for it,
client i's offset as 'offset'; clients return the model's arrays and their offset.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedbr_flwr.core.config import common
from fedbr_flwr.core.errors import ConfigError
from fedbr_flwr.core.registry import register_strategy
from fedbr_flwr.core.training import load_module_arrays, module_arrays
from fedbr_flwr.data.catalog import INFO, DatasetInfo
from fedbr_flwr.data.dataset import normalise
from fedbr_flwr.data.partition import heterogeneity_from_counts
from fedbr_flwr.runfiles import codec
from fedbr_flwr.server.robust import JudgedGroup, coordinate_median
from fedbr_flwr.server.updates import weighted_mean

from .base import FederatedStrategy

OFFSET = "offset"  # as the clients name it (clients/distrans.py)


# ---------------------------------------------------------------- the offset aggregation network


class OffsetGenerator(nn.Module):
    """DisTrans' server-side aggregation network h(e) -> offset: a small MLP on the class-share
    embedding e, then a generator of four conv layers (two transposed, stride 2) with a Tanh output,
    cropped to the input shape and mapped affinely from [-1, 1] onto [low, high] per channel."""

    center: torch.Tensor  # (low + high) / 2, per channel: buffers
    half_range: torch.Tensor

    def __init__(
        self,
        num_classes: int,
        in_channels: int,
        image_size: int,
        width: int = 64,
        low: torch.Tensor | None = None,
        high: torch.Tensor | None = None,
    ):
        super().__init__()
        self.base = -(-image_size // 4)  # ceil: two stride-2 upsamplings reach at least image_size
        self.width = width
        self.image_size = image_size
        self.mlp = nn.Sequential(
            nn.Linear(num_classes, 128), nn.ReLU(), nn.Linear(128, width * self.base * self.base), nn.ReLU()
        )
        self.generator = nn.Sequential(
            nn.ConvTranspose2d(width, width // 2, 4, stride=2, padding=1),
            nn.ReLU(),
            nn.ConvTranspose2d(width // 2, width // 4, 4, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(width // 4, width // 4, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(width // 4, in_channels, 3, padding=1),
            nn.Tanh(),
        )
        low = torch.full((in_channels, 1, 1), -1.0) if low is None else low.reshape(in_channels, 1, 1)
        high = torch.full((in_channels, 1, 1), 1.0) if high is None else high.reshape(in_channels, 1, 1)
        self.register_buffer("center", (high + low) / 2)
        self.register_buffer("half_range", (high - low) / 2)

    def forward(self, e: torch.Tensor) -> torch.Tensor:
        h = self.mlp(e).view(len(e), self.width, self.base, self.base)
        unit = self.generator(h)[..., : self.image_size, : self.image_size]
        return self.center + self.half_range * unit


# ---------------------------------------------------------------- the aggregation rule (Flower-free)


def class_shares(counts: np.ndarray) -> np.ndarray:
    """e_i[j] = n_ij / sum_k n_kj for a (clients, classes) count matrix; 0 for a class nobody holds."""
    counts = np.asarray(counts, dtype=np.float64)
    totals = counts.sum(axis=0, keepdims=True)
    return np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)


def finite_mean(arrays: np.ndarray) -> np.ndarray:
    """The mean over the first axis in the arrays' float32, or in float64 where a float32 sum overflows (two
    finite offsets of 3e38 would otherwise give the global test an infinite one)."""
    with np.errstate(over="ignore"):
        mean = np.mean(arrays, axis=0)
    return mean if np.isfinite(mean).all() else np.mean(arrays, axis=0, dtype=np.float64).astype(arrays.dtype)


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

    def __init__(
        self, mode: str, shares: np.ndarray, network: OffsetGenerator | None = None, lr: float = 1e-2, steps: int = 10
    ):
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

    def update(
        self, offsets: dict[int, np.ndarray], weights: dict[int, float], mean: np.ndarray | None = None
    ) -> tuple[dict[int, np.ndarray], dict[str, float]]:
        """Returns ({client: next offset}, diagnostics); ``mean``: the aggregate ``avg`` sends (by default the
        weighted mean of ``offsets``; the strategy passes its robust aggregation's)."""
        if self.mode == "none" or not offsets:
            return {}, {}
        clients = range(len(self.shares))
        if self.mode == "avg":
            if mean is None:
                pids = sorted(offsets)
                (mean,) = weighted_mean([[offsets[p]] for p in pids], [weights[p] for p in pids])
            return {pid: mean for pid in clients}, {}
        kept = {name: t.detach().clone() for name, t in self._network().state_dict().items()}
        before, after = self.fit(offsets)
        if not all(torch.isfinite(t).all() for t in self._network().state_dict().values()):
            # finite offsets far out (1e30: its squared error overflows) made the network, and every offset it
            # sends, NaN for good: it keeps its weights, and each client the offset it has
            self._network().load_state_dict(kept)
            return {}, {"offset-nn-loss-before": before, "offset-nn-diverged": 1.0}
        return self.predict(), {"offset-nn-loss-before": before, "offset-nn-loss-after": after}

    def _network(self) -> OffsetGenerator:
        if self.network is None:
            raise RuntimeError("offset aggregation 'nn' needs the aggregation network")
        return self.network

    def _device(self) -> torch.device:
        return next(self._network().parameters()).device

    def fit(self, offsets: dict[int, np.ndarray]) -> tuple[float, float]:
        """Regression of h(e_i) onto the returned offsets; the MSE before the first and after the last step."""
        pids = sorted(offsets)
        device = self._device()
        e = torch.as_tensor(self.shares[pids], device=device)
        target = torch.as_tensor(np.stack([offsets[p] for p in pids]), dtype=torch.float32, device=device)
        network = self._network()
        network.train()
        before = None
        for _ in range(self.steps):
            loss = F.mse_loss(network(e), target)
            before = float(loss.detach()) if before is None else before
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        with torch.no_grad():
            after = float(F.mse_loss(network(e), target))
        return (after if before is None else before), after  # steps >= 1: before is set

    @torch.no_grad()
    def predict(self) -> dict[int, np.ndarray]:
        network = self._network()
        network.eval()
        out = network(torch.as_tensor(self.shares, device=self._device())).cpu().numpy()
        return {pid: out[pid] for pid in range(len(out))}


# ---------------------------------------------------------------- the strategy


@register_strategy("distrans")
class DisTransStrategy(FederatedStrategy):
    def __init__(self, cfg, recorder, modules, server_tests):
        super().__init__(cfg, recorder, modules, server_tests)  # self.model: the double-input model
        self.info = INFO[common(cfg).dataset]
        # built right after the seeded model, so that it is seeded too; unused when auto picks none
        self.network = (
            build_offset_network(self.info).to(self._device()) if self.settings.agg in ("nn", "auto") else None
        )
        self.aggregator: OffsetAggregator | None = None  # needs the class histograms: built at discovery
        self.returned_offsets: dict[int, np.ndarray] = {}  # the last offset each client sent
        self.next_offsets: dict[int, np.ndarray] = {}  # what each client receives next (avg, nn)

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def after_discovery(self) -> dict[str, Any]:
        counts = self.federation.class_count_matrix()
        if counts is None:
            raise ConfigError("DisTrans needs every client's class histogram ('class-counts' in its properties)")
        dh = heterogeneity_from_counts(counts)
        s = self.settings
        mode = resolve_mode(s.agg, dh, s.dh_threshold)
        self.aggregator = OffsetAggregator(mode, class_shares(counts), self.network, s.nn_lr, s.nn_steps)
        self.recorder.progress.emit(
            "info",
            f"DisTrans: distributional heterogeneity DH = {100 * dh:.1f}%; offset "
            f"aggregation '{mode}' (distrans-agg = {s.agg}, threshold "
            f"{100 * s.dh_threshold:.0f}%)",
        )
        return {"distrans": {"dh": dh, "offset_agg": mode, "distrans_agg_setting": s.agg}}

    @classmethod
    def may_judge_groups(cls, cfg):
        return cfg["distrans-agg"] == "avg"  # auto chooses none or nn

    def judged_groups(self):
        """Under ``avg`` the offsets are averaged: an offset is no update of anything the server sent (in round 1
        it sent none), so its size is its distance from the round's coordinate-wise median."""
        averaged = self.aggregator is not None and self.aggregator.mode == "avg"
        return (JudgedGroup((OFFSET,), centred=True),) if averaged else ()

    def aggregate(self, rnd):
        assert self.aggregator is not None  # built at discovery, before any round's answers
        offsets = {u.pid: u.arrays[OFFSET] for u in rnd.used}  # a client Krum drops keeps the offset it had
        self.returned_offsets.update(offsets)
        robust, mode = not rnd.plan.is_mean, self.aggregator.mode
        mean = rnd.combine([OFFSET])[OFFSET] if robust and mode == "avg" else None
        targets = self.offsets_to_fit_robustly(rnd) if robust and mode == "nn" else offsets
        weights = {u.pid: w for u, w in zip(rnd.updates, rnd.weights)}
        nxt, self.server_metrics = self.aggregator.update(targets, weights, mean)
        if "offset-nn-diverged" in self.server_metrics:
            self._warn(rnd.number, ["the offset network's fit went to NaN or Inf: it and the offsets are kept"])
        self.next_offsets.update(nxt)
        self.save_offsets()
        return super().aggregate(rnd)

    def offsets_to_fit_robustly(self, rnd) -> dict[int, np.ndarray]:
        """What ``nn`` fits under a robust rule: the offsets of the clients the rule keeps (Krum's), each clipped
        to the range the network outputs, so that an offset it could send passes unchanged and none pulls it
        further than one it could send (a single offset of 1e30 made it NaN, and with it every client's)."""
        if self.network is None:
            raise RuntimeError("offset aggregation 'nn' needs the aggregation network")
        center, half = (b.detach().cpu().numpy() for b in (self.network.center, self.network.half_range))
        return {u.pid: np.clip(u.arrays[OFFSET], center - half, center + half) for u in rnd.used}

    def client_arrays(self, pid):
        return {OFFSET: self.next_offsets[pid].astype(np.float32)} if pid in self.next_offsets else {}

    def checkpoint_state(self):
        """Offsets (returned and next), and the aggregation network's weights (plain SGD keeps no optimiser state)."""
        state = super().checkpoint_state()
        state.update({f"distrans/returned/{pid}": t for pid, t in self.returned_offsets.items()})
        state.update({f"distrans/next/{pid}": t for pid, t in self.next_offsets.items()})
        if self.network is not None:
            state.update(module_arrays("distrans/network", self.network))
        return state

    def restore_state(self, arrays):
        super().restore_state(arrays)
        for name, target in (("returned", self.returned_offsets), ("next", self.next_offsets)):
            prefix = f"distrans/{name}/"
            target.update({int(k[len(prefix) :]): v for k, v in arrays.items() if k.startswith(prefix)})
        if self.network is not None:
            load_module_arrays(self.network, "distrans/network", arrays)

    def save_offsets(self) -> None:
        """offsets.npz in the run folder: each client's last returned offset (``returned_<i>``) and,
        under avg / nn, the offset it receives next (``next_<i>``); rewritten every round."""
        arrays = {f"returned_{pid}": t for pid, t in sorted(self.returned_offsets.items())}
        arrays.update({f"next_{pid}": t for pid, t in sorted(self.next_offsets.items())})
        codec.write(self.recorder.out_dir / "offsets.npz", arrays)

    def global_test_module(self) -> torch.nn.Module:
        """The global test set has no client: it is seen through the mean of the clients' latest offsets (under a
        robust ``aggregation``, their coordinate-wise median, which no single client moves far)."""
        if self.returned_offsets:
            latest = np.stack(list(self.returned_offsets.values()))
            t = finite_mean(latest) if self.robust_rule.name == "mean" else coordinate_median(latest)
        else:
            t = np.zeros(self.returned_shapes()[OFFSET], dtype=np.float32)
        offset = torch.as_tensor(t, dtype=torch.float32, device=self._device())
        return cast(Any, self.client_class).with_offset(self.model, offset)  # DisTrans' client: the model with it
