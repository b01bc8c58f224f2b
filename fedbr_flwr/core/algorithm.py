"""What every algorithm's client side is made of, Flower-free (``clients/<name>.py`` subclass these):

* ``LocalStep``: one client's local optimisation over one round, DomainBed style: ``update(x, y)``
  takes one step and returns scalar diagnostics;
* ``FunctionalStep``: a ``LocalStep`` written as pure functions of named tensors (its inputs drawn
  first, then one or more ``Phase``s of loss -> gradient -> SGD), so that a cohort can step many clients
  at once with ``torch.func.vmap`` (``fedbr_flwr.core.vectorised``); ``update`` runs the same functions;
* ``LocalComponent``: a local piece another algorithm's step can carry (a batch transform, extra loss
  terms, a change of the gradient): FedBR's combinations and the FedAvg-based baselines;
* ``ClientAlgorithm``: the model an algorithm trains (the server builds the same one, through the
  registry), what it receives and returns by name, what it keeps between rounds, the requests it
  answers, and the local step of a round;
* ``NodeState``: a client's own state between messages (Flower's per-node ``context.state`` on a node,
  ``MemoryState`` in tests and the bare benchmark loop).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, cast

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..data.catalog import INFO
from ..data.dataset import ClientData, make_partition
from ..runfiles import codec
from . import attack, seeds
from .broadcast import receive_shared
from .config import common, components_of, resolved_model
from .model import build_model
from .registry import lookup_client, lookup_component
from .settings import NoSettings, Settings
from .training import (
    BatchSampler,
    Optimiser,
    clip_norm_,
    compile_features,
    evaluate,
    load_module_arrays,
    module_arrays,
    peak_memory_mb,
    round_sgd,
    run_local_steps,
)

Named = dict[str, np.ndarray]
RESTORED_KEY = "client-state-restored"
# A fit's new cross-round state waits as pending until the server's next message says, under UPDATE_USED,
# the last round whose update from this client it used: the state is kept if that is the fit's round.
UPDATE_USED = "update-used"
PENDING_PREFIX = "pending/"  # the pending records of the state keys
PENDING_ROUND = "pending-round"  # meta: the round of the fit that left them


# ---------------------------------------------------------------- a client's own state


class NodeState:
    """A client's state between messages, by key: named arrays and small metadata."""

    def arrays(self, key: str) -> Named | None:
        raise NotImplementedError

    def put_arrays(self, key: str, arrays: Named) -> None:
        raise NotImplementedError

    def meta(self, key: str) -> dict | None:
        raise NotImplementedError

    def put_meta(self, key: str, values: dict) -> None:
        raise NotImplementedError

    def drop(self, key: str) -> None:
        """Forget the record ``key`` (arrays or metadata), if there is one."""
        raise NotImplementedError


class MemoryState(NodeState):
    def __init__(self):
        self.records: dict[str, Any] = {}

    def arrays(self, key):
        return dict(self.records[key]) if key in self.records else None

    def put_arrays(self, key, arrays):
        self.records[key] = {k: np.array(v, copy=True) for k, v in arrays.items()}

    def meta(self, key):
        return dict(self.records[key]) if key in self.records else None

    def put_meta(self, key, values):
        self.records[key] = dict(values)

    def drop(self, key):
        self.records.pop(key, None)


class PendingState(NodeState):
    """``base`` as ``after_fit`` sees it: what it writes under ``keys`` goes to their pending records
    (and is read back from there); everything else is ``base``'s own."""

    def __init__(self, base: NodeState, keys: tuple[str, ...]):
        self.base, self.keys = base, keys

    def arrays(self, key):
        pending = self.base.arrays(PENDING_PREFIX + key) if key in self.keys else None
        return pending if pending is not None else self.base.arrays(key)

    def put_arrays(self, key, arrays):
        self.base.put_arrays(PENDING_PREFIX + key if key in self.keys else key, arrays)

    def meta(self, key):
        return self.base.meta(key)

    def put_meta(self, key, values):
        self.base.put_meta(key, values)

    def drop(self, key):
        self.base.drop(key)


# ---------------------------------------------------------------- local steps and their components


@dataclass
class Batch:
    """A local batch. Mixup leaves targets ``y`` and ``y_b`` mixed with weights ``lam`` and ``lam_b``
    (1 - lam; floats, or 0-d tensors in a step's inputs)."""

    x: torch.Tensor
    y: torch.Tensor
    y_b: torch.Tensor | None = None
    lam: float | torch.Tensor = 1.0
    lam_b: float | torch.Tensor | None = None

    def cross_entropy(self, logits: torch.Tensor) -> torch.Tensor:
        if self.y_b is None:
            return F.cross_entropy(logits, self.y)
        lam_b = 1.0 - self.lam if self.lam_b is None else self.lam_b
        return self.lam * F.cross_entropy(logits, self.y) + lam_b * F.cross_entropy(logits, self.y_b)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The batch as a step's inputs (``from_tensors`` reads it back); the mixing weights become 0-d
        float32 tensors holding the same values the floats would be rounded to."""
        out = {"x": self.x, "y": self.y}
        if self.y_b is not None:
            lam_b = 1.0 - self.lam if self.lam_b is None else self.lam_b
            out.update(
                y_b=self.y_b,
                lam=torch.as_tensor(self.lam, dtype=torch.float32, device=self.x.device),
                lam_b=torch.as_tensor(lam_b, dtype=torch.float32, device=self.x.device),
            )
        return out

    @classmethod
    def from_tensors(cls, inputs: dict[str, torch.Tensor]) -> "Batch":
        if "y_b" not in inputs:
            return cls(inputs["x"], inputs["y"])
        return cls(inputs["x"], inputs["y"], inputs["y_b"], inputs["lam"], inputs["lam_b"])


@dataclass
class StepView:
    """What a component's loss terms may read: the batch, the local features and logits, the parameters."""

    batch: Batch
    features: torch.Tensor
    logits: torch.Tensor
    params: list[torch.Tensor]


@dataclass
class RoundContext:
    """What a component may use when a round starts: the model as received, the arrays the server sent
    beside it, and the round's seed streams."""

    model: nn.Module
    received: Named
    seed: Callable[[str], int]
    device: torch.device


class LocalComponent:
    """A local piece other algorithms' steps can carry, registered with ``register_component``. One
    object per client, reused every round."""

    name = ""  # set by register_component
    Settings: type[Settings] = NoSettings
    accepts: tuple[str, ...] = ()  # names of arrays it takes from the server (FedCM: "fedcm-delta/")
    per_member_state: tuple[str, ...] = ()  # as ``FunctionalStep.per_member_state``

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.settings: Any = self.Settings.from_config(cfg)  # its own class: read by each algorithm file

    def start_round(self, ctx: RoundContext) -> None:
        """Per-round set-up before the first step (a teacher copy, the server's direction, a sampler)."""

    def transform(self, batch: Batch) -> Batch:
        return batch

    def terms(self, view: StepView) -> list[tuple[str, float, torch.Tensor]]:
        """(name, weight, value) of each loss term it adds."""
        return []

    def adjust_gradients(self, grads: list[torch.Tensor]) -> None:
        """Change the gradients of the model's parameters in place after the backward pass. The list
        holds one client's gradients (a vectorised cohort passes each member its own slice), in the
        order of ``model.parameters()``."""


class LocalStep:
    """One client's local optimisation over one round: ``update(x, y)`` takes one step and returns scalar
    diagnostics. Subclasses set up their extra state in ``__init__``; the SGD optimiser over the model
    is built (or reused) with its state empty."""

    def __init__(self, model: Any, cfg: dict, components: Sequence[LocalComponent] = ()):
        self.model = model
        self.cfg = cfg
        self.clip_grad_norm = common(cfg).clip_grad_norm  # read once: step() runs every local step
        self.components = list(components)
        self.optimizer = round_sgd(model, model.parameters(), cfg)

    def update(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def transform(self, batch: Batch) -> Batch:
        for component in self.components:
            batch = component.transform(batch)
        return batch

    def add_terms(self, total: torch.Tensor, terms: dict[str, torch.Tensor], view: StepView) -> torch.Tensor:
        """``total`` plus each component's weighted terms, in component order (recorded in ``terms``)."""
        for component in self.components:
            for name, weight, value in component.terms(view):
                terms[name] = value
                total = total + weight * value
        return total

    def adjust_gradients(self, grads: list[torch.Tensor]) -> None:
        """In place, on one client's gradients of the model's parameters (``LocalComponent.adjust_gradients``)."""
        for component in self.components:
            component.adjust_gradients(grads)


Params = dict[str, dict[str, torch.Tensor]]  # parameter group -> parameter name -> tensor
Inputs = dict[str, torch.Tensor]


@dataclass
class Phase:
    """One gradient step inside a local step: ``loss(params, inputs, shared) -> (loss, stats)`` is
    differentiated w.r.t. the parameter groups ``groups`` (gradient ascent when ``ascent``), the
    components adjust the "model" group's gradients when ``adjust``, and each group's SGD steps."""

    groups: tuple[str, ...]
    loss: Callable[[Params, Inputs, dict], tuple[torch.Tensor, dict[str, torch.Tensor]]]
    ascent: bool = False
    adjust: bool = False


class FunctionalStep(LocalStep):
    """A local step written as pure functions of named tensors, which is what lets a cohort step all its
    clients at once (``fedbr_flwr.core.vectorised`` vmaps the same functions over a leading client dimension).
    Its parameter groups are ``self.groups`` ({group: {name: live parameter}}, "model" first) with
    ``self.optimizers`` ({group: its SGD}): by default the model's alone, under the model's SGD, in one phase on
    ``loss`` (whose gradients the components adjust). A subclass may add groups and set its own ``phases``, and
    defines:

    * ``draw(x, y) -> inputs``: one step's tensors for this client. Every random draw happens here, from
      the client's own seeded streams, never inside ``loss``;
    * ``prepare(params, inputs) -> shared``: what the phases share (FedBR: the features), default none. It
      may read only groups that no phase but the last one trains. ``prepare_groups`` names the groups it
      reads: then a vectorised cohort also computes it once a step (``vectorised.shares_prepare``), else
      once per phase;
    * ``phases``: the ``Phase``s of a step, in order; their losses read the parameters only from
      ``params`` and per-client tensors only from ``inputs`` (``constants()`` are merged in), so that
      anything else they read is the same for every client of a round (the global model, the pseudo-data).
      A vectorised cohort enforces this (``vectorised.check_members_agree``): every attribute of its members'
      steps and components must be equal, except random generators and those named in ``per_member_state``
      (a client's own values that only ``draw``, ``constants`` or ``adjust_gradients`` read).

    ``update`` runs exactly these functions on the live parameters, one client at a time."""

    phases: list[Phase]
    groups: Params
    optimizers: dict[str, Optimiser]
    prepare_groups: tuple[str, ...] = ()
    per_member_state: tuple[str, ...] = ()

    def __init__(self, model: Any, cfg: dict, components: Sequence[LocalComponent] = ()):
        super().__init__(model, cfg, components)
        self.groups = {"model": dict(model.named_parameters())}
        self.optimizers = {"model": self.optimizer}
        self.phases = [Phase(("model",), self.loss, adjust=True)]

    def loss(self, params: Params, inputs: Inputs, shared: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        raise NotImplementedError

    def draw(self, x: torch.Tensor, y: torch.Tensor) -> Inputs:
        return {"x": x, "y": y}

    def constants(self) -> Inputs:
        """Per-client tensors fixed for the round, which the losses read (MOON's previous model)."""
        return {}

    def prepare(self, params: Params, inputs: Inputs) -> dict:
        return {}

    def step_inputs(self, x: torch.Tensor, y: torch.Tensor) -> Inputs:
        return {**self.draw(x, y), **self.constants()}

    def update(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        inputs = self.step_inputs(x, y)
        shared = self.prepare(self.groups, inputs)
        stats: dict[str, torch.Tensor] = {}
        for phase in self.phases:
            stats.update(self.run_phase(phase, inputs, shared))
        return stats

    def run_phase(self, phase: Phase, inputs: Inputs, shared: dict) -> dict[str, torch.Tensor]:
        """One phase on the live parameters: its loss, the gradients of its groups only, the components'
        adjustment, the gradients of its groups clipped together (clip-grad-norm), each group's SGD step;
        returns its detached stats."""
        loss, stats = phase.loss(self.groups, inputs, shared)
        for group in phase.groups:
            self.optimizers[group].zero_grad(set_to_none=True)
        (-loss if phase.ascent else loss).backward(inputs=[p for g in phase.groups for p in self.groups[g].values()])
        if phase.adjust:
            self.adjust_gradients(cast(list[torch.Tensor], [p.grad for p in self.groups["model"].values()]))
        if self.clip_grad_norm:
            grads = [p.grad for g in phase.groups for p in self.groups[g].values()]
            clip_norm_(cast(list[torch.Tensor], grads), self.clip_grad_norm)
        for group in phase.groups:
            self.optimizers[group].step()
        return {k: v.detach() for k, v in stats.items()}


def call(module: nn.Module, params: dict[str, torch.Tensor], prefix: str, *args) -> torch.Tensor:
    """``module(*args)`` with the parameters ``params[<prefix>.<name>]`` (``module`` is the submodule at
    ``prefix`` of the module ``params`` belong to; prefix "" for the module itself). Inside
    ``modules_in(dtype)``, the module runs in ``dtype`` and its output comes back as fp32; under autocast too, so
    that the losses stay fp32 on the per-client path as on the vectorised one (CPU autocast would otherwise
    compute FedBR's cosines and softplus in bf16)."""
    if prefix:
        start = len(prefix) + 1
        params = {k[start:]: v for k, v in params.items() if k.startswith(prefix + ".")}
    dtype = _MODULE_DTYPE.get()
    if dtype is None:
        out = torch.func.functional_call(module, params, args)
        return cast_floating(out, torch.float32) if torch.is_autocast_enabled(out.device.type) else out
    params = {k: cast_floating(v, dtype) for k, v in params.items()}
    return cast_floating(
        torch.func.functional_call(module, params, tuple(cast_floating(a, dtype) for a in args)), torch.float32
    )


_MODULE_DTYPE: contextvars.ContextVar[torch.dtype | None] = contextvars.ContextVar("module_dtype", default=None)


@contextlib.contextmanager
def modules_in(dtype: torch.dtype | None):
    """Within: every ``call`` runs its module in ``dtype`` (its parameters and floating inputs cast; the losses
    stay fp32); None: as they are. The vectorised step's ``precision=bf16``: autocast does not reach
    convolutions under ``torch.func.vmap`` (they stay fp32) and leaves a linear layer's bias add in fp32."""
    token = _MODULE_DTYPE.set(dtype)
    try:
        yield
    finally:
        _MODULE_DTYPE.reset(token)


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


# ---------------------------------------------------------------- an algorithm's client side


class ClientAlgorithm:
    """The client side of one algorithm. Subclasses (one per ``clients/<name>.py``, registered with
    ``register_client``) override ``make_step`` and, as needed, the model classmethods and the hooks."""

    name = ""  # set by register_client
    Settings: type[Settings] = NoSettings
    state_keys: tuple[str, ...] = ()  # its records in the node state, saved in checkpoints
    accepts: tuple[str, ...] = ()  # prefixes of arrays it takes beside its modules' (SCAFFOLD: "control/")
    component_key: str | None = None  # the setting that lists components to carry (FedBR: fedbr-with)
    seed_streams: dict[str, str] = {}  # a component's stream -> this algorithm's (FedBR: mixup -> fedbr-mixup)
    vectorised = False  # set True when make_step returns a FunctionalStep, which a cohort can vmap (cohort-step)
    compiles_vectorised = True  # False where torch.compile cannot trace its vmapped step (compile=true)
    # set True on the class once its CUDA-graph step has run on a GPU and matched vmap (tests/test_vectorised.py's
    # GPU test): cohort-step=auto then replays it as a graph there, without components (node.cohort_step)
    graph_checked_on_gpu = False
    first_step_stats: tuple[str, ...] = ()  # diagnostics also reported as of the first step, as first-<name>

    @classmethod
    def carried_components(cls, cfg: Mapping[str, Any]) -> tuple[str, ...]:
        """Components its local steps carry because of its own settings (GroupDRO: mixup by default)."""
        return ()

    # ------------------------------------------------------------ the model (the server builds the same)
    @classmethod
    def build_model(cls, backbone: nn.Module, cfg: dict) -> nn.Module:
        """The model this algorithm trains and the server averages, built around the backbone."""
        return backbone

    @classmethod
    def extra_modules(cls, model: nn.Module, cfg: dict) -> dict[str, nn.Module]:
        """Modules trained and averaged beside the model (FedBR's head), each sent as '<name>/<key>'."""
        return {}

    @classmethod
    def predictor(cls, model: nn.Module, cfg: dict) -> nn.Module:
        """What predicts the dataset's classes from an input (VHL: the real classes' logits only)."""
        return model

    @classmethod
    def returned_shapes(cls, model: nn.Module, cfg: dict) -> dict[str, tuple[int, ...]]:
        """Arrays each client returns beside its modules' (SCAFFOLD's change of c_i, DisTrans' offset)."""
        return {}

    @classmethod
    def build_modules(cls, cfg: dict, compile: bool = False) -> dict[str, nn.Module]:
        """{"model": ..., **extra_modules}, drawn from torch's RNG in this order (the server seeds it first)."""
        info = INFO[common(cfg).dataset]
        backbone = build_model(resolved_model(cfg), info.num_classes, info.in_channels, info.image_size)
        if compile:
            compile_features(backbone)
        model = cls.build_model(backbone, cfg)
        return {"model": model, **cls.extra_modules(model, cfg)}

    def __init__(self, cfg: dict, data: ClientData, device: torch.device | str, state: NodeState | None = None):
        self.cfg = cfg
        self.bind(data, state if state is not None else MemoryState())
        self.device = torch.device(device)
        self.settings: Any = self.Settings.from_config(cfg)  # its own class: read by each algorithm file
        self.modules = {k: m.to(self.device) for k, m in self.build_modules(cfg, common(cfg).compile).items()}
        # a SplitModel, or a model around one with its own features and classifier (DisTrans): duck-typed
        self.model: Any = self.modules["model"]
        self.components = self.build_components()

    def build_components(self) -> list[LocalComponent]:
        return [component_class(name)(self.cfg) for name in components_of(self.cfg)]

    def bind(self, data: ClientData, state: NodeState) -> None:
        """Serve the client of ``data`` with its node state (a cohort's node serves its members in turn:
        everything of a client between messages lives in its data and its node state, not in the model)."""
        self.data, self.pid, self.state = data, data.partition_id, state
        self.received: Named = {}  # what the server sent beside the modules' arrays this message
        self.shared_versions: dict[str, int] = {}  # broadcast data this client used this round (reported back)
        self.fit_sent: Named = {}  # the arrays of the fit in progress (start_fit sets them, and its round)
        self.fit_round = 0

    # ------------------------------------------------------------ hooks for algorithms
    def make_step(self, server_round: int, config: dict) -> LocalStep:
        raise NotImplementedError

    def after_fit(self, step: Any) -> tuple[Named, dict[str, float]]:  # step: what make_step returned
        """Arrays returned beside the modules', and metrics beside the step's; also where per-client state
        is kept for the next round."""
        return {}, {}

    def after_evaluate(self) -> None:
        """Called after the local test set was evaluated (DisTrans keeps a server-sent offset)."""

    def eval_module(self) -> nn.Module:
        """What predicts on the local test set (DisTrans: the model with this client's offset)."""
        return self.predictor(self.model, self.cfg)

    def requests(self) -> dict[str, Callable[[dict], Named]]:
        """The named requests it answers besides 'client-state' (FedBR: 'rsm-means')."""
        return {}

    # ------------------------------------------------------------ helpers for algorithms
    def start_components(self, server_round: int) -> list[LocalComponent]:
        """Its components, set up for this round (with the round's seed streams)."""

        def stream_seed(stream: str) -> int:
            return seeds.seed(self.seed_streams.get(stream, stream), common(self.cfg).seed, server_round, self.pid)

        ctx = RoundContext(self.model, self.received, stream_seed, self.device)
        for component in self.components:
            component.start_round(ctx)
        return self.components

    def round_seed(self, stream: str, server_round: int) -> int:
        """The seed of this client's stream ``stream`` in round ``server_round``."""
        return seeds.seed(stream, common(self.cfg).seed, server_round, self.pid)

    def shared(self, name: str, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The server's broadcast data ``name`` (FedBR's pseudo-data, FedMix's means, VHL's virtual data)
        on this client's device; the version used is reported with the fit result."""
        x, y, self.shared_versions[name] = receive_shared(self.state, name, config, self.pid)
        return torch.from_numpy(x).to(self.device), torch.from_numpy(y).to(self.device)

    # ------------------------------------------------------------ what the node calls
    def properties(self) -> dict[str, Any]:
        _, phash = make_partition(self.cfg)
        counts = torch.bincount(self.data.y_train, minlength=self.data.num_classes).tolist()
        return {
            "partition-id": self.pid,
            "num-partitions": common(self.cfg).num_clients,
            "partition-hash": phash,
            "num-train": len(self.data.y_train),
            "num-test": len(self.data.y_test),
            "class-counts": ",".join(map(str, counts)),
        }

    def weights(self) -> Named:
        return {name: a for prefix, m in self.modules.items() for name, a in module_arrays(prefix, m).items()}

    def receive(self, arrays: Named) -> None:
        """Load the modules' arrays; keep what else the server sent in ``self.received``."""
        run = common(self.cfg)
        for prefix, module in self.modules.items():
            try:
                load_module_arrays(module, prefix, arrays)
            except ValueError as exc:
                raise ValueError(f"client {self.pid} ({run.strategy}): {exc}") from None
        own = {f"{p}/{k}" for p, m in self.modules.items() for k in m.state_dict()}
        self.received = {k: v for k, v in arrays.items() if k not in own}
        accepted = self.accepts + tuple(p for c in self.components for p in c.accepts)
        unexpected = [k for k in self.received if not k.startswith(accepted)]
        if unexpected:
            raise ValueError(f"client {self.pid} ({run.strategy}) does not take arrays {', '.join(unexpected[:5])}")

    def fit(self, arrays: Named, config: dict) -> tuple[Named, int, dict]:
        run = common(self.cfg)
        step, sampler = self.start_fit(arrays, config)
        start = time.perf_counter()
        stats = run_local_steps(step, sampler, run.local_steps, run.precision, self.first_step_stats)
        return self.finish_fit(step, stats, time.perf_counter() - start)

    def start_fit(self, arrays: Named, config: dict) -> tuple[LocalStep, BatchSampler]:
        """A fit up to its local steps: the state restored, the arrays received, the round's step and
        this client's batch stream."""
        self.restore_state(config)
        self.receive(arrays)
        server_round = self.fit_round = int(config["server-round"])
        self.fit_sent = arrays  # what a simulated attacker changes its reply from
        step = self.make_step(server_round, config)
        run = common(self.cfg)
        sampler = BatchSampler(self.data, run.batch_size, seeds.seed("batches", run.seed, server_round, self.pid))
        return step, sampler

    def finish_fit(self, step: LocalStep, stats: dict[str, float], seconds: float) -> tuple[Named, int, dict]:
        """A fit after its local steps (the modules hold this client's trained weights): what it returns."""
        returned, extra = self.after_fit_pending(step)
        metrics = {
            **stats,
            "partition-id": self.pid,
            "fit-seconds": seconds,
            **peak_memory_mb(self.device),
            **{f"{name}-version": v for name, v in self.shared_versions.items()},
            **extra,
        }
        reply = attack.poisoned({**self.weights(), **returned}, self.fit_sent, self.cfg, self.fit_round, self.pid)
        return reply, len(self.data.y_train), metrics

    def after_fit_pending(self, step: LocalStep) -> tuple[Named, dict[str, float]]:
        """``after_fit``, with the state it keeps under ``state_keys`` written as pending: the server may
        reject this update or skip the round, and then the client goes on from the state it had."""
        state, self.state = self.state, PendingState(self.state, self.state_keys)
        try:
            returned, extra = self.after_fit(step)
        finally:
            self.state = state
        if self.state_keys:
            self.state.put_meta(PENDING_ROUND, {"round": self.fit_round})
        return returned, extra

    def settle_pending(self, config: dict) -> None:
        """Keep the state the last fit left pending when the server used that fit's update (its message
        says so under ``UPDATE_USED``; a caller that says nothing, such as the bare loop, used it), else
        drop it."""
        pending = self.state.meta(PENDING_ROUND)
        if pending is None:
            return
        used = UPDATE_USED not in config or int(config[UPDATE_USED]) == int(pending["round"])
        for key in self.state_keys:
            arrays = self.state.arrays(PENDING_PREFIX + key)
            if arrays is not None:
                if used:
                    self.state.put_arrays(key, arrays)
                self.state.drop(PENDING_PREFIX + key)
        self.state.drop(PENDING_ROUND)

    def evaluate(self, arrays: Named, config: dict) -> tuple[float, int, dict]:
        loss, acc = evaluate(self.start_evaluate(arrays, config), self.data.x_test, self.data.y_test)
        return self.finish_evaluate(loss, acc)

    def start_evaluate(self, arrays: Named, config: dict) -> nn.Module:
        """An evaluation up to its forward passes: the state restored, the arrays received; what predicts."""
        self.restore_state(config)
        self.receive(arrays)
        return self.eval_module()

    def finish_evaluate(self, loss: float, acc: float) -> tuple[float, int, dict]:
        self.after_evaluate()
        return loss, len(self.data.y_test), {"accuracy": acc, "partition-id": self.pid}

    def answer(self, config: dict) -> Named:
        """The arrays asked for by a named request (``config["request"]``)."""
        name = str(config.get("request", ""))
        if name == "client-state":
            self.restore_state(config)
            return {"state": codec.to_uint8(self.export_state())}
        handlers = self.requests()
        if name not in handlers:
            raise ValueError(
                f"client {self.pid} ({common(self.cfg).strategy}) answers no request '{name}' "
                f"(it answers: {', '.join(['client-state', *handlers])})"
            )
        return handlers[name](config)

    # ------------------------------------------------------------ its own state, for checkpoints
    def export_state(self) -> bytes:
        """Its ``state_keys`` records, as '<key>/<name>' arrays."""
        return codec.encode(
            {f"{key}/{name}": a for key in self.state_keys for name, a in (self.state.arrays(key) or {}).items()}
        )

    def restore_state(self, config: dict) -> None:
        """The state the server's message settles: the last fit's pending state kept or dropped
        (``settle_pending``); and after a resume, the state this client had at the checkpoint, which the
        server hands back until the client answers, applied once, before anything reads the state."""
        self.settle_pending(config)
        if "client-state" not in config or self.state.meta(RESTORED_KEY) is not None:
            return
        saved = codec.decode(config["client-state"])
        for key in self.state_keys:
            arrays = {name.split("/", 1)[1]: a for name, a in saved.items() if name.split("/", 1)[0] == key}
            if arrays:
                self.state.put_arrays(key, arrays)
        self.state.put_meta(RESTORED_KEY, {"restored": True})


def client_class(name: str) -> type[ClientAlgorithm]:
    """The client side of algorithm ``name`` (else of what it builds on, ``registry.lineage``; else FedAvg's)."""
    return lookup_client(name)


def component_class(name: str) -> type[LocalComponent]:
    return lookup_component(name)
