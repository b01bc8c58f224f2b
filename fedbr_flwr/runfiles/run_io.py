"""Run files: manifest.json, metrics.jsonl (one line per evaluation), rounds.jsonl (one line per
round), progress.jsonl (events), summary.json / summary.md and convergence.png, all in the run's output
directory. Every JSON value that is NaN or infinite is written as ``null`` (``jsonsafe``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Mapping

from ..core.config import as_it_ran, changed_on_resume, common
from ..core.errors import ConfigError, quoted
from . import jsonsafe, runlock
from .checkpoint import CHECKPOINT_NAME, checkpoint_header, checkpoint_round
from .jsonsafe import write_text_atomically
from .metrics import is_partial, plot_history, read_jsonl, run_problem, summarize, summary_table
from .progress import SUMMARY_EVENT, Progress, last_event_kind
from .tracking import Tracking, clear_previous

PACKAGES = ("flwr", "torch", "torchvision", "numpy", "ray", "mlxtend", "pyyaml", "matplotlib")
CODE_PACKAGES = ("fedbr_flwr", "clients", "strategies", "pseudodata")
PROJECT_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds CODE_PACKAGES
log = logging.getLogger("flwr")


def resolve_output_dir(cfg: Mapping[str, Any]) -> Path:
    run = common(cfg)
    if run.output_dir:
        return Path(run.output_dir).expanduser().resolve()
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return (Path.cwd() / "runs" / f"{run.strategy}-{run.dataset}-{stamp}").resolve()


def manifest_config(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The config a run last ran with, from its ``manifest``: its latest resumed piece's (which may have raised
    num-rounds), else its start's; ``resume`` as at the start."""
    pieces = [manifest, *(p for p in manifest.get("resumed", []) if isinstance(p, dict) and "config" in p)]
    return {**pieces[-1]["config"], "resume": manifest["config"].get("resume", False)}


def check_path(path: Path, what: str = "output-dir") -> Path:
    """``path`` with ``~`` expanded; a ConfigError, said once before a file operation fails on it with a
    traceback, where it is not UTF-8 text, names the home folder of a user this machine does not have, or is
    longer than this system allows."""
    try:
        str(path).encode()
    except UnicodeEncodeError:
        raise ConfigError(f"{what} {quoted(str(path))} holds bytes that are not UTF-8 text: rename it") from None
    try:
        expanded = Path(path).expanduser()
    except RuntimeError:  # ~name of no user here
        raise ConfigError(f"{what} {quoted(str(path))} starts with the home folder of an unknown user") from None
    check_path_length(expanded, what)
    return expanded


def check_path_length(path: Path, what: str = "output-dir") -> None:
    """ConfigError when ``path`` is longer than this system allows (a name over NAME_MAX, the whole over
    PATH_MAX), said once, before any file operation fails on it with a traceback."""
    name_max, path_max = 255, 4096
    with contextlib.suppress(OSError, ValueError):
        name_max = os.pathconf("/", "PC_NAME_MAX")
        path_max = os.pathconf("/", "PC_PATH_MAX")
    longest = max((len(part.encode()) for part in Path(path).parts), default=0)
    if longest > name_max or len(str(path).encode()) >= path_max:
        raise ConfigError(
            f"{what} {quoted(str(path))} is too long for this system ({len(str(path))} characters; a folder name "
            f"may have {name_max} bytes, a whole path {path_max - 1}): pick a shorter one"
        )


def check_output_dir(out: Path, what: str = "output-dir") -> None:
    """ConfigError, before anything starts, when the run folder cannot be made or written to (a file in
    its place or in its path, no permission, a read-only disk). The check leaves no trace: folders it
    made for the probe are removed again."""
    out = Path(out)
    made = [p for p in (out, *out.parents) if not p.exists()]
    probe = out / ".fedbr-write-probe"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except FileExistsError:
        raise ConfigError(
            f"{what} {out} cannot be used: it is a file, not a folder; pick another {what} or move the file"
        ) from None
    except NotADirectoryError as exc:
        blocker = next((p for p in out.parents if p.exists() and not p.is_dir()), exc.filename)
        raise ConfigError(
            f"{what} {out} cannot be made: {blocker} in its path is a file, not a folder; pick another {what}"
        ) from None
    except OSError as exc:
        raise ConfigError(
            f"{what} {out} is not writable ({exc.strerror}: {exc.filename}); pick another {what} or make it writable"
        ) from None
    finally:
        for p in made:  # deepest first
            with contextlib.suppress(OSError):
                p.rmdir()


def cpu_model() -> str:
    """The CPU's name as the OS reports it (Linux: /proc/cpuinfo), else the platform's processor."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def gpu_name() -> str | None:
    """The first CUDA device's name when torch sees one (without initialising CUDA otherwise)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_name(0))


def host_facts() -> dict[str, Any]:
    """What a results table names as its machine: platform, CPU model, cores, GPU (None: none used)."""
    return {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "gpu": gpu_name(),
        "argv": sys.argv[:1],
    }


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def code_hash(root: Path = PROJECT_ROOT) -> str:
    """sha256 over this project's Python sources as they are running (also inside a Flower FAB)."""
    h = hashlib.sha256()
    for pkg in CODE_PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


def git_commit(path: Path | None = None) -> str:
    """$FEDBR_COMMIT where it is set (a copy of the tree whose .git is not its own, as on a lent GPU machine, says
    which commit it is), else HEAD of the git checkout at ``path`` (+ '-dirty' with local changes), or ''."""
    if os.environ.get("FEDBR_COMMIT"):
        return os.environ["FEDBR_COMMIT"]
    cwd = path or PROJECT_ROOT
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return ""


def check_records_continue(out_dir: Path, last_round: int, saved: Mapping[str, Any] | None = None) -> None:
    """A ConfigError when the records of the run in ``out_dir`` cannot go on after its checkpoint's
    ``last_round``: a line of rounds.jsonl or metrics.jsonl that is not a record with a whole round number
    (other than a last line a crash cut short), a round up to ``last_round`` with no record in rounds.jsonl (one
    is written every round, before the checkpoint), no metrics.jsonl, a manifest that is not a JSON object, or
    one of a run other than the checkpoint's config ``saved`` (a checkpoint copied from another run's folder).
    Continuing would drop or trip over them, and write a summary with holes."""
    if not (out_dir / "metrics.jsonl").is_file():  # written at the run's start: gone since
        raise _damaged(out_dir, "metrics.jsonl is missing (its evaluations up to the checkpoint would be lost)")
    _record_rounds(out_dir, "metrics.jsonl")  # raises at a damaged line; its rounds are not needed
    missing = sorted(set(range(1, last_round + 1)) - set(_record_rounds(out_dir, "rounds.jsonl")))
    if missing:
        raise _damaged(
            out_dir,
            f"rounds.jsonl has no record of round {missing[0]} ({len(missing)} of the {last_round} "
            "rounds its checkpoint covers are missing)",
        )
    manifest = out_dir / "manifest.json"
    stored = _json_or_none(manifest.read_text(errors="replace")) if manifest.exists() else {}
    if not isinstance(stored, dict):
        raise _damaged(out_dir, "manifest.json is not a JSON object")
    differ = _settings_differ(stored, saved or {})
    if differ:
        raise _damaged(out_dir, f"its checkpoint is of another run than its manifest.json ({differ})")


def _settings_differ(manifest: dict[str, Any], saved: Mapping[str, Any]) -> str:
    """The first setting, other than those a resume may change, whose value in a run's manifest differs from
    the checkpoint's config ``saved``; "" where none does (or the manifest has no config)."""
    try:
        ran = as_it_ran(manifest_config(manifest))
    except (KeyError, TypeError, AttributeError):
        return ""
    saved = as_it_ran(saved)
    differ = changed_on_resume(ran, saved)
    return f"{differ[0]} = {saved[differ[0]]!r} in the checkpoint, {ran[differ[0]]!r} in the manifest" if differ else ""


def _record_rounds(out_dir: Path, name: str) -> list[int]:
    """The rounds of the records in the JSON-lines file ``name``; ConfigError at a line that is not a record of a
    round, unless it is the last and unended (a crash cut it short: ``metrics.read_jsonl``'s rule too)."""
    path = out_dir / name
    text = path.read_text(errors="replace") if path.is_file() else ""
    lines = text.splitlines()
    rounds = []
    for number, line in enumerate(lines, 1):
        round_ = _round_of(line)
        if round_ is not None:
            rounds.append(round_)
        elif line.strip() and (number < len(lines) or text.endswith("\n")):
            raise _damaged(out_dir, f"line {number} of {name} is not a record of a round")
    return rounds


def _round_of(line: str) -> int | None:
    """The round of a JSON-lines record; None for a line that is not a record of a round (one a crash cut short)."""
    record = _json_or_none(line)
    return record["round"] if isinstance(record, dict) and type(record.get("round")) is int else None


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _damaged(out_dir: Path, problem: str) -> ConfigError:
    return ConfigError(
        f"the run in {quoted(str(out_dir), 300)} cannot be continued: {problem}, so its records were damaged or "
        "edited; restore them, or start the run again with --overwrite"
    )


def keep_rounds_up_to(path: Path, last_round: int) -> None:
    """Rewrite a JSON-lines file keeping the records of rounds <= ``last_round`` (and dropping a line a
    crash cut short)."""
    if not path.exists():
        path.write_text("")
        return
    lines = path.read_text(errors="replace").splitlines()
    kept = [line + "\n" for line in lines if (round_ := _round_of(line)) is not None and round_ <= last_round]
    write_text_atomically(path, "".join(kept))


# what a run writes beside its line files, whose old copies a new run in the same folder removes
PREVIOUS_RUN_FILES = (
    CHECKPOINT_NAME,
    "manifest.json",
    "summary.json",
    "summary.md",
    "convergence.png",
    "pseudo_data.npz",
    "offsets.npz",
)


OVERWRITE = "`fedbr-run --overwrite`, or the key `overwrite=true` for fedbr-deploy"  # it has no --overwrite


def check_no_run(out: Path) -> None:
    """ConfigError when ``out`` holds a run's files; --resume is offered only with a checkpoint to resume."""
    found = [name for name in ("metrics.jsonl", "rounds.jsonl", CHECKPOINT_NAME) if (out / name).exists()]
    if CHECKPOINT_NAME in found:
        raise ConfigError(
            f"{out} already holds a run; pick another output-dir, start it again ({OVERWRITE}), or "
            f"continue it (`fedbr-run --resume {out}`, or `fedbr-deploy local|run ... --resume {out}`)"
        )
    if any((out / name).stat().st_size for name in found):
        raise ConfigError(
            f"{out} already holds a run (without a checkpoint, so it cannot be resumed); pick "
            f"another output-dir or start it again ({OVERWRITE})"
        )
    if found:
        raise ConfigError(
            f"{out} holds the empty files of a run that stopped before its first round (no "
            f"checkpoint to resume from); pick another output-dir or start it again ({OVERWRITE})"
        )
    replaced = [name for name in PREVIOUS_RUN_FILES if (out / name).exists()]
    if replaced:  # a folder of other files: a new run would remove or rewrite these without a word
        raise ConfigError(
            f"{out} holds {', '.join(replaced)}, which a run writes: pick another output-dir, or replace them "
            f"({OVERWRITE})"
        )


class RunRecorder:
    """Writes the run files and prints progress. Knows nothing of Flower."""

    def __init__(self, cfg: Mapping[str, Any], out_dir: Path, resume_round: int | None = None, elapsed: float = 0.0):
        """A new run empties the line files; a run resumed after round ``resume_round`` keeps their lines
        up to that round (later ones were written after its checkpoint) and its clock goes on from
        ``elapsed`` seconds."""
        run = common(cfg)
        self.cfg = dict(cfg)
        self.out_dir = out_dir
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = out_dir / "metrics.jsonl"
        self.rounds_path = out_dir / "rounds.jsonl"
        self.resume_round = resume_round
        for p in (self.metrics_path, self.rounds_path):
            if resume_round is None:
                p.write_text("")
            else:
                keep_rounds_up_to(p, resume_round)
        if resume_round is None:  # a run started again in its folder (--overwrite): `--resume` must not find
            for name in PREVIOUS_RUN_FILES:  # the old run's checkpoint, nor a report its old summary
                (out_dir / name).unlink(missing_ok=True)
            clear_previous(out_dir)
        self.start = time.time() - elapsed
        self.title = f"{run.strategy} on {run.dataset}"
        self.progress = Progress(out_dir, resumed=resume_round is not None)
        # TensorBoard / W&B get exactly the records the line files get
        self.tracking = Tracking(cfg, out_dir, resume_round, warn=lambda text: self.progress.emit("warning", text))
        if resume_round is not None and self.tracking.sinks:
            self.tracking.catch_up(read_jsonl(self.rounds_path), read_jsonl(self.metrics_path))

    def elapsed(self) -> float:
        return time.time() - self.start

    def check_same_partition(self, partition_hash: str) -> None:
        """A resumed run must train on the partition it started with: another numpy, other dataset files or
        other partition code can deal the same config differently, and nothing else would notice."""
        manifest = self.out_dir / "manifest.json"
        if self.resume_round is None or not manifest.is_file():
            return
        started = json.loads(manifest.read_text()).get("partition_hash")
        if started is not None and started != partition_hash:
            raise ConfigError(
                f"this run started on partition {started} but its clients now deal partition {partition_hash}: "
                "resume it with the dataset files and package versions it started with (manifest.json), or start "
                "it again"
            )

    def write_manifest(self, **extra: Any) -> None:
        """A resumed run keeps the manifest of its start and adds an entry under ``resumed``."""
        run = common(self.cfg)
        code = {"config": self.cfg, "git_commit": run.git_commit or git_commit() or "unknown", "code_hash": code_hash()}
        machine = {"packages": package_versions(), "host": host_facts()}
        now = datetime.now(timezone.utc).isoformat(timespec="seconds")
        if self.resume_round is not None and (self.out_dir / "manifest.json").is_file():
            manifest = json.loads((self.out_dir / "manifest.json").read_text())
            manifest.setdefault("resumed", []).append({"after_round": self.resume_round, **code, **machine, "utc": now})
        else:
            manifest = {**code, "seed": run.seed, **machine, "started_utc": now, **extra}
        self._write_json("manifest.json", manifest)

    def log_round(self, record: dict[str, Any]) -> None:
        self._append(self.rounds_path, record)
        self.tracking.log_round(record)
        shown = {**record.get("train", {}), **record.get("server", {})}
        extras = "".join(f" | {k} {v:.4f}" for k, v in shown.items())
        failed = f" | {record['failures']} failed or rejected" if record.get("failures") else ""
        failed += " | too few updates: model unchanged" if record.get("skipped") else ""
        self.progress.emit(
            "round",
            f"round {record['round']}/{common(self.cfg).num_rounds}{extras}{failed} | {record['seconds']:.2f} s/round",
            round=record["round"],
        )

    def log_eval(self, record: dict[str, Any]) -> None:
        record = {**record, "wall_time": round(self.elapsed(), 3)}
        self._append(self.metrics_path, record)
        self.tracking.log_eval(record)
        glob = "" if record.get("global_acc") is None else f" | global {100 * record['global_acc']:.2f}%"
        if len(record.get("global_acc_by_angle") or {}) > 1:
            glob += f" (worst {record['global_worst_angle']} deg {100 * record['global_worst_acc']:.2f}%)"
        if record.get("extra_local_acc") is not None:
            glob += f" | extra local {100 * record['extra_local_acc']:.2f}%"
        partial = (
            ""
            if "clients_expected" not in record or not is_partial(record)
            else f" | PARTIAL: {record['clients_evaluated']} of {record['clients_expected']} clients, "
            "not in the summary"
        )
        self.progress.emit(
            "eval",
            f"eval round {record['round']} | mean acc {100 * record['mean_acc']:.2f}% | worst "
            f"{100 * record['worst_acc']:.2f}%{glob} | loss {record['loss']:.4f}{partial}",
            round=record["round"],
        )
        self._write_json("summary.json", self.summary())

    def summary(self) -> dict[str, Any]:
        return summarize(read_jsonl(self.metrics_path), common(self.cfg).target_acc, read_jsonl(self.rounds_path))

    def finalize(self) -> dict[str, Any]:
        history = read_jsonl(self.metrics_path)
        summary = self.summary()
        self._write_json("summary.json", summary)
        write_text_atomically(self.out_dir / "summary.md", summary_table(summary, self.title))
        if history:
            plot_history(history, self.out_dir / "convergence.png", self.title)
        self.tracking.close()
        problem = run_problem(summary)
        if problem:
            self.progress.emit("error", problem)
        self.progress.emit(SUMMARY_EVENT, f"run files in {self.out_dir}")  # the launcher stops Flower on it
        log.info("%s", summary_table(summary, self.title))  # for flower.log; fedbr-run prints summary.md itself
        return summary

    def _append(self, path: Path, record: dict) -> None:
        with open(path, "a") as f:
            f.write(jsonsafe.dumps(record) + "\n")

    def _write_json(self, name: str, obj: Any) -> None:
        write_text_atomically(self.out_dir / name, jsonsafe.dumps(obj, indent=2, default=str) + "\n")


def only_end_left(out_dir: Path, num_rounds: int) -> bool:
    """Whether the run in ``out_dir`` trained its last round (its checkpoint is of it) but stopped before its end
    was written (summary.md, convergence.png, its last event), which ``finish_run`` writes from its records."""
    return checkpoint_round(out_dir) == num_rounds and last_event_kind(out_dir) != SUMMARY_EVENT


def stopped_before_its_last_checkpoint(out_dir: Path, num_rounds: int) -> bool:
    """Whether the run in ``out_dir`` stopped after its last evaluation but before that round's checkpoint and its
    end: summary.json, refreshed at every evaluation, is then of its last round, yet the run is not finished; it
    continues from its checkpoint (or starts again where it has none). Not a run folder without events (one of
    an earlier version, or made by hand), which has no end to miss."""
    kind = last_event_kind(out_dir)
    return kind is not None and kind != SUMMARY_EVENT and checkpoint_round(out_dir) != num_rounds


def finish_run(cfg: Mapping[str, Any], out_dir: Path) -> None:
    """Write the end of the run in ``out_dir`` that was stopped after the checkpoint of its last round but before
    its end (summary.md, convergence.png, its last event): what its ServerApp writes after that checkpoint
    (``RunRecorder.finalize``), from its records, which are complete. ``cfg``: its resumed config."""
    header = checkpoint_header(out_dir)
    handlers, log.handlers = log.handlers, [logging.FileHandler(out_dir / "flower.log")]  # its log, as the run's
    try:
        with runlock.hold(out_dir), runlock.hold(out_dir, "writer"):
            recorder = RunRecorder(cfg, out_dir, resume_round=int(header["round"]), elapsed=float(header["elapsed"]))
            recorder.progress.emit("info", f"round {header['round']} was the run's last: writing its end")
            recorder.finalize()
    finally:
        log.handlers[0].close()
        log.handlers = handlers


def finished_run_problem(out: Path) -> str | None:
    """Why a run that ran to its end gave no result (fedbr-run exits 1), from its summary.json: no round
    changed the global model. None when it is a result (or there is no summary to judge by)."""
    try:
        summary = json.loads((Path(out) / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return run_problem(summary) if isinstance(summary, dict) else None
