"""The launch layer's types: the plan a simulated run is made once from (``RunPlan``), and what ``launcher.RunHost``
and the simulation process (``simulation.serve``) say to each other: a request per run on the process's stdin, and
replies on its stdout, one JSON object a line, typed on both sides."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, TypeVar, get_args, get_type_hints

from ..core.config import CommonSettings, common

T = TypeVar("T")


@dataclass(frozen=True)
class RunPlan:
    """A simulated run as it will be on this machine, made once by ``launch.plan`` (``plan_run``, ``plan_resumed``):
    its config, read-only, with the backend, the cohorts and each client's cores and GPU share resolved, and its
    run folder checked (the config is what travels to Flower); its typed ``settings``; its simulated SuperNodes
    (one per client, or one per cohort with engine=cohort); its run folder."""

    config: Mapping[str, Any]
    settings: CommonSettings
    supernodes: int
    out_dir: Path

    @classmethod
    def of(cls, cfg: Mapping[str, Any]) -> RunPlan:
        run = common(cfg)
        nodes = run.cohorts if run.engine == "cohort" else run.num_clients
        return cls(MappingProxyType(dict(cfg)), run, nodes, Path(run.output_dir))

    def with_keys(self, keys: Mapping[str, Any]) -> RunPlan:
        """The plan with ``keys`` changed: what a time limit or a continued run changes (checkpoint-every, resume)."""
        return RunPlan.of({**self.config, **keys})


class JsonLine:
    """A message of the protocol, one JSON object a line."""

    def line(self) -> str:
        return json.dumps(asdict(self)) + "\n"  # type: ignore[call-overload]

    @classmethod
    def parse(cls: type[T], line: str) -> T:
        """``cls`` from one line; ValueError for a line that is not one (no JSON object, a field missing or of
        another type). Fields ``cls`` does not have are left out."""
        data = json.loads(line)
        if not isinstance(data, dict):
            raise ValueError(f"not a {cls.__name__}: {line[:80]!r}")
        hints = get_type_hints(cls)
        values = {f.name: data[f.name] for f in fields(cls) if f.name in data}  # type: ignore[arg-type]
        for name, value in values.items():
            allowed = get_args(hints[name]) or (hints[name],)
            if not isinstance(value, allowed + ((int,) if float in allowed else ())):
                raise ValueError(f"not a {cls.__name__}: {name} = {value!r}")
        try:
            return cls(**values)
        except TypeError as exc:
            raise ValueError(f"not a {cls.__name__}: {exc}") from exc


@dataclass(frozen=True)
class RunRequest(JsonLine):
    """One run for the simulation process: its run-config file, Flower's run id, the simulated SuperNodes and
    each one's resources, the file its output goes to (``append``: a resumed run's), the folder it runs in
    (the run folder). Where its clients run is the run config's ``backend``, decided once by the run plan."""

    run_config: str
    run_id: int
    supernodes: int
    cpus: float
    gpus: float
    log: str
    append: bool
    cwd: str


@dataclass(frozen=True)
class RunReply(JsonLine):
    """The process's word on run ``run_id``: it started; or Flower's part of it ended (``ok``, and ``error``
    where it failed); or the process takes no more runs and ends (``retired``: why)."""

    run_id: int
    started: bool = False
    ok: bool | None = None
    error: str = ""
    retired: str = ""

    @property
    def last(self) -> bool:
        """Whether nothing more will come about this run."""
        return self.ok is not None or bool(self.retired)
