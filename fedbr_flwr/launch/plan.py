"""The run plan: what a simulated run will be on this machine, decided before Flower starts. Its config from
experiment files and ``key=value`` overrides (``build_config``) or from a stopped run's checkpoint
(``resume_config``); its resources sized for the runtime it will use, this machine or a joined Ray cluster
(``size_for_runtime``: cohorts, each client's cores and GPU share, the ``backend``); and its run folder checked
and its partition built (``prepare``). ``plan_run`` and ``plan_resumed`` make the frozen ``RunPlan`` that
everything after reads. fedbr-run, fedbr-sweep, fedbr-deploy and the benchmarks plan their runs here."""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from ..core.config import (
    CHANGEABLE_ON_RESUME,
    ConfigError,
    defaults,
    load_yaml,
    normalise_key,
    parse_override,
    validate,
)
from ..runfiles.progress import SUMMARY_EVENT, last_event_kind
from ..runfiles.run_io import check_no_run, check_output_dir, check_path, check_records_continue, git_commit
from ..runfiles.runlock import check_free
from ..runfiles.tracking import check_available
from .launcher import PROJECT_DIR
from .protocol import RunPlan

DEFAULT_SIMULATED_CLIENTS = 10
MAX_CLIENTS_PER_GPU = 4


def build_config(items: Sequence[str]) -> dict[str, Any]:
    """Defaults <- each YAML file <- each key=value, in the order given."""
    return config_from_settings(settings_from(items))


def settings_from(items: Sequence[str]) -> dict[str, Any]:
    """The settings that experiment files and ``key=value`` overrides give, later ones winning."""
    overrides: dict[str, Any] = {}
    for item in items:
        if is_override(item):
            key, value = parse_override(item)
            given = {key: value}
        else:
            given = load_yaml(item)
            if "sweep" in given:
                raise ConfigError(
                    f"{item} describes several runs (it has a 'sweep' block): run it with `fedbr-sweep {item}`"
                )
        spelled = {normalise_key(k) for k in given}  # num_rounds=3 then num-rounds=4: the later one wins
        overrides = {k: v for k, v in overrides.items() if normalise_key(k) not in spelled} | given
    return overrides


def is_override(item: str) -> bool:
    """Whether a command-line item is ``key=value`` (``data-dir=/d/x.yaml`` too), not an experiment file
    (``runs/lr=0.1.yaml``, or such a file here)."""
    if "=" not in item:
        return False
    key = item.split("=", 1)[0]
    return not item.endswith((".yaml", ".yml")) or ("/" not in key and not Path(item).is_file())


def config_from_settings(settings: dict[str, Any]) -> dict[str, Any]:
    cfg = validate(settings)
    if cfg["num-clients"] == 0:  # the count a simulation starts: what depends on it (attackers, Krum) is checked now
        cfg = validate({**settings, "num-clients": DEFAULT_SIMULATED_CLIENTS})
    check_available(cfg)
    return cfg


def resume_config(out_dir: Path, items: Sequence[str], command: str = "fedbr-run") -> dict[str, Any]:
    """The config of the run in ``out_dir`` (from its checkpoint), with ``resume`` on and the overrides
    a resumed run may take (num-rounds, checkpoint-every, ...); anything else stops with a message.
    A run stopped after the checkpoint of its last round but before its end was written (its summary, plot and
    last event) is continued too, with its end left to do (``run_io.only_end_left``, ``run_io.finish_run``)."""
    from ..app.server_app import check_resumable
    from ..runfiles.checkpoint import load_checkpoint

    out_dir = check_path(out_dir, "--resume").resolve()
    check_free(out_dir)  # a live run (or one left running) is writing there
    _, header = load_checkpoint(out_dir)
    check_output_dir(out_dir)
    overrides: dict[str, Any] = {}
    for item in items:
        if not is_override(item):
            raise ConfigError(
                f"--resume takes the config from {out_dir}'s checkpoint; give only key=value overrides "
                f"of {CHANGEABLE_ON_RESUME}"
            )
        key, value = parse_override(item)
        overrides[key] = value
        if normalise_key(key) == "output-dir" and Path(str(value)).expanduser().resolve() != out_dir:
            raise ConfigError(
                f"--resume continues the run in its own folder, {out_dir}; output-dir cannot move it (copy the "
                "folder and resume the copy)"
            )
    saved, rounds_done = header["config"], int(header["round"])
    here = {"ray-address": "", "backend": "auto"}  # where it runs now: the resume command's choice
    cfg = validate({**saved, **here, **overrides, "resume": True, "output-dir": str(out_dir)})
    ran_to_its_end = rounds_done == cfg["num-rounds"] == saved.get("num-rounds")  # not a run cut short by hand
    end_left = ran_to_its_end and last_event_kind(out_dir) != SUMMARY_EVENT
    check_resumable(saved, cfg, rounds_done - 1 if end_left else rounds_done)  # an end left is still to do
    check_records_continue(out_dir, rounds_done, saved)
    check_available(cfg)
    cfg["git-commit"] = git_commit(PROJECT_DIR) or "unknown"
    if end_left:
        print(f"{command}: {out_dir} stopped after its last round, before its summary: writing it", flush=True)
    else:
        print(f"{command}: resuming {out_dir} after round {rounds_done} of {cfg['num-rounds']}", flush=True)
    return cfg


def size_resources(
    cfg: dict[str, Any],
    cuda_available: bool,
    cpu_count: int,
    gpu_count: int | None = None,
    node_cpus: int | None = None,
) -> dict[str, Any]:
    """Resources for Ray: CPU cores per client, and a GPU share when CUDA is present. With
    ``engine=cohort``: the cohorts (unless ``cohorts`` says: one per GPU; on a CPU, one per
    ``client-cpus`` cores, so that they train side by side with each client's thread count as under
    engine=clients), each with its share of the cores and the GPUs. On a joined cluster the counts are
    the cluster's, and no client asks for more cores than its largest node has (``node_cpus``)."""
    cfg = dict(cfg)
    node_cpus = node_cpus or cpu_count
    if cfg["client-cpus"] > node_cpus:
        where = "this machine has" if node_cpus == cpu_count else "the cluster's largest node has"
        raise ConfigError(f"client-cpus = {cfg['client-cpus']} but {where} {node_cpus} cores")
    if cfg["client-gpus"] > 0 and not cuda_available:
        raise ConfigError("client-gpus > 0 but torch sees no CUDA device (Ray would find no actor to place)")
    if cfg["device"] == "cuda" and not cuda_available:
        raise ConfigError("device = cuda but torch sees no CUDA device")
    if cfg["cohort-step"] == "graph" and not cuda_available:
        raise ConfigError("cohort-step=graph replays CUDA graphs but torch sees no CUDA device: use vmap or loop")
    gpus = (gpu_count if gpu_count is not None else 1) if cuda_available and cfg["device"] != "cpu" else 0
    if cfg["engine"] == "cohort":
        cfg["cohorts"] = min(cfg["cohorts"] or gpus or max(1, cpu_count // cfg["client-cpus"]), cfg["num-clients"])
        cfg["client-cpus"] = min(max(cfg["client-cpus"], cpu_count // cfg["cohorts"]), node_cpus)
        if gpus and cfg["client-gpus"] == 0:
            cfg["client-gpus"] = min(1.0, gpus / cfg["cohorts"])
    elif gpus and cfg["client-gpus"] == 0:
        cfg["client-gpus"] = 1.0 / min(cfg["num-clients"], MAX_CLIENTS_PER_GPU)
    return cfg


def check_local_resources(cfg: dict[str, Any]) -> None:
    """``size_resources``' refusals (a CUDA device or a GPU share without CUDA, more cores than this machine has),
    for a run that will not join a Ray cluster (one that does is checked against the cluster when it starts)."""
    import torch

    from ..app.raycluster import requested_address

    if requested_address(cfg["ray-address"]) is None:
        size_resources(cfg, torch.cuda.is_available(), os.cpu_count() or 1)


def size_for_runtime(cfg: dict[str, Any], superlink: bool = False) -> dict[str, Any]:
    """``size_resources`` for the runtime the run will use: this machine's cores and GPUs, or those of the
    running Ray cluster it joins (``ray-address``, else ``RAY_ADDRESS``), whose resolved address it records; and
    its ``backend`` (``choose_backend``; ``superlink``: fedbr-run --superlink)."""
    import torch

    from ..app.raycluster import describe, requested_address

    address = requested_address(cfg["ray-address"])
    if address is None:
        return choose_backend(size_resources(cfg, torch.cuda.is_available(), os.cpu_count() or 1), superlink)
    cluster = describe(address)
    print(
        f"fedbr-run: joining the Ray cluster at {cluster.address}: {cluster.nodes} node(s), {cluster.cpus} "
        f"CPU(s), {cluster.gpus} GPU(s)",
        flush=True,
    )
    joined = {**cfg, "ray-address": cluster.address}
    sized = size_resources(joined, cluster.gpus > 0, cluster.cpus, cluster.gpus, cluster.largest_node_cpus)
    return choose_backend(sized, superlink, cluster=True)


def choose_backend(cfg: dict[str, Any], superlink: bool = False, cluster: bool = False) -> dict[str, Any]:
    """``backend`` for a sized run: ``auto`` is in-process (the clients in threads of the simulation process)
    where it can be, else ray; in-process where it cannot be is a ConfigError."""
    why_ray = ray_needed_because(cfg, superlink, cluster)
    if cfg["backend"] == "in-process" and why_ray:
        raise ConfigError(
            f"backend = in-process runs the clients in threads of one process on this machine's CPUs, but {why_ray}: "
            "use backend = ray (or auto)"
        )
    return {**cfg, "backend": "ray" if why_ray else "in-process"} if cfg["backend"] == "auto" else cfg


def ray_needed_because(cfg: dict[str, Any], superlink: bool, cluster: bool) -> str:
    """Why the run's clients must run on Ray; empty where they may run in the simulation process."""
    if superlink:
        return "--superlink runs Flower's own simulation process, which runs the clients on Ray"
    if cluster:
        return "the run joins a Ray cluster"
    if cfg["client-gpus"] > 0:
        return "the clients use a GPU (client-gpus > 0), which Ray shares out"
    return ""


def plan_run(cfg: dict[str, Any], overwrite: bool, superlink: bool = False) -> RunPlan:
    """The plan of a new run of ``cfg`` (validated): sized for its runtime, its folder and partition checked."""
    return RunPlan.of(prepare(size_for_runtime(cfg, superlink=superlink), overwrite))


def plan_resumed(out_dir: Path, items: Sequence[str], superlink: bool = False) -> RunPlan:
    """The plan that continues the run in ``out_dir`` from its checkpoint (``resume_config``)."""
    return RunPlan.of(size_for_runtime(resume_config(out_dir, items), superlink=superlink))


def prepare(cfg: dict[str, Any], overwrite: bool, files_here: bool = True) -> dict[str, Any]:
    """``cfg`` with its folder, commit and paths filled in, checked before Flower starts. ``files_here=False``:
    the run's folder and data are on another machine (a remote SuperLink's), whose ServerApp checks them."""
    if not cfg["output-dir"]:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg["output-dir"] = str(Path.cwd() / "runs" / f"{cfg['strategy']}-{cfg['dataset']}-{stamp}")
    out = check_path(Path(cfg["output-dir"])).resolve()
    cfg["overwrite"] = overwrite = overwrite or cfg["overwrite"]
    if files_here:
        check_run_folder(cfg, out, overwrite)
    cfg["output-dir"] = str(out)
    if cfg["data-dir"]:  # Flower runs the app from a copy elsewhere: hand it absolute paths only
        cfg["data-dir"] = str(check_path(Path(cfg["data-dir"]), "data-dir").resolve())
    cfg["git-commit"] = cfg["git-commit"] or git_commit(PROJECT_DIR) or "unknown"
    check_pyproject()
    check_available(cfg)
    check_code(cfg)
    if files_here:
        check_data(cfg)
        check_output_dir(out)  # a file in its place, no permission: a message now, not a traceback from Flower
    return cfg


def check_code(cfg: dict[str, Any]) -> None:
    """What a run's first client and first evaluation would find wrong in the code a user added: a backbone
    with BatchNorm (built on the meta device: no memory, no weights drawn) and a client metric named as a
    metrics.jsonl field."""
    import torch

    from ..core.config import resolved_model
    from ..core.model import build_model
    from ..data.catalog import INFO
    from ..server.recording import check_client_metric_names

    info = INFO[cfg["dataset"]]
    with torch.device("meta"):
        build_model(resolved_model(cfg), info.num_classes, info.in_channels, info.image_size)
    check_client_metric_names()


def check_run_folder(cfg: dict[str, Any], out: Path, overwrite: bool) -> None:
    check_free(out)  # also with --overwrite: a live run (or one left running) is writing there
    if cfg["resume"]:
        check_resume_key(out)
    if not overwrite:
        check_no_run(out)


def check_data(cfg: dict[str, Any]) -> None:
    """The run's dataset, split and proxy dataset, read as its start reads them: a ConfigError now, before
    Flower starts, on a missing dataset or an impossible split."""
    from ..data.dataset import make_partition

    if cfg["num-clients"]:  # 0 (a deployment: one client per SuperNode) is checked when the nodes are known
        make_partition(cfg)
    check_proxy_dataset(cfg)


def check_resume_key(out: Path) -> None:
    """``resume = true`` in a fresh run's settings: a ConfigError now (the run would fail inside Flower),
    saying whether there is a checkpoint and how to continue from it."""
    from ..runfiles.checkpoint import checkpoint_header

    checkpoint_header(out)  # none: "no checkpoint to resume from"
    raise ConfigError(
        f"resume = true is set by `fedbr-run --resume`; to continue the run in {out}, use "
        f"`fedbr-run --resume {out}` (it takes the config from the checkpoint)"
    )


def check_proxy_dataset(cfg: dict[str, Any]) -> None:
    """Mixture pseudo-data reads a public proxy dataset on the server: a missing one stops the command now,
    before Flower starts, with the dataset's own message (read once here; the server reads it again)."""
    from pseudodata import PseudoDataSettings, proxy_dataset

    if PseudoDataSettings.from_config(cfg).pseudo_data != "mixture":
        return

    from ..data.catalog import load_raw

    load_raw(proxy_dataset(cfg), cfg["data-dir"], cfg["download"])


def check_pyproject(path: Path = PROJECT_DIR / "pyproject.toml") -> None:
    """Flower accepts only the run-config keys pyproject.toml declares: after a key was added (a new
    algorithm), say how to declare it instead of letting Flower refuse the run."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    if not path.is_file():
        return
    table = tomllib.loads(path.read_text()).get("tool", {}).get("flwr", {}).get("app", {}).get("config", {})
    if table != defaults():
        raise ConfigError(
            f"{path}'s run-config table differs from the config schema (a key was added or "
            "changed): run `fedbr-run --write-pyproject`, then run again"
        )
