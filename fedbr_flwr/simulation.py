"""``python -m fedbr_flwr.simulation RUN_CONFIG RUN_ID NUM_SUPERNODES CPUS GPUS``: the app's Flower simulation
in one process. It is what ``flwr run`` starts under a SuperLink (``flwr-simulation``): Flower's own simulation
entry point with the same ServerApp, ClientApp, run config and Ray backend, but without the SuperLink, the app
bundle and the processes between them, which cost seconds per run (docs/benchmarks.md).

Flower's public ``run_simulation`` cannot take a run config; its private ``_run_simulation``, which
``flwr-simulation`` itself calls, can. flwr is pinned (pyproject.toml) and the end-to-end tests run this path.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

SERVER_APP = "fedbr_flwr.server_app:app"
CLIENT_APP = "fedbr_flwr.client_app:app"
STARTED = "fedbr simulation: run {} started"  # the process is up (fedbr-bench --startup times it by this line)


def ray_init_args(environ: dict[str, str] | os._Environ = os.environ) -> dict[str, Any]:
    """``ray.init`` arguments: those Flower's Ray backend would use (its defaults, the interpreter's module
    path for the workers), at the address the launcher set (``fedbr_flwr.raycluster``)."""
    return {
        "address": environ.get("RAY_ADDRESS") or "local",
        "include_dashboard": False,
        "logging_level": logging.WARNING,
        "log_to_driver": True,
        "runtime_env": {"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}},
    }


def start_ray() -> None:
    """Start (or join) Ray while another thread imports the ServerApp: on two cores this overlaps the
    seconds Ray's own processes take to come up with the driver's imports. Flower's backend then finds Ray
    initialised and uses it (ray.init wants the main thread)."""
    import ray

    loader = threading.Thread(target=import_server_side)
    loader.start()
    if not ray.is_initialized():
        ray.init(**ray_init_args())
    loader.join()


def import_server_side() -> None:
    import flwr.simulation.run_simulation  # noqa: F401

    from . import server_app  # noqa: F401


def run_config_from(path: Path) -> dict[str, Any]:
    """The overrides of a ``--run-config`` file, read as ``flwr run`` reads them."""
    from flwr.common.config import parse_config_args

    return parse_config_args([str(path)])


def simulate(run_config: dict[str, Any], run_id: int, supernodes: int, cpus: float, gpus: float) -> None:
    """Run the app once through Flower's simulation entry point, as ``flwr-simulation`` does."""
    start_ray()
    from flwr.app import Context, RecordDict
    from flwr.common.config import get_fused_config_from_dir
    from flwr.simulation.run_simulation import _run_simulation
    from flwr.supercore.constant import NOOP_FEDERATION_ID
    from flwr.supercore.run import Run
    from flwr.supercore.telemetry import EventType

    from .launcher import PROJECT_DIR

    run = Run.create_empty(run_id=run_id)
    run.override_config = run_config
    run.primary_task_id = run_id
    run.federation_id = NOOP_FEDERATION_ID
    fused = get_fused_config_from_dir(PROJECT_DIR, run.override_config)
    context = Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(), run_config=fused)
    _run_simulation(
        num_supernodes=supernodes,
        exit_event=EventType.FLWR_SIMULATION_RUN_LEAVE,
        server_app_attr=SERVER_APP,
        client_app_attr=CLIENT_APP,
        backend_name="ray",
        backend_config={"client_resources": {"num_cpus": cpus, "num_gpus": gpus}, "init_args": {}},
        app_dir=str(PROJECT_DIR),
        run=run,
        server_app_context=context,
        is_app=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 5:
        print(f"usage: {(__doc__ or '').split(':', 1)[0].strip('`')}", file=sys.stderr)
        return 2
    path, run_id, supernodes, cpus, gpus = args
    print(STARTED.format(run_id), flush=True)
    simulate(run_config_from(Path(path)), int(run_id), int(supernodes), float(cpus), float(gpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())
