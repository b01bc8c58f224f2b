"""Flower-free training pieces shared by every algorithm: batch sampling on the device, the local
loop, evaluation, optimisers and frozen copies reused across rounds, and module state as named arrays."""

from __future__ import annotations

import contextlib
import copy
import resource
import weakref
from typing import Callable, Iterable, Mapping

import numpy as np
import torch
from torch import nn

from ..data.dataset import ClientData, random_crop_flip
from .config import common


class BatchSampler:
    """Minibatches drawn with replacement by indexing tensors already on the device (the paper's
    infinite loader); CIFAR100 batches get random crop + flip on the device as well."""

    def __init__(self, data: ClientData, batch_size: int, seed: int):
        self.x, self.y = data.x_train, data.y_train
        self.batch_size = batch_size
        self.augment, self.border = data.augment, data.border
        self.generator = torch.Generator(device=self.x.device)
        self.generator.manual_seed(seed)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self.indices()
        return self.augmented(self.x[idx]), self.y[idx]

    def indices(self) -> torch.Tensor:
        """The next batch's sample indices into this client's partition (the stream's first draw of a batch)."""
        return torch.randint(0, len(self.y), (self.batch_size,), device=self.x.device, generator=self.generator)

    def augmented(self, x: torch.Tensor) -> torch.Tensor:
        """The batch ``x`` (drawn by ``indices``) as training sees it (the stream's second draw of a batch)."""
        return random_crop_flip(x, self.generator, border=self.border) if self.augment else x


# Objects kept per live module between rounds (a client's model lives as long as its process):
# its SGD optimisers and the frozen copies of it that some algorithms take at the start of a round.
_OPTIMIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FROZEN_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class PlainSGD:
    """What ``torch.optim.SGD`` computes on CPU tensors (its single-tensor update, bit for bit: a test holds the
    two together), without ``torch.optim.Optimizer``: its first construction imports ``torch._dynamo``, a second
    of CPU in every process that trains (docs/benchmarks.md). The parts of the optimiser interface used here:
    ``param_groups`` (one group), ``state`` (momentum buffers), ``step``, ``zero_grad``."""

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        maximize: bool = False,
        **unused: object,  # torch's foreach, fused, differentiable: one code path here
    ):
        hyper = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov)
        self.param_groups: list[dict] = [{"params": list(params), **hyper, "maximize": maximize}]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.param_groups[0]["params"]:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        group = self.param_groups[0]
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = -p.grad if group["maximize"] else p.grad
            if wd != 0:
                grad = grad.add(p, alpha=wd)
            if mu != 0:
                buf = self.state.setdefault(p, {}).get("momentum_buffer")
                if buf is None:
                    buf = self.state[p]["momentum_buffer"] = grad.detach().clone()
                else:
                    buf.mul_(mu).add_(grad, alpha=1 - group["dampening"])
                grad = grad.add(buf, alpha=mu) if group["nesterov"] else buf
            p.add_(grad, alpha=-lr)


Optimiser = torch.optim.Optimizer | PlainSGD  # what a client's local step steps


def clip_scale(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The factor that brings one client's ``grads`` to a joint L2 norm of at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` computes it: max_norm / (norm + 1e-6), at most 1. A tensor, without a
    data-dependent branch (a CUDA graph can capture it, vmap can batch it)."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


@torch.no_grad()
def clip_norm_(grads: list[torch.Tensor], max_norm: float) -> None:
    """``grads`` (one client's) scaled in place by ``clip_scale``."""
    torch._foreach_mul_(grads, clip_scale(grads, max_norm))


def steps_along_gradient(steps: int, momentum: float) -> float:
    """How far ``steps`` steps of ``round_sgd`` (momentum buffer empty at the start, no dampening) move along
    a constant gradient, in lr-sized steps: sum over k = 1..K of (1 - m^k) / (1 - m), which is K without
    momentum. A round's displacement over lr times this is its mean gradient: SCAFFOLD's and FedCM's
    estimates, which over lr K alone grow by about this over K (8.2 at m = 0.9, K = 50) each round."""
    if momentum == 0:
        return float(steps)
    return (steps - momentum * (1 - momentum**steps) / (1 - momentum)) / (1 - momentum)


def round_sgd(
    owner: nn.Module,
    params: Iterable[torch.Tensor],
    cfg: dict,
    lr: float | None = None,
    weight_decay: float | None = None,
) -> Optimiser:
    """SGD over ``params`` (of ``owner``) with the run's momentum (and lr and weight decay unless
    given), its state empty as a new optimiser's: every round starts without momentum. The object is
    built once per (owner, parameters, hyperparameters) and reused by later rounds, which clear its
    state instead. On a CPU it is ``PlainSGD``; elsewhere ``torch.optim.SGD`` (its multi-tensor update on a GPU,
    which the CUDA-graph step captures)."""
    run = common(cfg)
    params = list(params)
    lr = run.lr if lr is None else lr
    weight_decay = run.weight_decay if weight_decay is None else weight_decay
    key = (tuple(id(p) for p in params), lr, run.momentum, weight_decay)
    per_owner = _OPTIMIZERS.setdefault(owner, {})
    optimizer = per_owner.get(key)
    if optimizer is None:
        kind = PlainSGD if all(p.device.type == "cpu" for p in params) else torch.optim.SGD
        optimizer = per_owner[key] = kind(params, lr=lr, momentum=run.momentum, weight_decay=weight_decay)
    optimizer.state.clear()
    return optimizer


def frozen_copy(module: nn.Module) -> nn.Module:
    """An eval-mode, gradient-free copy of ``module``'s current weights (e.g. the global model as
    received this round). Built by the first call; later calls copy the weights into the same copy."""
    copied = _FROZEN_COPIES.get(module)
    if copied is None:
        copied = _FROZEN_COPIES[module] = copy.deepcopy(module).eval().requires_grad_(False)
    else:
        with torch.no_grad():
            for target, source in zip(copied.state_dict().values(), module.state_dict().values()):
                target.copy_(source)
    return copied


def run_local_steps(
    algorithm,
    sample: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    precision: str = "fp32",
    first: tuple[str, ...] = (),
) -> dict[str, float]:
    """K local steps of ``algorithm`` (a ``LocalStep``); diagnostics are averaged on the device and copied to
    the host once (``first``: see ``StepStats``).
    ``precision="bf16"``: each step runs under bf16 autocast (weights and optimiser stay fp32), which casts the
    weights at every use (``autocast``): a cached copy would run a later phase or step on weights from before
    an update."""
    algorithm.model.train()
    stats = StepStats(first)
    device = next(algorithm.model.parameters()).device
    for _ in range(steps):
        with autocast(device, precision):
            x, y = sample()
            stats.add(algorithm.update(x, y))
    return stats.of_one()


class StepStats:
    """A round's diagnostics, summed over its local steps on the device: each one's mean over the steps, and
    the names in ``first`` also as of the first step, at the weights the round started from, as
    ``first-<name>`` (GroupDRO weighs clients by that loss)."""

    def __init__(self, first: tuple[str, ...] = ()):
        self.first = first
        self.steps = 0
        self.totals: dict[str, torch.Tensor] = {}
        self.firsts: dict[str, torch.Tensor] = {}

    def add(self, stats: dict[str, torch.Tensor]) -> None:
        if self.steps == 0:
            missing = [k for k in self.first if k not in stats]
            if missing:
                raise KeyError(f"the local step reports no {missing[0]!r} (it reports: {', '.join(stats)})")
            self.firsts = {f"first-{k}": stats[k].detach().float().clone() for k in self.first}
        for k, v in stats.items():
            v = v.detach().float()
            self.totals[k] = self.totals[k] + v if k in self.totals else v.clone()
        self.steps += 1

    def of_one(self) -> dict[str, float]:
        """One client's figures (the sums hold scalars)."""
        return {
            **{k: float(v) / self.steps for k, v in self.totals.items()},
            **{k: float(v) for k, v in self.firsts.items()},
        }

    def of_members(self, count: int) -> list[dict[str, float]]:
        """Each member's figures (the sums hold one value per member, a vectorised cohort's)."""
        means = {k: [x / self.steps for x in v.tolist()] for k, v in self.totals.items()}
        means.update({k: v.tolist() for k, v in self.firsts.items()})
        return [{k: v[i] for k, v in means.items()} for i in range(count)]


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    if precision == "bf16":
        # No weight cache: within one local step a phase (FedBR's max step) updates weights that a later phase
        # reads, and a cached bf16 copy would hand that phase the weights from before the update.
        return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)
    raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")


def compile_features(model: nn.Module) -> None:
    """torch.compile, in place, of the backbone's feature extractor: the part every algorithm calls
    and nearly all of the compute. Parameter names and state-dict keys stay as they were."""
    features = getattr(model, "features", None)
    (features if isinstance(features, nn.Module) else model).compile()


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` on tensors already on its device."""
    model.eval()
    loss = torch.zeros((), device=x.device)
    correct = torch.zeros((), device=x.device, dtype=torch.long)
    for start in range(0, len(y), batch_size):
        logits = model(x[start : start + batch_size])
        target = y[start : start + batch_size]
        loss += nn.functional.cross_entropy(logits, target, reduction="sum")
        correct += (logits.argmax(1) == target).sum()
    n = max(len(y), 1)
    return float(loss) / n, float(correct) / n


def module_arrays(prefix: str, module: nn.Module) -> dict[str, np.ndarray]:
    """``{prefix/<state key>: array}`` of a module's state. Copies, never views: on CPU ``.numpy()``
    shares memory with the live parameters."""
    return {f"{prefix}/{k}": t.detach().cpu().numpy().copy() for k, t in module.state_dict().items()}


def load_module_arrays(module: nn.Module, prefix: str, arrays: Mapping[str, np.ndarray]) -> None:
    """Load ``prefix/<state key>`` arrays into a module: every key must be there, with its shape."""
    state = module.state_dict()
    missing = [k for k in state if f"{prefix}/{k}" not in arrays]
    if missing:
        raise ValueError(f"no array for {prefix}/{missing[0]} ({len(missing)} of {len(state)} missing)")
    for key, current in state.items():
        new = arrays[f"{prefix}/{key}"]
        if tuple(current.shape) != tuple(new.shape):
            raise ValueError(f"shape mismatch for '{prefix}/{key}': expected {tuple(current.shape)}, got {new.shape}")
        current.copy_(torch.as_tensor(new))


def parameter_tensors(
    module: nn.Module, prefix: str, arrays: Mapping[str, np.ndarray], device: torch.device | None = None
) -> list[torch.Tensor]:
    """Arrays named like ``module``'s state under ``prefix`` (how the server sends SCAFFOLD's c and FedCM's
    Delta) as tensors for ``module.parameters()``, in that order; buffers are not read."""
    device = device or next(module.parameters()).device
    missing = [name for name, _ in module.named_parameters() if f"{prefix}/{name}" not in arrays]
    if missing:
        raise ValueError(f"no array for {prefix}/{missing[0]} ({len(missing)} missing)")
    return [
        torch.as_tensor(arrays[f"{prefix}/{name}"], dtype=p.dtype, device=device)
        for name, p in module.named_parameters()
    ]


def state_arrays(module: nn.Module, prefix: str, tensors: list[torch.Tensor]) -> dict[str, np.ndarray]:
    """The inverse of ``parameter_tensors``: per-parameter tensors named like ``module``'s state under
    ``prefix``, with zeros for buffers."""
    by_name = {name: t for (name, _), t in zip(module.named_parameters(), tensors)}
    return {
        f"{prefix}/{k}": by_name[k].detach().cpu().numpy().copy()
        if k in by_name
        else np.zeros(v.shape, dtype=np.float32)
        for k, v in module.state_dict().items()
    }


def peak_memory_mb(device: torch.device | str) -> dict[str, float]:
    """This process's peak memory so far: resident host memory, and on CUDA what torch's allocator
    reserved on the device (the CUDA context's few hundred MB come on top)."""
    peak = {"peak-rss-mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}  # Linux: KiB
    if torch.device(device).type == "cuda":
        peak["peak-gpu-mb"] = torch.cuda.max_memory_reserved(device) / 2**20
    return peak


def use_device(cfg: dict) -> torch.device:
    """The config's device, with its CUDA kernel switches (``tf32``, ``cudnn-autotune``) set for this process."""
    run = common(cfg)
    if run.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device=cuda requested but torch sees no CUDA device")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if run.device == "auto" else run.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = run.tf32
        torch.backends.cudnn.allow_tf32 = run.tf32
        torch.backends.cudnn.benchmark = run.cudnn_autotune
    return device
