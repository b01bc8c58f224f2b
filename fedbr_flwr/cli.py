"""``fedbr-run``: validate an experiment, run it as a Flower simulation, report the result.

    fedbr-run                                   # the quick main job (defaults)
    fedbr-run experiments/fedavg_rotmnist5k.yaml seed=1 num-rounds=50
    fedbr-run --list                            # every key, its default and meaning
    fedbr-run --resume runs/fedbr-mnist5k-...   # continue a stopped run from its checkpoint
    fedbr-run --resume runs/fedbr-mnist5k-... num-rounds=200   # or train it further
    fedbr-run experiments/fedavg_rotmnist.yaml --time-limit 14m   # stop in time, to be continued

Later files and ``key=value`` overrides win over earlier ones. Exit codes: 0 completed, 1 the run
failed (also when it ran to its end but no round trained: every update failed or was rejected), 2 bad
configuration or input (also a damaged checkpoint or an output-dir that cannot be written), 75 the
--time-limit stopped it (after a round's checkpoint; one line says how to continue), 130 Ctrl-C, 143 SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from .checkpoint import checkpoint_round
from .config import ConfigError, check_sampling, defaults, load_yaml, parse_override, pyproject_table, schema, validate
from .launch.launcher import PROJECT_DIR, RunFailed, RunHost, run_flower
from .launch.raycluster import Cluster, requested_address
from .launch.runlock import check_free
from .launch.timelimit import EXIT_TIME_LIMIT, RoundWatch, TimeLimitReached, parse_duration, stop_deadline, stopped_line
from .run_io import check_output_dir, check_path_length, git_commit
from .tracking import check_available

PYPROJECT_MARK = "# Generated from the schema by `fedbr-run --write-pyproject` (a test keeps it equal):\n"
DEFAULT_SIMULATED_CLIENTS = 10
MAX_CLIENTS_PER_GPU = 4


def build_config(items: Sequence[str]) -> dict[str, Any]:
    """Defaults <- each YAML file <- each key=value, in the order given."""
    return config_from_settings(settings_from(items))


def settings_from(items: Sequence[str]) -> dict[str, Any]:
    """The settings that experiment files and ``key=value`` overrides give, later ones winning."""
    overrides: dict[str, Any] = {}
    for item in items:
        if "=" in item and not item.endswith((".yaml", ".yml")):
            key, value = parse_override(item)
            overrides[key] = value
        else:
            data = load_yaml(item)
            if "sweep" in data:
                raise ConfigError(
                    f"{item} describes several runs (it has a 'sweep' block): run it with `fedbr-sweep {item}`"
                )
            overrides.update(data)
    return overrides


def config_from_settings(settings: dict[str, Any]) -> dict[str, Any]:
    cfg = validate(settings)
    check_available(cfg)
    if cfg["num-clients"] == 0:
        cfg["num-clients"] = DEFAULT_SIMULATED_CLIENTS
        check_sampling(cfg)
    return cfg


def resume_config(out_dir: Path, items: Sequence[str]) -> dict[str, Any]:
    """The config of the run in ``out_dir`` (from its checkpoint), with ``resume`` on and the overrides
    a resumed run may take (num-rounds, checkpoint-every, ...); anything else stops with a message."""
    from .checkpoint import load_checkpoint
    from .server_app import RESUMABLE_KEYS, check_resumable

    check_path_length(out_dir, "--resume")
    out_dir = out_dir.expanduser().resolve()
    check_free(out_dir)  # a live run (or one left running) is writing there
    _, header = load_checkpoint(out_dir)
    check_output_dir(out_dir)
    overrides: dict[str, Any] = {}
    for item in items:
        if "=" not in item or item.endswith((".yaml", ".yml")):
            raise ConfigError(
                f"--resume takes the config from {out_dir}'s checkpoint; give only key=value overrides "
                f"of {', '.join(k for k in RESUMABLE_KEYS if k not in ('resume', 'git-commit'))}"
            )
        key, value = parse_override(item)
        overrides[key] = value
    saved = header["config"]
    here = {"ray-address": "", "backend": "auto"}  # where it runs now: the resume command's choice
    cfg = validate({**saved, **here, **overrides, "resume": True, "output-dir": str(out_dir)})
    check_resumable(saved, cfg, int(header["round"]))
    check_available(cfg)
    cfg["git-commit"] = git_commit(PROJECT_DIR) or "unknown"
    print(f"fedbr-run: resuming {out_dir} after round {header['round']} of {cfg['num-rounds']}", flush=True)
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


def size_for_runtime(cfg: dict[str, Any], cluster: Cluster | None = None, superlink: bool = False) -> dict[str, Any]:
    """``size_resources`` for the runtime the run will use: this machine's cores and GPUs, or those of the
    running Ray cluster it joins (``ray-address``, else ``RAY_ADDRESS``; ``cluster``: already described), whose
    resolved address it records; and its ``backend`` (``choose_backend``; ``superlink``: fedbr-run --superlink)."""
    import torch

    from .launch.raycluster import describe, requested_address

    address = requested_address(cfg["ray-address"])
    if address is None:
        return choose_backend(size_resources(cfg, torch.cuda.is_available(), os.cpu_count() or 1), superlink)
    if cluster is None:
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


def supernodes(cfg: dict[str, Any]) -> int:
    """The simulated SuperNodes: one per client, or one per cohort (engine=cohort)."""
    return cfg["cohorts"] if cfg["engine"] == "cohort" else cfg["num-clients"]


def prepare(cfg: dict[str, Any], overwrite: bool) -> dict[str, Any]:
    from .dataset import make_partition

    if not cfg["output-dir"]:
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        cfg["output-dir"] = str(Path.cwd() / "runs" / f"{cfg['strategy']}-{cfg['dataset']}-{stamp}")
    check_path_length(Path(cfg["output-dir"]))
    out = Path(cfg["output-dir"]).expanduser().resolve()
    check_free(out)  # also with --overwrite: a live run (or one left running) is writing there
    if cfg["resume"]:
        check_resume_key(out)
    if not overwrite:
        check_no_run(out)
    cfg["output-dir"] = str(out)
    if cfg["data-dir"]:  # Flower runs the app from a copy elsewhere: hand it absolute paths only
        cfg["data-dir"] = str(Path(cfg["data-dir"]).expanduser().resolve())
    cfg["git-commit"] = cfg["git-commit"] or git_commit(PROJECT_DIR) or "unknown"
    check_pyproject()
    if cfg["num-clients"]:  # 0 (a deployment: one client per SuperNode) is checked when the nodes are known
        make_partition(cfg)  # fails here, before Flower starts, on a missing dataset or an impossible split
    check_proxy_dataset(cfg)
    check_available(cfg)
    check_output_dir(out)  # a file in its place, no permission: a message now, not a traceback from Flower
    return cfg


def check_resume_key(out: Path) -> None:
    """``resume = true`` in a fresh run's settings: a ConfigError now (the run would fail inside Flower),
    saying whether there is a checkpoint and how to continue from it."""
    from .checkpoint import load_checkpoint

    load_checkpoint(out)  # none: "no checkpoint to resume from"
    raise ConfigError(
        f"resume = true is set by `fedbr-run --resume`; to continue the run in {out}, use "
        f"`fedbr-run --resume {out}` (it takes the config from the checkpoint)"
    )


def check_proxy_dataset(cfg: dict[str, Any]) -> None:
    """Mixture pseudo-data reads a public proxy dataset on the server: a missing one stops the command now,
    before Flower starts, with the dataset's own message (read once here; the server reads it again)."""
    if cfg["pseudo-data"] != "mixture":
        return
    from pseudodata import proxy_dataset

    from .catalog import load_raw

    load_raw(proxy_dataset(cfg), cfg["data-dir"], cfg["download"])


def check_no_run(out: Path) -> None:
    """ConfigError when ``out`` holds a run's files; --resume is offered only with a checkpoint to resume."""
    from .checkpoint import CHECKPOINT_NAME

    found = [name for name in ("metrics.jsonl", "rounds.jsonl", CHECKPOINT_NAME) if (out / name).exists()]
    if CHECKPOINT_NAME in found:
        raise ConfigError(
            f"{out} already holds a run; pick another output-dir, pass --overwrite, or continue it "
            f"with `fedbr-run --resume {out}`"
        )
    if any((out / name).stat().st_size for name in found):
        raise ConfigError(
            f"{out} already holds a run (without a checkpoint, so it cannot be resumed); pick "
            "another output-dir or pass --overwrite"
        )
    if found:
        raise ConfigError(
            f"{out} holds the empty files of a run that stopped before its first round (no "
            "checkpoint to resume from); pick another output-dir or pass --overwrite"
        )


def list_keys() -> str:
    """Every strategy and component, then every key by owner: its default, choices and meaning."""
    from .registry import COMPONENTS, VARIANTS, algorithm_names, how_to_enable

    lines = [
        f"strategies: {', '.join(algorithm_names())}",
        *(f"  {name} = {v.base} + {' + '.join(v.components)}: {v.summary}" for name, v in sorted(VARIANTS.items())),
        f"components (strategy=fedbr fedbr-with=a,b): {', '.join(sorted(COMPONENTS))}",
    ]
    owner = object()
    for key, spec in schema().items():
        if spec.owner != owner:
            owner = spec.owner
            lines += [
                "",
                "common keys (default) - meaning:" if owner is None else f"{owner} keys ({how_to_enable(owner)}):",
            ]
        choices = f" [{'|'.join(spec.choices)}]" if spec.choices else ""
        lines.append(f"  {key} ({spec.default!r}){choices} - {spec.help}")
    return "\n".join(lines)


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


def write_pyproject(path: Path = PROJECT_DIR / "pyproject.toml") -> bool:
    """Rewrite pyproject.toml's ``[tool.flwr.app.config]`` table from the schema; True if it changed."""
    text = path.read_text()
    head, sep, _ = text.partition(PYPROJECT_MARK)
    if not sep:
        raise ConfigError(f"{path} lacks the line '{PYPROJECT_MARK.strip()}' above [tool.flwr.app.config]")
    new = head + sep + "[tool.flwr.app.config]\n" + pyproject_table()
    if new != text:
        path.write_text(new)
    return new != text


CONFIGURATION_PAGE = PROJECT_DIR / "docs" / "configuration.md"


def write_configuration_page(path: Path = CONFIGURATION_PAGE) -> bool:
    """Rewrite the configuration reference from the schema; True if it changed."""
    from .config import configuration_reference

    new = configuration_reference()
    changed = not path.is_file() or path.read_text() != new
    if changed:
        path.write_text(new)
    return changed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedbr-run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("items", nargs="*", help="experiment YAML files and key=value overrides")
    parser.add_argument("--list", action="store_true", help="list strategies, components and config keys, then exit")
    parser.add_argument(
        "--write-pyproject",
        action="store_true",
        help="rewrite pyproject.toml's run-config table from the schema (after adding a key), then exit",
    )
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="rewrite docs/configuration.md from the schema (after adding a key), then exit",
    )
    parser.add_argument("--dry-run", action="store_true", help="validate and print the config, then exit")
    parser.add_argument("--overwrite", action="store_true", help="reuse an output-dir that holds a run")
    parser.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its last checkpoint")
    parser.add_argument(
        "--time-limit",
        metavar="DURATION",
        help="stop before DURATION (90s, 15m, 1h30m, 2h) has passed: the run checkpoints after every round and "
        "stops after the last round that fits, with exit code 75 and a line saying how to continue "
        "(fedbr-run --resume DIR --time-limit ...); a round still running at the limit is lost",
    )
    parser.add_argument("--quiet", action="store_true", help="print no progress (the log is in flower.log)")
    parser.add_argument("--verbose", action="store_true", help="echo all of Flower's log, not only progress")
    parser.add_argument(
        "--superlink",
        action="store_true",
        help="run through `flwr run` on a private local SuperLink, as a Flower user would (seconds slower to "
        "start; the default runs Flower's simulation entry point in one process)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    started = time.time()
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)  # options may come between files and overrides
    try:
        args.deadline = None if args.time_limit is None else stop_deadline(started, parse_duration(args.time_limit))
    except ConfigError as exc:
        print(f"fedbr-run: error: {exc}", file=sys.stderr)
        return 2
    if args.list:
        print(list_keys())
        return 0
    if args.write_pyproject or args.write_docs:
        for wanted, write, path in (
            (args.write_pyproject, write_pyproject, PROJECT_DIR / "pyproject.toml"),
            (args.write_docs, write_configuration_page, CONFIGURATION_PAGE),
        ):
            if wanted:
                print(f"fedbr-run: {path} {'rewritten' if write() else 'already up to date'}")
        return 0
    host = early_host(args)
    try:
        return run_command(args, host)
    finally:
        if host is not None:
            host.close()


def early_host(args: argparse.Namespace) -> RunHost | None:
    """The simulation process, started before the configuration is checked: it imports what a run needs (torch,
    Flower's simulation, the ServerApp and the clients; Ray too where a run will likely use it) beside the check,
    which leaves a core idle, and the run goes to it (docs/benchmarks.md). None where the run would not use it:
    ``--superlink``, ``--dry-run``, or a Ray cluster named by RAY_ADDRESS; a run on a cluster named by
    ``ray-address`` does not use it either, and it is stopped when the command ends."""
    if args.superlink or args.dry_run or os.environ.get("RAY_ADDRESS"):
        return None
    return RunHost().start()


def run_command(args: argparse.Namespace, host: RunHost | None) -> int:
    try:
        if args.resume:
            cfg = size_for_runtime(resume_config(Path(args.resume), args.items), superlink=args.superlink)
        else:
            cfg = prepare(size_for_runtime(build_config(args.items), superlink=args.superlink), args.overwrite)
        if args.deadline is not None:
            cfg["checkpoint-every"] = 1  # a stop loses no finished round
    except ConfigError as exc:
        print(f"fedbr-run: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print("\n".join(f"{k} = {v!r}" for k, v in cfg.items()))
        return 0
    out = Path(cfg["output-dir"])
    print(
        f"fedbr-run: {cfg['strategy']} on {cfg['dataset']}, {cfg['num-clients']} clients, "
        f"{cfg['num-rounds']} rounds -> {out}",
        flush=True,
    )
    if host is not None and requested_address(cfg["ray-address"]) != host.address:
        host.close()  # the run joins a cluster: the private runtime started ahead would only hold memory
    # SIGTERM must unwind like Ctrl-C so that the launcher stops the SuperLink and its children.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        echo = "none" if args.quiet else "all" if args.verbose else "progress"
        watch = None
        if args.deadline is not None:
            watch = RoundWatch(args.deadline, cfg["num-rounds"], checkpoint_round(out) if cfg["resume"] else None)
        run_flower(cfg, supernodes(cfg), out, echo=echo, superlink=args.superlink, host=host, watch=watch)
    except TimeLimitReached as exc:
        print(
            stopped_line("fedbr-run", str(out), exc.saved_round, cfg["num-rounds"], again(args, out, exc)),
            file=sys.stderr,
        )
        return EXIT_TIME_LIMIT
    except ConfigError as exc:  # found only at launch: the folder taken by a run that started at the same instant
        print(f"fedbr-run: error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"fedbr-run: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the run folder's disk filled up (or went away) while the run wrote to it
        print(f"fedbr-run: error: the run stopped: cannot write to {out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"fedbr-run: interrupted; {stopped_run(out)}", file=sys.stderr)
        return 130
    except SystemExit as exc:
        if exc.code != 143:
            raise
        print(f"fedbr-run: stopped by SIGTERM; {stopped_run(out)}", file=sys.stderr)
        return 143
    summary_md = out / "summary.md"
    if not summary_md.exists():
        print(
            f"fedbr-run: error: the run ended without a final evaluation (did every client fail?); "
            f"see {out / 'flower.log'}",
            file=sys.stderr,
        )
        return 1
    return print_result(out, "fedbr-run", "(metrics.jsonl, rounds.jsonl, manifest.json, summary.json, convergence.png)")


def again(args: argparse.Namespace, out: Path, stop: TimeLimitReached) -> str:
    """The command that continues a run its time limit stopped: ``--resume`` from its checkpoint, or where it
    has none, the command that started it, into the same folder."""
    superlink = ["--superlink"] if args.superlink else []
    if stop.saved_round is not None:
        command = ["fedbr-run", "--resume", str(out), "--time-limit", args.time_limit, *superlink]
    else:
        command = ["fedbr-run", *args.items, f"output-dir={out}", "--overwrite", "--time-limit", args.time_limit]
        command += superlink
    return shlex.join(command)


def stopped_run(out: Path) -> str:
    return (
        f"Flower processes stopped; partial run files in {out} (continue with `fedbr-run --resume {out}` once a "
        "checkpoint exists)"
    )


def print_result(out: Path, command: str, files: str = "") -> int:
    """Print a finished run's summary.md; the exit code: 1 (with one line saying why) when no round trained."""
    print("\n" + (out / "summary.md").read_text())
    print(f"run files: {out}" + (f" {files}" if files else ""))
    problem = finished_run_problem(out)
    if problem:
        print(f"{command}: error: {problem}", file=sys.stderr)
        return 1
    return 0


def finished_run_problem(out: Path) -> str | None:
    """Why a run that ran to its end gave no result (fedbr-run exits 1), from its summary.json: no round
    changed the global model. None when it is a result (or there is no summary to judge by)."""
    import json

    from .metrics import run_problem

    try:
        summary = json.loads((Path(out) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return run_problem(summary) if isinstance(summary, dict) else None


if __name__ == "__main__":
    sys.exit(main())
