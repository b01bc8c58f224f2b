"""Many clients' local steps at once on one device: every member's ``FunctionalStep`` functions, batched
over a leading client dimension with ``torch.func.vmap`` (a cohort's ``cohort-step=vmap``). Flower-free.

Each step of the K local steps:
1. each member draws its own inputs (``draw``: its batch, its random draws, from its own seeded
   streams, exactly as on its own), and they are stacked beside its round's ``constants``. With the
   cohort's partitions packed in one tensor (``PackedBatches``), every member draws its indices and one
   gather makes all members' batches; what is stacked already is not stacked again (``DrawStacker``);
2. for each phase, the gradients of every member come from one vmapped ``torch.func.grad`` of the phase's
   loss; each member's components adjust its own slice; one SGD (torch's, over the stacked parameters)
   steps all members: SGD is elementwise, so this is each member's own SGD.
The math is the members' own functions; only the orchestration is batched. Autograd graphs cannot cross
vmap calls, so what the phases share (``prepare``) is recomputed inside each phase, unless the step
``shares_prepare`` (FedBR): then one vmapped function computes it once with its pullback
(``torch.func.vjp``), steps the earlier phases (FedBR's max step on the head) with torch's SGD written as a
function (``sgd_values``), and returns the last phase's gradients, through ``prepare`` by the pullback; the
last phase is adjusted and stepped as above. FedBR thus pays one feature forward a step, as on its own.

``cohort-step=graph`` (CUDA only) runs the same step: the first of the K steps is also captured as a CUDA
graph (``cuda_graph``: vmapped gradients, the components' adjustments and the SGD updates), and the
other K - 1 replay it with each step's draws copied into the captured step's input buffers. The graph
is captured again each round, as the members and their tensors change.

``cohort-conv=matmul`` computes the members' convolutions as batched matrix products instead of the grouped
convolutions vmap makes of them (``MatmulConv2d``, swapped in for the step by ``convolutions_as``).

``compile=true`` runs each step's vmapped gradients (``phase_gradients``, ``shared_prepare_gradients``) through
``torch.compile`` (``compiled``), which can fuse the elementwise work and the layout copies that vmap's grouped
convolutions and group norms leave between the kernels.

``evaluate_members`` evaluates every member's local test set at once the same way: each member's
predictor state (the global model; DisTrans: with that member's offset) vmapped over padded test sets, in
groups of members with test sets of similar length and a bounded number of images (``evaluation_groups``)."""

from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from .algorithm import FunctionalStep, Inputs, Params, Phase, modules_in
from .training import BatchSampler, Optimiser, StepStats, autocast, clip_norm_, clip_scale


@dataclass
class Member:
    """One client of a vectorised cohort: its step for this round, its batch stream, and its groups' values
    when the round started (copied at once: members share the live modules, which the next member's
    ``start_fit`` overwrites)."""

    step: FunctionalStep
    sample: BatchSampler  # its own stream, which ``PackedBatches`` draws from
    start: Params


class PackedBatches:
    """Every member's next training batch at once, from the cohort's packed partitions
    (``fedbr_flwr.data.dataset.PackedPartitions``): each member still draws its indices from its own stream
    (``BatchSampler.indices``, then ``augmented``, in the order it draws them on its own), and one gather
    serves all members instead of two per member."""

    def __init__(self, samplers: list[BatchSampler], offsets: list[int], x: torch.Tensor, y: torch.Tensor):
        for sampler, offset in zip(samplers, offsets):
            if sampler.x.data_ptr() != x[offset].data_ptr() or sampler.y.data_ptr() != y[offset].data_ptr():
                raise ValueError(f"a member's batch stream does not read the packed partitions at row {offset}")
        self.samplers, self.x, self.y = samplers, x, y
        self.offsets = torch.tensor(offsets, device=x.device)[:, None]

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([s.indices() for s in self.samplers]).add_(self.offsets)
        x, y = self.x[rows], self.y[rows]
        if any(s.augment for s in self.samplers):
            x = torch.stack([s.augmented(own) for s, own in zip(self.samplers, x)])
        return x, y


class DrawStacker:
    """The members' draws of a step stacked into one step's inputs, without copying what is stacked already:
    a member's value that is the very tensor it got (its slice of the gathered batch) or gave the step before
    (FedBR's pseudo-data, fixed for the round) is taken from that stacked tensor. A draw thus must not change
    a tensor in place that it gave before: a new value is a new tensor."""

    def __init__(self):
        self.known: dict[str, tuple[list[torch.Tensor], torch.Tensor]] = {}  # key -> (member values, stacked)
        self.batch: dict[str, tuple[list[torch.Tensor], torch.Tensor]] = {}

    def split(self, x: torch.Tensor, y: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each member's slice of the step's gathered batch, for its draw (which may give it back as is)."""
        xs, ys = list(x.unbind()), list(y.unbind())
        self.batch = {"x": (xs, x), "y": (ys, y)}
        return list(zip(xs, ys))

    def __call__(self, draws: list[Inputs]) -> Inputs:
        known = {**self.known, **self.batch}
        self.batch = {}
        out = {}
        for key in draws[0]:
            values = [d[key] for d in draws]
            seen = known.get(key)
            if seen is not None and all(v is s for v, s in zip(values, seen[0])):
                out[key] = seen[1]
            else:
                out[key] = torch.stack(values)
            self.known[key] = (values, out[key])
        return out


NOT_COMPARED = ("groups", "optimizers", "optimizer", "phases", "components")  # per member by construction


def check_members_agree(members: list[Member]) -> None:
    """Stop unless every member's step and components hold what member 0's hold, apart from what they declare
    in ``per_member_state``: a vectorised cohort runs member 0's loss functions for every member, so a
    per-client value read by a loss must reach it through ``draw`` or ``constants`` (as inputs), and one
    that only ``draw``, ``constants`` or ``adjust_gradients`` read must be declared. Random generators are
    per-client streams by nature (a loss cannot draw under vmap)."""
    template = members[0].step
    for index, member in enumerate(members[1:], start=1):
        pairs: list[tuple[str, object, object]] = [(type(template).__name__, template, member.step)]
        if len(member.step.components) != len(template.components):
            raise ValueError(
                f"cohort-step=vmap: member {index} carries {len(member.step.components)} components, "
                f"member 0 {len(template.components)}"
            )
        pairs += [(type(c).__name__, c, own) for c, own in zip(template.components, member.step.components)]
        for name, want, got in pairs:
            where = differing_attribute(want, got, name, skipped=NOT_COMPARED)
            if where is not None:
                raise ValueError(
                    f"cohort-step=vmap: {where} differs between members 0 and {index} of a cohort, but the "
                    "vectorised step runs member 0's loss functions for every member. Pass a per-client value "
                    "that a loss reads through draw() or constants(); declare one that only draw, constants "
                    "or adjust_gradients read in the class's per_member_state"
                )


def differing_attribute(want, got, path: str, skipped: tuple[str, ...] = (), depth: int = 0) -> str | None:
    """The path of the first value in ``got`` that differs from ``want`` (tensors and module states by value,
    methods by function, objects by their attributes, two levels deep), or None."""
    if want is got or isinstance(want, (torch.Generator, np.random.Generator)):
        return None
    if type(want) is not type(got):
        return path
    if isinstance(want, torch.Tensor):
        same = want.shape == got.shape and want.dtype == got.dtype and torch.equal(want, got)
        return None if same else path
    if isinstance(want, nn.Module):  # another module object (the live modules and frozen copies are shared)
        want, got = (dict([*m.named_parameters(), *m.named_buffers()]) for m in (want, got))
    if isinstance(want, (list, tuple)):  # compared as {index: item}
        if len(want) != len(got):
            return path
        want, got = dict(enumerate(want)), dict(enumerate(got))
    if isinstance(want, dict):
        if list(want) != list(got):
            return path
        return next(
            (d for k in want if (d := differing_attribute(want[k], got[k], f"{path}[{k!r}]", depth=depth)) is not None),
            None,
        )
    if isinstance(want, types.MethodType):
        return None if want.__func__ is got.__func__ else path
    if hasattr(want, "__dict__") and not isinstance(want, (types.FunctionType, type)):
        if depth >= 2:
            return None
        own = set(skipped) | set(getattr(want, "per_member_state", ()))
        for k, v in vars(want).items():
            d = None if k in own else differing_attribute(v, vars(got).get(k), f"{path}.{k}", depth=depth + 1)
            if d is not None:
                return d
        return None
    try:
        return None if bool(want == got) else path
    except (TypeError, ValueError, RuntimeError):
        return path


def snapshot(step: FunctionalStep) -> Params:
    return {g: {n: p.detach().clone() for n, p in ps.items()} for g, ps in step.groups.items()}


def stacked(values: list[dict]) -> dict:
    """A list of equally shaped nested dicts of tensors -> one nested dict of tensors with a leading dimension."""
    first = values[0]
    if isinstance(first, dict):
        return {k: stacked([v[k] for v in values]) for k in first}
    return torch.stack(values)


def sgd_like(optimizer: Optimiser, tensors: list[torch.Tensor]) -> Optimiser:
    """An optimiser of ``optimizer``'s class and hyperparameters over ``tensors``, its state empty."""
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    return type(optimizer)(tensors, **hyper)


def phase_gradients(
    template: FunctionalStep, phase: Phase, params: Params, inputs: Inputs
) -> tuple[Params, dict[str, torch.Tensor]]:
    """Every member's gradients of ``phase``'s loss w.r.t. its groups, and its stats, each with a leading
    member dimension."""
    trained = {g: params[g] for g in phase.groups}
    fixed = {g: v for g, v in params.items() if g not in phase.groups}

    def objective(trained: Params, fixed: Params, inputs: Inputs):
        own = {**fixed, **trained}
        loss, stats = phase.loss(own, inputs, template.prepare(own, inputs))
        return (-loss if phase.ascent else loss), stats

    return torch.func.vmap(torch.func.grad(objective, has_aux=True))(trained, fixed, inputs)


def shares_prepare(step: FunctionalStep) -> bool:
    """Whether every member's ``prepare`` can be computed once per step for all phases (FedBR's features):
    the step names the groups it reads, only the last phase trains them, and the earlier phases neither
    train the last phase's groups nor adjust gradients."""
    *earlier, last = step.phases
    reads, trained_last = set(step.prepare_groups), set(last.groups)
    return (
        bool(earlier and reads)
        and reads <= trained_last
        and not any(phase.adjust or set(phase.groups) & trained_last for phase in earlier)
    )


def sgd_values(params: dict, grads: dict, momentum: dict | None, hyper: dict) -> tuple[dict, dict]:
    """torch's SGD update as a function: (new values, new momentum buffers) of one group, whose buffers are
    None before its first step."""
    if hyper["maximize"]:
        raise ValueError("a vectorised step's SGD does not maximise: a Phase ascends by its ascent flag")
    lr, mu, wd = hyper["lr"], hyper["momentum"], hyper["weight_decay"]
    new, buffers = {}, {}
    for name, p in params.items():
        g = grads[name] + wd * p if wd else grads[name]
        if mu:
            buffers[name] = g if momentum is None else momentum[name] * mu + (1 - hyper["dampening"]) * g
            g = g + mu * buffers[name] if hyper["nesterov"] else buffers[name]
        new[name] = p - lr * g
    return new, buffers


def shared_prepare_gradients(
    template: FunctionalStep, params: Params, momentum: Params, inputs: Inputs
) -> tuple[Params, Params, Params, dict[str, torch.Tensor]]:
    """One step of every member for a step that ``shares_prepare``: ``prepare`` once (kept with its pullback),
    the earlier phases stepped inside with ``sgd_values`` on its values, then the last phase's gradients,
    through ``prepare`` by the pullback. Returns (the earlier phases' new values, their new momentum buffers,
    the last phase's gradients, the stats), each with a leading member dimension."""
    *earlier, last = template.phases
    hyper = {g: template.optimizers[g].param_groups[0] for phase in earlier for g in phase.groups}
    clip = template.clip_grad_norm  # an earlier phase's gradients clipped here, per member

    def member(params: Params, momentum: Params, inputs: Inputs):
        params, stepped, buffers, stats = dict(params), {}, {}, {}
        read = {g: params[g] for g in template.prepare_groups}
        shared, pullback = torch.func.vjp(lambda read: template.prepare({**params, **read}, inputs), read)[:2]
        for phase in earlier:

            def objective(trained: Params):  # called at once, in this iteration: the late binding is safe
                loss, terms = phase.loss({**params, **trained}, inputs, shared)  # noqa: B023
                return (-loss if phase.ascent else loss), terms  # noqa: B023

            grads, terms = torch.func.grad(objective, has_aux=True)({g: params[g] for g in phase.groups})
            if clip:
                scale = clip_scale([t for named in grads.values() for t in named.values()], clip)
                grads = {g: {n: t * scale for n, t in named.items()} for g, named in grads.items()}
            for g in phase.groups:
                params[g], buffers[g] = sgd_values(params[g], grads[g], momentum.get(g), hyper[g])
                stepped[g] = params[g]
            stats.update(terms)

        def last_objective(trained: Params, shared: dict):
            loss, terms = last.loss({**params, **trained}, inputs, shared)
            return (-loss if last.ascent else loss), terms

        (direct, through_shared), terms = torch.func.grad(last_objective, argnums=(0, 1), has_aux=True)(
            {g: params[g] for g in last.groups}, shared
        )
        (through_prepare,) = pullback(through_shared)
        grads = {
            g: {n: t + through_prepare[g][n] if g in through_prepare else t for n, t in named.items()}
            for g, named in direct.items()
        }
        stats.update(terms)
        return stepped, {g: b for g, b in buffers.items() if b}, grads, stats

    return torch.func.vmap(member)(params, momentum, inputs)


@dataclass(frozen=True)
class StepOptions:
    """How ``run_members`` steps its members: the run's ``precision``; ``conv``, how the members' convolutions
    are batched (cohort-conv, ``convolutions_as``); ``compile``, the gradients through ``torch.compile``;
    ``first``, diagnostics also reported as of the first step (``StepStats``); ``capture`` (``cuda_graph``,
    cohort-step=graph): the first step runs on fixed input buffers and is captured, and the other K - 1 replay
    it, each after copying its freshly drawn inputs into those buffers."""

    precision: str = "fp32"
    conv: str = "grouped"
    compile: bool = False
    first: tuple[str, ...] = ()
    capture: Callable[[Callable[[], dict]], tuple[dict, Callable[[], dict]]] | None = None


def run_members(
    members: list[Member],
    batches: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    options: StepOptions = StepOptions(),
) -> tuple[list[Params], list[dict[str, float]]]:
    """K local steps of every member at once: each member's trained groups (views into the stacked
    tensors) and its diagnostics averaged over the steps, as ``run_local_steps`` gives one client.
    ``batches`` (``PackedBatches``): every member's batch of a step at once, as each member's ``sample`` draws it."""
    check_members_agree(members)
    template = members[0].step
    template.model.train()
    params = stacked([m.start for m in members])
    optimizers = {g: sgd_like(template.optimizers[g], list(params[g].values())) for g in params}
    constants = stacked([m.step.constants() for m in members])  # stacked once a round
    share_prepare = shares_prepare(template)
    round_stats = StepStats(options.first)
    device = next(iter(params["model"].values())).device
    precision, capture = options.precision, options.capture
    gradients = compiled(phase_gradients) if options.compile else phase_gradients
    prepared_gradients = compiled(shared_prepare_gradients) if options.compile else shared_prepare_gradients

    stack = DrawStacker()

    def draw() -> Inputs:
        with modules_in(None), autocast(device, precision):  # as the per-client path draws (FedBR's z_g)
            return stack([m.step.draw(*own) for m, own in zip(members, stack.split(*batches()))])

    momentum: Params = {}  # shares_prepare: the earlier phases' momentum buffers, from the first step on
    clip = template.clip_grad_norm  # each member's gradient of a phase, clipped on its own

    def apply(phase: Phase, grads: Params) -> None:
        """The components' adjustments of each member's slice, each member's clipping (clip-grad-norm), then
        each group's SGD over the stacked values."""
        if phase.adjust:
            for i, member in enumerate(members):
                member.step.adjust_gradients([g[i] for g in grads["model"].values()])
        if clip:
            for i in range(len(members)):
                clip_norm_([grads[group][name][i] for group in phase.groups for name in grads[group]], clip)
        for group in phase.groups:
            for name, tensor in params[group].items():
                tensor.grad = grads[group][name]
            optimizers[group].step()

    def step(inputs: Inputs) -> dict[str, torch.Tensor]:
        """One local step of every member; its stats as one member's ``update`` gives them (a later phase's
        figure replaces an earlier one's of the same name)."""
        if share_prepare:
            stepped, buffers, grads, stats = prepared_gradients(template, params, momentum, inputs)
            copy_values(params, stepped)
            if momentum:
                copy_values(momentum, buffers)
            else:  # the first step makes the buffers that later steps (and a captured step) update in place
                momentum.update({g: {n: b.clone() for n, b in named.items()} for g, named in buffers.items()})
            apply(template.phases[-1], grads)
            return stats
        out: dict[str, torch.Tensor] = {}
        for phase in template.phases:
            grads, stats = gradients(template, phase, params, inputs)
            apply(phase, grads)
            out.update(stats)
        return out

    with modules_in(module_dtype(precision)), convolutions_as(options.conv, step_modules(template)):
        if capture is None:
            for _ in range(steps):
                round_stats.add(step({**draw(), **constants}))
        elif steps:
            buffers = draw()
            first_step, replay = capture(lambda: step({**buffers, **constants}))
            round_stats.add(first_step)
            for _ in range(steps - 1):
                copy_inputs(buffers, draw())
                round_stats.add(replay())
    finals = [{g: {n: t[i] for n, t in ps.items()} for g, ps in params.items()} for i in range(len(members))]
    return finals, round_stats.of_members(len(members))


@functools.cache
def compiled(function: Callable) -> Callable:
    """``function`` through ``torch.compile``, one per process: a later round, whose step and members are new
    objects of the same code, reuses the compiled code instead of compiling it again."""
    return torch.compile(function)


class MatmulConv2d(nn.Conv2d):
    """A Conv2d computed as its weight matrix times its input's unfolded patches (``cohort-conv=matmul``):
    under vmap one batched matrix product over the members, where ``F.conv2d`` becomes a grouped convolution.
    The same parameters, buffers and state dict as the Conv2d whose class it replaces."""

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.padding_mode != "zeros" or isinstance(self.padding, str) or self.groups != 1:
            return super()._conv_forward(input, weight, bias)
        height, width = (
            (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
            for size, pad, dilation, kernel, stride in zip(
                input.shape[-2:], self.padding, self.dilation, self.kernel_size, self.stride
            )
        )
        patches = F.unfold(input, self.kernel_size, self.dilation, self.padding, self.stride)
        out = weight.flatten(1) @ patches
        if bias is not None:
            out = out + bias[:, None]
        return out.view(*out.shape[:-1], height, width)


@contextlib.contextmanager
def convolutions_as(conv: str, modules: Iterable[nn.Module]) -> Iterator[None]:
    """Within: the plain Conv2d layers of ``modules`` computed as ``conv`` says: "grouped" (unchanged: vmap
    makes the members' convolutions one grouped convolution) or "matmul" (``MatmulConv2d``)."""
    if conv not in ("grouped", "matmul"):
        raise ValueError(f"cohort-conv must be grouped or matmul, got {conv!r}")
    layers = {id(m): m for module in modules for m in module.modules() if type(m) is nn.Conv2d}
    swapped = list(layers.values()) if conv == "matmul" else []
    for layer in swapped:
        layer.__class__ = MatmulConv2d
    try:
        yield
    finally:
        for layer in swapped:
            layer.__class__ = nn.Conv2d


def step_modules(step: FunctionalStep) -> list[nn.Module]:
    """The modules a step's functions call (its model, MOON's previous features, ...)."""
    return [value for value in vars(step).values() if isinstance(value, nn.Module)]


@torch.no_grad()
def copy_values(target: Params, values: Params) -> None:
    """``values`` into ``target``'s tensors of the same group and name, in place (a member's trained values
    into its live parameters; a captured step's replays read and write the same tensors)."""
    for group, named in values.items():
        for name, value in named.items():
            target[group][name].copy_(value)


def module_dtype(precision: str) -> torch.dtype | None:
    """The dtype the members' modules run in: bf16 by casting (``modules_in``), as autocast, which the per-client
    path uses, does not reach convolutions under vmap."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")
    return torch.bfloat16 if precision == "bf16" else None


@torch.no_grad()
def copy_inputs(buffers: Inputs, inputs: Inputs) -> None:
    """A step's inputs into the captured step's input buffers, which they must match in shape and dtype
    (``copy_`` would broadcast a smaller tensor without a word)."""
    for key, buffer in buffers.items():
        value = inputs[key]
        if value is buffer:  # stacked once, fixed for the round (``DrawStacker``)
            continue
        if value.shape != buffer.shape or value.dtype != buffer.dtype:
            raise RuntimeError(
                f"cohort-step=graph: step input '{key}' changed from {tuple(buffer.shape)} "
                f"{buffer.dtype} to {tuple(value.shape)} {value.dtype} between steps; a captured "
                "step needs fixed shapes: use cohort-step=vmap"
            )
        buffer.copy_(value)


def cuda_graph(run: Callable[[], dict]) -> tuple[dict, Callable[[], dict]]:
    """``run()`` once on a side stream (its warm-up, which is also a real step), then captured as a CUDA
    graph: (the first run's result, a function that replays the graph and returns its output tensors)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        first = run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            output = run()
    except Exception as error:
        raise RuntimeError(
            f"cohort-step=graph: the step could not be captured as a CUDA graph ({error}); use cohort-step=vmap"
        ) from error

    def replay() -> dict:
        graph.replay()
        return output

    return first, replay


def module_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of a module's parameters and buffers, by name (what ``functional_call`` takes)."""
    return {k: v.detach().clone() for k, v in [*module.named_parameters(), *module.named_buffers()]}


@torch.no_grad()
def load_module_state(module: nn.Module, state: dict[str, torch.Tensor]) -> None:
    for name, live in [*module.named_parameters(), *module.named_buffers()]:
        live.copy_(state[name])


EVAL_IMAGES = 8192  # images in one vmapped evaluation forward (10 members x 512 test images fit in one)


def evaluation_groups(lengths: list[int], batch_size: int = 512, max_images: int = EVAL_IMAGES) -> list[list[int]]:
    """The members (by index) in the groups ``evaluate_members`` takes at once: ordered by test-set length,
    so that little is padded, and each group's forward holding at most ``max_images`` images (its members x
    its chunk, up to ``batch_size`` each), so that a cohort of 1000 clients does not run every member's test
    set through one forward (the paper's CNN holds about 0.2 MB a layer an image)."""
    groups: list[list[int]] = []
    group: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        chunk = min(batch_size, max(lengths[i], 1))  # the longest so far: the group's chunk
        if group and (len(group) + 1) * chunk > max_images:
            groups.append(group)
            group = []
        group.append(i)
    return groups + [group] if group else groups


@torch.no_grad()
def evaluate_members(
    module: nn.Module,
    states: list[dict[str, torch.Tensor]],
    xs: list[torch.Tensor],
    ys: list[torch.Tensor],
    batch_size: int = 512,
    conv: str = "grouped",
) -> list[tuple[float, float]]:
    """(mean cross-entropy, accuracy) of ``module`` with each member's state on that member's test set,
    every member at once: the test sets are padded to the longest and the padding is masked out; ``conv`` as
    in ``run_members``."""
    module.eval()
    count = max(len(y) for y in ys)
    x = torch.stack([F.pad(x, (0, 0) * (x.dim() - 1) + (0, count - len(x))) for x in xs])
    y = torch.stack([F.pad(y, (0, count - len(y))) for y in ys])
    real = torch.arange(count, device=y.device)[None, :] < torch.tensor([len(t) for t in ys], device=y.device)[:, None]
    forward = torch.func.vmap(lambda state, inputs: torch.func.functional_call(module, state, (inputs,)))
    state = stacked(states)
    loss = torch.zeros(len(ys), device=y.device)
    correct = torch.zeros(len(ys), device=y.device, dtype=torch.long)
    with convolutions_as(conv, [module]):
        for start in range(0, count, batch_size):
            logits = forward(state, x[:, start : start + batch_size])
            target, mask = y[:, start : start + batch_size], real[:, start : start + batch_size]
            each = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view(target.shape)
            loss += (each * mask).sum(dim=1)
            correct += ((logits.argmax(dim=2) == target) & mask).sum(dim=1)
    return [(float(s) / max(len(t), 1), float(c) / max(len(t), 1)) for s, c, t in zip(loss, correct, ys)]
