"""Flower ServerApp: builds the configured strategy, its recorder and the seeded initial model; with
``resume`` it continues the run in output-dir from its checkpoint."""

from __future__ import annotations

from typing import Any

import torch
from flwr.common import Context
from flwr.server import Grid, ServerApp, ServerAppComponents, ServerConfig
from flwr.server.compat import start_grid

from strategies.base import strategy_class

from ..core.algorithm import client_class
from ..core.config import CHANGEABLE_ON_RESUME, as_it_ran, changed_on_resume, common, from_run_config
from ..core.errors import ConfigError
from ..core.training import use_device
from ..data.dataset import load_server_tests
from ..runfiles import runlock
from ..runfiles.checkpoint import load_checkpoint
from ..runfiles.run_io import RunRecorder, check_no_run, check_records_continue, resolve_output_dir
from .checkpointing import ResumedRun
from .flower_adapter import chooses_backend_per_run, receive_replies_promptly


def check_resumable(saved: dict[str, Any], cfg: dict[str, Any], rounds_done: int) -> None:
    run, changed = common(cfg), changed_on_resume(saved, cfg)
    saved = as_it_ran(saved)
    if changed:
        diffs = ", ".join(f"{k} = {saved[k]!r} in the checkpoint, {cfg[k]!r} now" for k in changed)
        raise ConfigError(f"cannot resume with a different config ({diffs}); only {CHANGEABLE_ON_RESUME} may change")
    if run.num_rounds <= rounds_done:
        raise ConfigError(
            f"the checkpoint is at round {rounds_done} and num-rounds = {run.num_rounds}: nothing "
            "to resume (raise num-rounds to train further)"
        )


def build_strategy(cfg: dict):
    out_dir = resolve_output_dir(cfg)
    cfg = {**cfg, "output-dir": str(out_dir)}
    checkpoint, done, elapsed = None, None, 0.0  # done: None for a new run
    run = common(cfg)
    if not run.resume and not run.overwrite:  # a run submitted from another machine was checked there only
        check_no_run(out_dir)
    if run.resume:
        checkpoint = load_checkpoint(out_dir)
        done = int(checkpoint[1]["round"])
        check_resumable(checkpoint[1]["config"], cfg, done)
        check_records_continue(out_dir, done, checkpoint[1]["config"])  # plain `flwr run` with resume=true too
        elapsed = float(checkpoint[1]["elapsed"])
    torch.manual_seed(run.seed)  # the initial model: what every client is sent in round 1
    device = use_device(cfg)
    modules = {name: m.to(device) for name, m in client_class(run.strategy).build_modules(cfg).items()}
    server_tests = load_server_tests(cfg)
    recorder = RunRecorder(cfg, out_dir, resume_round=done, elapsed=elapsed)
    strategy = strategy_class(run.strategy)(cfg, recorder, modules, server_tests)
    if checkpoint is not None:
        strategy.resume_from(*checkpoint)
    return strategy


def check_backend(cfg: dict) -> None:
    """``backend = in-process`` asks for fedbr-run's simulation process, which runs the clients in its own
    threads (``fedbr_flwr.app.flower_adapter.choose_backend_per_run``); Flower's own (under ``flwr run``) would
    run them on Ray, and a deployment's clients are its SuperNodes: say so instead of ignoring the key."""
    if common(cfg).backend == "in-process" and not chooses_backend_per_run():
        raise ConfigError(
            "backend = in-process runs the clients in fedbr-run's own simulation process; this run is Flower's "
            "(flwr run) or a deployment: use backend = auto or ray"
        )


def server_fn(context: Context) -> ServerAppComponents:
    cfg = from_run_config(context.run_config)
    check_backend(cfg)
    strategy = build_strategy(cfg)
    done = strategy.resumed_round
    run = common(cfg)
    return ServerAppComponents(
        strategy=ResumedRun(strategy, done) if done else strategy,
        config=ServerConfig(num_rounds=run.num_rounds - done, round_timeout=run.round_timeout or None),
    )


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """``server_fn``'s strategy in Flower's compatibility loop, on a grid that, in simulation, takes each reply
    as soon as it is stored (a deployment's grid is left as it is)."""
    receive_replies_promptly(grid)
    # the writer's lock on the run folder, for the whole run: no second run writes there meanwhile
    with runlock.hold(resolve_output_dir(from_run_config(context.run_config)), role="writer"):
        components = server_fn(context)
        try:
            start_grid(grid=grid, config=components.config, strategy=components.strategy)
        except Exception as exc:  # an unexpected error: leave a resumable run, then fail as before
            strategy: Any = getattr(components.strategy, "strategy", components.strategy)  # inside ResumedRun
            strategy.checkpointer.save_after_error(exc)
            raise
