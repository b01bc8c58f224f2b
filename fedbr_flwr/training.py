"""Flower-free training pieces shared by every algorithm: batch sampling on the device, the local
loop, evaluation, and weight (de)serialisation."""

from __future__ import annotations

import hashlib
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

from .dataset import ClientData, random_crop_flip


def step_seed(*parts: int) -> int:
    """A 63-bit seed from integers (run seed, round, client id, ...), stable across processes."""
    digest = hashlib.sha256(",".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class BatchSampler:
    """Minibatches drawn with replacement by indexing tensors already on the device (the paper's
    infinite loader); CIFAR100 batches get random crop + flip on the device as well."""

    def __init__(self, data: ClientData, batch_size: int, seed: int):
        self.x, self.y = data.x_train, data.y_train
        self.batch_size = batch_size
        self.augment = data.augment
        self.generator = torch.Generator(device=self.x.device)
        self.generator.manual_seed(seed)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(self.y), (self.batch_size,), device=self.x.device, generator=self.generator)
        x = self.x[idx]
        if self.augment:
            x = random_crop_flip(x, self.generator)
        return x, self.y[idx]


class Algorithm:
    """One client's local optimisation, DomainBed style: ``update(x, y)`` takes one step and returns
    scalar diagnostics. Subclasses set up their extra state in ``__init__``. Knows nothing of Flower."""

    def __init__(self, model: nn.Module, cfg: dict):
        self.model = model
        self.cfg = cfg
        self.optimizer = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"],
                                         weight_decay=cfg["weight-decay"])

    def update(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def step(self, loss: torch.Tensor) -> None:
        """One SGD step of the model on ``loss``."""
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


def run_local_steps(algorithm: Algorithm, sample: Callable[[], tuple[torch.Tensor, torch.Tensor]],
                    steps: int) -> dict[str, float]:
    """K local steps; diagnostics are averaged on the device and copied to the host once."""
    algorithm.model.train()
    totals: dict[str, torch.Tensor] = {}
    for _ in range(steps):
        x, y = sample()
        for k, v in algorithm.update(x, y).items():
            totals[k] = totals[k] + v.detach() if k in totals else v.detach().clone()
    return {k: float(v) / steps for k, v in totals.items()}


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` on tensors already on its device."""
    model.eval()
    loss = torch.zeros((), device=x.device)
    correct = torch.zeros((), device=x.device, dtype=torch.long)
    for start in range(0, len(y), batch_size):
        logits = model(x[start:start + batch_size])
        target = y[start:start + batch_size]
        loss += nn.functional.cross_entropy(logits, target, reduction="sum")
        correct += (logits.argmax(1) == target).sum()
    n = max(len(y), 1)
    return float(loss) / n, float(correct) / n


def get_weights(*modules: nn.Module) -> list[np.ndarray]:
    """The modules' state arrays, concatenated in order. Copies, never views: on CPU ``.numpy()``
    shares memory with the live parameters."""
    return [t.detach().cpu().numpy().copy() for m in modules for t in m.state_dict().values()]


def set_weights(modules: nn.Module | Sequence[nn.Module], weights: list[np.ndarray]) -> None:
    """Load arrays laid out as ``get_weights(*modules)`` wrote them."""
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    states = [m.state_dict() for m in modules]
    expected = sum(len(state) for state in states)
    if len(weights) != expected:
        names = "+".join(type(m).__name__ for m in modules)
        raise ValueError(f"expected {expected} arrays for {names}, got {len(weights)}")
    arrays = iter(weights)
    for state in states:
        for (name, current), new in zip(state.items(), arrays):
            if tuple(current.shape) != tuple(new.shape):
                raise ValueError(f"shape mismatch for '{name}': expected {tuple(current.shape)}, got {new.shape}")
            current.copy_(torch.as_tensor(new))


def parameter_tensors(module: nn.Module, arrays: list[np.ndarray], device: torch.device | None = None
                      ) -> list[torch.Tensor]:
    """Arrays laid out like ``module.state_dict()`` (how the server holds SCAFFOLD's c and FedCM's Delta),
    as tensors for ``module.parameters()``, in that order; buffers are dropped."""
    keys = list(module.state_dict())
    if len(arrays) != len(keys):
        raise ValueError(f"expected {len(keys)} arrays laid out like the model's state, got {len(arrays)}")
    by_key = dict(zip(keys, arrays))
    device = device or next(module.parameters()).device
    return [torch.as_tensor(by_key[name], dtype=p.dtype, device=device) for name, p in module.named_parameters()]


def state_arrays(module: nn.Module, tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """The inverse of ``parameter_tensors``: per-parameter tensors laid out like ``module.state_dict()``,
    with zeros for buffers."""
    by_name = {name: t for (name, _), t in zip(module.named_parameters(), tensors)}
    return [by_name[k].detach().cpu().numpy().copy() if k in by_name else np.zeros(v.shape, dtype=np.float32)
            for k, v in module.state_dict().items()]


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda requested but torch sees no CUDA device")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)
