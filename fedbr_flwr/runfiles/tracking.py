"""Experiment tracking: the records a run writes to rounds.jsonl and metrics.jsonl, also sent to
TensorBoard (``<run>/tensorboard/``) and/or Weights & Biases (``tracking = tensorboard,wandb``), from the
server only. The step is the round. Each tracker is an optional extra, imported only when asked for; a
tracker that fails (a full disk, W&B unreachable) costs one warning line and is off for the rest of the
run, which goes on.

A resumed run continues the same curves: TensorBoard purges the steps after the checkpoint's round (they are
written again), W&B reopens the run id kept in ``<run>/tracking.json`` and logs only rounds above the last one
its files hold: those its stopped process handed it but never wrote (W&B writes every 15 s) are logged again
from the run files (``catch_up``). A sweep labels its runs there too (``label_sweep_run``): W&B groups them by sweep."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import secrets
import shutil
import struct
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

from ..core.config import common
from ..core.errors import ConfigError

TENSORBOARD_DIR = "tensorboard"
TRACKING_FILE = "tracking.json"
WANDB_DIR = "wandb"  # W&B's own files (offline runs) under the run folder
SWEEP_LABELS = ("group", "name", "tags")  # what a sweep writes to tracking.json before its run starts
# metrics.jsonl fields that are no curve: the round (the step), the training means (rounds.jsonl's, logged
# with the round) and the per-client accuracies (a histogram)
EVAL_NOT_SCALARS = ("round", "train", "per_client_acc")
HPARAM_METRICS = ("eval/mean_acc", "eval/worst_acc", "eval/global_acc")


def check_available(cfg: Mapping[str, Any]) -> None:
    """ConfigError, before a run starts, naming the extra to install for a tracker whose package is missing."""
    for name in common(cfg).tracking:
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f'tracking={name} needs the {name} extra: pip install -e ".[{name}]"')


def flat_scalars(values: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """Every number in ``values`` (nested mappings too) by its path under ``prefix``; None, flags and lists
    are no curve."""
    out: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}/{key}"
        if isinstance(value, Mapping):
            out.update(flat_scalars(value, name))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def round_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A rounds.jsonl line's curves: train/<metric> (the clients' means), server/<metric> (the strategy's) and
    round/<field> (clients, failures, seconds, bytes, memory)."""
    rest = {k: v for k, v in record.items() if k not in ("round", "train", "server")}
    return {
        **flat_scalars(record.get("train", {}), "train"),
        **flat_scalars(record.get("server", {}), "server"),
        **flat_scalars(rest, "round"),
    }


def eval_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """A metrics.jsonl line's curves: eval/mean_acc, worst_acc, pooled_acc, loss, global_acc, ..."""
    return flat_scalars({k: v for k, v in record.items() if k not in EVAL_NOT_SCALARS}, "eval")


def eval_histograms(record: Mapping[str, Any]) -> dict[str, list[float]]:
    accs = [float(a) for a in record.get("per_client_acc", {}).values() if a is not None and math.isfinite(a)]
    return {"eval/per_client_acc": accs} if accs else {}


def read_state(out_dir: Path) -> dict[str, Any]:
    try:
        state = json.loads((Path(out_dir) / TRACKING_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def write_state(out_dir: Path, state: Mapping[str, Any]) -> None:
    from .jsonsafe import write_text_atomically

    write_text_atomically(Path(out_dir) / TRACKING_FILE, json.dumps(state, indent=2) + "\n")


def label_sweep_run(out_dir: Path, group: str, name: str, tags: list[str]) -> None:
    """Called by fedbr-sweep before a run (its folder may not exist yet): its W&B group (the sweep), name and tags
    (run, seed)."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    write_state(out_dir, {**read_state(out_dir), "group": group, "name": name, "tags": tags})


def clear_previous(out_dir: Path) -> None:
    """A run started again in its folder: the old run's TensorBoard curves, W&B files and W&B run id go (a
    sweep's labels for the new run stay), so that no tracker shows them as this run's."""
    for name in (TENSORBOARD_DIR, WANDB_DIR):
        shutil.rmtree(Path(out_dir) / name, ignore_errors=True)
    if (Path(out_dir) / TRACKING_FILE).exists():
        write_state(out_dir, {k: v for k, v in read_state(out_dir).items() if k in SWEEP_LABELS})


def by_round(
    rounds: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]]
) -> list[tuple[int, dict[str, float], dict[str, list[float]]]]:
    """The curves of the run files' lines (rounds.jsonl's, metrics.jsonl's) as each round logged them, by round."""
    steps: dict[int, tuple[dict[str, float], dict[str, list[float]]]] = {}
    for record in rounds:
        steps.setdefault(int(record["round"]), ({}, {}))[0].update(round_scalars(record))
    for record in evals:
        scalars, histograms = steps.setdefault(int(record["round"]), ({}, {}))
        scalars.update(eval_scalars(record))
        histograms.update(eval_histograms(record))
    return [(step, scalars, histograms) for step, (scalars, histograms) in sorted(steps.items())]


class Sink(Protocol):
    def log(self, step: int, scalars: dict[str, float], histograms: dict[str, list[float]]) -> None: ...

    def catch_up(self, rounds: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...

    def stop(self) -> None: ...


class TensorBoardSink:
    """Event files in ``<run>/tensorboard/`` (torch's SummaryWriter); the config as TensorBoard hparams."""

    def __init__(self, cfg: Mapping[str, Any], out_dir: Path, resume_round: int | None):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        log_dir = Path(out_dir) / TENSORBOARD_DIR
        if resume_round is None:
            shutil.rmtree(log_dir, ignore_errors=True)  # a run started again in its folder: not the old curves
        # a resumed run that asks for TensorBoard only now: its earlier rounds come from the run files
        self.new_on_resume = resume_round is not None and not any(log_dir.glob("events.out.tfevents.*"))
        # purge_step: the events of rounds after the checkpoint's are hidden; this run writes them again
        self.writer = SummaryWriter(
            str(log_dir), purge_step=None if resume_round is None else resume_round + 1, flush_secs=10
        )
        file_writer = self.writer._get_file_writer()
        for summary in hparams(dict(cfg), dict.fromkeys(HPARAM_METRICS, 0.0)):
            file_writer.add_summary(summary)

    def log(self, step: int, scalars: dict[str, float], histograms: dict[str, list[float]]) -> None:
        import numpy as np

        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
        for tag, values in histograms.items():
            self.writer.add_histogram(tag, np.asarray(values), step)

    def catch_up(self, rounds: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]]) -> None:
        if self.new_on_resume:  # else its files hold every round that ended: each is flushed at its end
            for step, scalars, histograms in by_round(rounds, evals):
                self.log(step, scalars, histograms)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

    def stop(self) -> None:
        self.writer.close()  # a resume purges the steps after its checkpoint


class WandbSink:
    """A W&B run (online, or offline with WANDB_MODE=offline) whose id is kept in ``<run>/tracking.json``. A
    round's records go to W&B as one step when the round ends (``flush``): W&B holds an uncommitted step in this
    process, where a stopped run would lose it. A resumed run logs the rounds above the last one W&B's files hold
    (``written_step``), which may be fewer than it was handed (``wandb_step`` in tracking.json)."""

    def __init__(self, cfg: Mapping[str, Any], out_dir: Path, resume_round: int | None):
        import os

        import wandb

        self.out_dir = Path(out_dir)
        state = read_state(self.out_dir)
        if resume_round is None or "wandb_id" not in state:
            state = {**state, "wandb_id": secrets.token_hex(4), "wandb_step": 0}  # a new W&B run
        self.state = state
        self.logged_through = int(state.get("wandb_step", 0))  # what W&B was handed; below, what its files hold
        self.pending: dict[str, Any] = {}
        self.pending_step = 0
        write_state(self.out_dir, state)
        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "fedbr-flwr",
            dir=str(self.out_dir),
            id=state["wandb_id"],
            resume="allow",
            name=state.get("name") or self.out_dir.name,
            group=os.environ.get("WANDB_RUN_GROUP") or state.get("group"),  # W&B's own variable wins
            tags=state.get("tags"),
            config=dict(cfg),
            reinit="finish_previous",
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True, disable_git=True),
        )
        if resume_round is not None:  # after init, which finishes a run of this process left open
            written = written_step(self.out_dir, state["wandb_id"])
            if written is not None:  # what W&B holds, where a killed process handed it more than it wrote
                self.logged_through = written

    def log(self, step: int, scalars: dict[str, float], histograms: dict[str, list[float]]) -> None:
        if step <= self.logged_through:
            return
        if step != self.pending_step:
            self.flush()
        self.pending_step = step
        self.pending.update({**scalars, **{tag: self.wandb.Histogram(v) for tag, v in histograms.items()}})

    def catch_up(self, rounds: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]]) -> None:
        """Log the rounds of the run files (a resumed run's, up to its checkpoint) that W&B's files lack."""
        for step, scalars, histograms in by_round(rounds, evals):
            self.log(step, scalars, histograms)
        self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        self.run.log(self.pending, step=self.pending_step, commit=True)
        self.pending = {}
        self.logged_through = self.state["wandb_step"] = self.pending_step
        write_state(self.out_dir, self.state)

    def close(self) -> None:
        self.flush()
        self.run.finish()

    def stop(self) -> None:
        self.pending = {}  # the round in progress: its resume logs it again
        self.run.finish()


def wandb_log_records(path: Path) -> Iterator[Any]:
    """The protobuf records of a W&B transaction log (``run-<id>.wandb``: a LevelDB-style log of 32 KiB blocks of
    chunks with a 7-byte header, after the file's own 7-byte header, ":W&B" and a version), up to a chunk or record
    that a killed writer left unfinished. ValueError for a file of another format."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2

    data, pos, pending, block = path.read_bytes(), 7, b"", 32768
    if not data.startswith(b":W&B"):
        raise ValueError(f"{path} is not a W&B transaction log")
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if pos + 7 + length > len(data):  # cut short
            return
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL or FIRST start a record
        if kind in (1, 4):  # FULL or LAST end it
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            try:
                record.ParseFromString(pending)
            except DecodeError:  # torn
                return
            yield record


def written_step(out_dir: Path, run_id: str) -> int | None:
    """The last step of W&B run ``run_id`` that its files in ``out_dir`` hold (its transaction logs, which `wandb
    sync` uploads; 0: none); None where W&B's format could not be read."""
    logs = {path.resolve() for path in (Path(out_dir) / WANDB_DIR).glob(f"*/run-{run_id}.wandb")}
    try:
        steps = [
            record.history.step.num
            for path in logs
            for record in wandb_log_records(path)
            if record.WhichOneof("record_type") == "history"
        ]
    except Exception:  # noqa: BLE001  (W&B's own format, which may change: then tracking.json's count stands)
        return None
    return max(steps, default=0)


OPENERS: dict[str, Callable[[Mapping[str, Any], Path, int | None], Sink]] = {
    "tensorboard": TensorBoardSink,
    "wandb": WandbSink,
}


def one_line(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= 300 else text[:297] + "..."


class Tracking:
    """The run's trackers. Never raises: a tracker that fails is reported through ``warn`` once and dropped.
    Until closed, it is among the ``OPEN`` ones that ``stop_open_trackers`` ends when the process is stopped."""

    def __init__(
        self, cfg: Mapping[str, Any], out_dir: Path, resume_round: int | None, warn: Callable[[str], None]
    ) -> None:
        self.warn = warn
        self.sinks: dict[str, Sink] = {}
        for name in common(cfg).tracking:
            try:
                self.sinks[name] = OPENERS[name](cfg, Path(out_dir), resume_round)
            except Exception as exc:  # noqa: BLE001  (tracking must never fail the run)
                self._failed(name, exc)
        OPEN.add(self)

    def log_round(self, record: Mapping[str, Any]) -> None:
        if self.sinks:
            step, scalars = int(record["round"]), round_scalars(record)
            self._each(lambda sink: sink.log(step, scalars, {}))

    def log_eval(self, record: Mapping[str, Any]) -> None:
        if self.sinks:
            step, scalars, histograms = int(record["round"]), eval_scalars(record), eval_histograms(record)
            self._each(lambda sink: sink.log(step, scalars, histograms))

    def catch_up(self, rounds: Sequence[Mapping[str, Any]], evals: Sequence[Mapping[str, Any]]) -> None:
        """A resumed run's records up to its checkpoint (its run files), for the trackers that lack some."""
        self._each(lambda sink: sink.catch_up(rounds, evals))

    def flush(self) -> None:
        """Hand the round's records to the trackers for good (at its end, before its checkpoint)."""
        self._each(lambda sink: sink.flush())

    def close(self) -> None:
        self._each(lambda sink: sink.close())
        self.sinks.clear()
        OPEN.discard(self)

    def stop(self) -> None:
        """End the trackers of a run being stopped, without its round in progress (from another thread: the run's
        own calls find no tracker meanwhile)."""
        sinks, self.sinks = self.sinks, {}
        for sink in sinks.values():
            with contextlib.suppress(Exception):
                sink.stop()
        OPEN.discard(self)

    def _each(self, call: Callable[[Sink], None]) -> None:
        for name, sink in list(self.sinks.items()):
            try:
                call(sink)
            except Exception as exc:  # noqa: BLE001
                del self.sinks[name]
                self._failed(name, exc)

    def _failed(self, name: str, exc: BaseException) -> None:
        self.warn(f"tracking: {name} failed ({one_line(exc)}); the run goes on without it")


OPEN: "weakref.WeakSet[Tracking]" = weakref.WeakSet()


def stop_open_trackers() -> None:
    """End every run's trackers in this process (it is being stopped: a time limit, Ctrl-C, SIGTERM): W&B writes
    the rounds it was handed to its files every 15 s and when its run finishes, so a process that just ends loses
    the last ones."""
    for trackers in list(OPEN):
        trackers.stop()
