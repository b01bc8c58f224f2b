"""Many clients' local steps at once on one device: every member's ``FunctionalStep`` functions, batched
over a leading client dimension with ``torch.func.vmap`` (a cohort's ``cohort-step=vmap``). Flower-free.

Each step of the K local steps:
1. each member draws its own inputs (``draw``: its batch, its random draws, from its own seeded
   streams, exactly as on its own), and they are stacked beside its round's ``constants``;
2. for each phase, the gradients of every member come from one vmapped ``torch.func.grad`` of the phase's
   loss; each member's components adjust its own slice; one SGD (torch's, over the stacked parameters)
   steps all members: SGD is elementwise, so this is each member's own SGD.
The math is the members' own functions; only the orchestration is batched. The shared intermediates
(``prepare``) are recomputed inside each phase rather than kept between phases (autograd graphs cannot
cross vmap calls): FedBR's max step pays one more feature forward than on the per-client path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .algorithm import FunctionalStep, Inputs, Params, Phase
from .training import autocast


@dataclass
class Member:
    """One client of a vectorised cohort: its step for this round, its batch stream, and its groups' values
    when the round started (copied at once: members share the live modules, which the next member's
    ``start_fit`` overwrites)."""
    step: FunctionalStep
    sample: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    start: Params


def snapshot(step: FunctionalStep) -> Params:
    return {g: {n: p.detach().clone() for n, p in ps.items()} for g, ps in step.groups.items()}


def stacked(values: list[dict]) -> dict:
    """A list of equally shaped nested dicts of tensors -> one nested dict of tensors with a leading dimension."""
    first = values[0]
    if isinstance(first, dict):
        return {k: stacked([v[k] for v in values]) for k in first}
    return torch.stack(values)


def sgd_like(optimizer: torch.optim.Optimizer, tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
    """An optimiser of ``optimizer``'s class and hyperparameters over ``tensors``, its state empty."""
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    return type(optimizer)(tensors, **hyper)


def phase_gradients(template: FunctionalStep, phase: Phase, params: Params, inputs: Inputs
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


def run_members(members: list[Member], steps: int, precision: str = "fp32"
                ) -> tuple[list[Params], list[dict[str, float]]]:
    """K local steps of every member at once: each member's trained groups (views into the stacked
    tensors) and its diagnostics averaged over the steps, as ``run_local_steps`` gives one client."""
    template = members[0].step
    template.model.train()
    params = stacked([m.start for m in members])
    optimizers = {g: sgd_like(template.optimizers[g], list(params[g].values())) for g in params}
    totals: dict[str, torch.Tensor] = {}
    device = next(iter(params["model"].values())).device
    constants = stacked([m.step.constants() for m in members])  # stacked once a round
    with autocast(device, precision):
        for _ in range(steps):
            inputs = {**stacked([m.step.draw(*m.sample()) for m in members]), **constants}
            for phase in template.phases:
                grads, stats = phase_gradients(template, phase, params, inputs)
                if phase.adjust:
                    for i, member in enumerate(members):
                        member.step.adjust_gradients([g[i] for g in grads["model"].values()])
                for group in phase.groups:
                    for name, tensor in params[group].items():
                        tensor.grad = grads[group][name]
                    optimizers[group].step()
                for k, v in stats.items():
                    v = v.detach().float()
                    totals[k] = totals[k] + v if k in totals else v.clone()
    per_member = {k: [x / steps for x in v.tolist()] for k, v in totals.items()}
    finals = [{g: {n: t[i] for n, t in ps.items()} for g, ps in params.items()} for i in range(len(members))]
    return finals, [{k: v[i] for k, v in per_member.items()} for i in range(len(members))]


@torch.no_grad()
def load_groups(step: FunctionalStep, values: Params) -> None:
    """Copy one member's trained values into the live parameters its step trains."""
    for group, named in step.groups.items():
        for name, live in named.items():
            live.copy_(values[group][name])
