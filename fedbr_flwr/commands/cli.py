"""``fedbr-run``: validate an experiment, run it as a Flower simulation, report the result.

    fedbr-run                                   # one FedAvg run of the defaults
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
from pathlib import Path
from typing import Any, Sequence

from ..app.raycluster import requested_address
from ..core.config import ConfigError, normalise_key, pyproject_table, schema
from ..core.errors import OneLineParser, quiet_when_its_reader_leaves
from ..launch.launcher import PROJECT_DIR, RunFailed, RunHost, how_to_continue, run_flower
from ..launch.plan import build_config, is_override, plan_resumed, plan_run
from ..launch.timelimit import (
    EXIT_TIME_LIMIT,
    RoundWatch,
    TimeLimitReached,
    parse_duration,
    stop_deadline,
    stopped_line,
)
from ..runfiles.checkpoint import checkpoint_round
from ..runfiles.run_io import finish_run, finished_run_problem, only_end_left

PYPROJECT_MARK = "# Generated from the schema by `fedbr-run --write-pyproject` (a test keeps it equal):\n"


def list_keys() -> str:
    """Every strategy and component, then every key by owner: its default, choices and meaning."""
    from ..core.registry import COMPONENTS, VARIANTS, algorithm_names, how_to_enable

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
    from ..core.config import configuration_reference

    new = configuration_reference()
    changed = not path.is_file() or path.read_text() != new
    if changed:
        path.write_text(new)
    return changed


# fedbr-run's options in --help's order with their help; an option that is not a switch: its arguments in OPTIONS
HELP = {
    "--list": "list strategies, components and config keys, then exit",
    "--write-pyproject": "rewrite pyproject.toml's run-config table from the schema (after adding a key), then exit",
    "--write-docs": "rewrite docs/configuration.md from the schema (after adding a key), then exit",
    "--dry-run": "make every check a run makes (its folder, its data: download=auto fetches a missing dataset), "
    "print the config, then exit",
    "--overwrite": "reuse an output-dir that holds a run",
    "--resume": "continue the run in DIR from its last checkpoint",
    "--time-limit": "stop before DURATION (90s, 15m, 1h30m, 2h; a plain number is seconds) has passed: the run "
    "checkpoints after every round and stops after the last round that fits, with exit code 75 and a line saying "
    "how to continue "
    "(fedbr-run --resume DIR --time-limit ...); a round still running at the limit is lost",
    "--quiet": "print no progress (the log is in flower.log)",
    "--verbose": "echo all of Flower's log, not only progress",
    "--superlink": "run through `flwr run` on a private local SuperLink, as a Flower user would (seconds slower to "
    "start; the default runs Flower's simulation entry point in one process)",
}
OPTIONS: dict[str, dict[str, Any]] = {"--resume": {"metavar": "DIR"}, "--time-limit": {"metavar": "DURATION"}}


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="fedbr-run", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("items", nargs="*", help="experiment YAML files and key=value overrides")
    for flag, help in HELP.items():
        parser.add_argument(flag, help=help, **OPTIONS.get(flag, {"action": "store_true"}))
    return parser


@quiet_when_its_reader_leaves
def main(argv: Sequence[str] | None = None) -> int:
    started = time.time()
    parser = build_parser()
    args = parser.parse_intermixed_args(argv)  # options may come between files and overrides
    try:
        args.deadline = None if args.time_limit is None else stop_deadline(started, parse_duration(args.time_limit))
    except ConfigError as exc:
        return error(exc, 2)
    if args.quiet and args.verbose:  # the run printed nothing, its echo of Flower's log ignored
        return error("--quiet and --verbose contradict each other: give one", 2)
    if args.items and (only := next((f for f in ("list", "write_pyproject", "write_docs") if getattr(args, f)), "")):
        flag = "--" + only.replace("_", "-")  # it would list or write from the schema and leave them unread
        return error(f"{flag} takes no settings or experiment files (got {args.items[0]!r})", 2)
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
        if args.resume is not None:
            if not args.resume.strip():
                raise ConfigError("--resume needs the folder of the run to continue")
            plan = plan_resumed(Path(args.resume), args.items, superlink=args.superlink)
        else:
            plan = plan_run(build_config(args.items), args.overwrite, superlink=args.superlink)
        if args.deadline is not None:
            plan = plan.with_keys({"checkpoint-every": 1})  # a stop loses no finished round
    except ConfigError as exc:
        return error(exc, 2)
    except KeyboardInterrupt:  # in the checks (a dataset's download, say): no run started, none to continue
        print("fedbr-run: interrupted before the run started", file=sys.stderr)
        return 130
    if args.dry_run:
        print("\n".join(f"{k} = {v!r}" for k, v in plan.config.items()))
        return 0
    run, out = plan.settings, plan.out_dir
    if run.resume and only_end_left(out, run.num_rounds):
        try:
            finish_run(plan.config, out)
        except ConfigError as exc:  # its folder taken by a run that started since
            return error(exc, 2)
        return print_result(out, "fedbr-run", RUN_FILES)
    print(
        f"fedbr-run: {run.strategy} on {run.dataset}, {run.num_clients} clients, {run.num_rounds} rounds -> {out}",
        flush=True,
    )
    if host is not None and requested_address(run.ray_address) != host.address:
        host.close()  # the run joins a cluster: the private runtime started ahead would only hold memory
    # SIGTERM must unwind like Ctrl-C so that the launcher stops the SuperLink and its children.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        echo = "none" if args.quiet else "all" if args.verbose else "progress"
        watch, started_after = None, checkpoint_round(out) if run.resume else None
        if args.deadline is not None:
            watch = RoundWatch(args.deadline, run.num_rounds, started_after)
        run_flower(plan, echo=echo, superlink=args.superlink, host=host, watch=watch)
    except TimeLimitReached as exc:
        line = stopped_line("fedbr-run", str(out), exc.saved_round, run.num_rounds, again(args, out, exc))
        if exc.saved_round == started_after:  # the same command would stop there again, and again
            line += f" (no round ended within {args.time_limit}: give a longer --time-limit)"
        print(line, file=sys.stderr)
        return EXIT_TIME_LIMIT
    except ConfigError as exc:  # found only at launch: the folder taken by a run that started at the same instant
        return error(exc, 2)
    except RunFailed as exc:
        return error(exc, 1)
    except OSError as exc:  # the run folder's disk filled up (or went away) while the run wrote to it
        return error(f"the run stopped: cannot write to {out}: {exc.strerror or exc}", 1)
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
        return error(f"the run ended without a final evaluation (did every client fail?); see {out / 'flower.log'}", 1)
    return print_result(out, "fedbr-run", RUN_FILES)


def error(message: object, code: int) -> int:
    print(f"fedbr-run: error: {message}", file=sys.stderr)
    return code


def again(args: argparse.Namespace, out: Path, stop: TimeLimitReached) -> str:
    """The command that continues a run its time limit stopped: ``--resume`` from its checkpoint, or where it
    has none, the command that started it, into the same folder."""
    superlink = ["--superlink"] if args.superlink else []
    if stop.saved_round is not None:
        start = ["--resume", str(out)]
    else:
        kept = [i for i in args.items if not (is_override(i) and normalise_key(i.split("=", 1)[0]) == "output-dir")]
        start = [*kept, f"output-dir={out}", "--overwrite"]
    return shlex.join(["fedbr-run", *start, "--time-limit", args.time_limit, *superlink])


def stopped_run(out: Path) -> str:
    return f"Flower processes stopped; partial run files in {out}; {how_to_continue(out, f'fedbr-run --resume {out}')}"


RUN_FILES = ("metrics.jsonl", "rounds.jsonl", "manifest.json", "summary.json", "convergence.png")


def print_result(out: Path, command: str, files: Sequence[str] = ()) -> int:
    """Print a finished run's summary.md and which of ``files`` it wrote (no plot without an evaluation); the exit
    code: 1 (with one line saying why) when no round trained."""
    print("\n" + (out / "summary.md").read_text())
    written = [name for name in files if (out / name).exists()]
    print(f"run files: {out}" + (f" ({', '.join(written)})" if written else ""))
    problem = finished_run_problem(out)
    if problem:
        print(f"{command}: error: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
