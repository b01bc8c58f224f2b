"""The cohort engine's message format (``engine=cohort``): one Flower message carries the clients of a
cohort, so that one node trains many clients in one process and the global arrays travel once per
cohort. Inside the usual named payload:

* arrays and config values of one member are named ``member/<pid>/<name>``; what every member gets
  alike (the global arrays, a config value equal for all) is sent once, under its own name;
* ``members`` (in the config, the reply's metrics and the node's properties) lists the partition ids
  the message is about, comma-separated.

Flower-free; the node's ``CohortClient`` and the server's adapter use it."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

MEMBERS = "members"
PREFIX = "member/"


def member_key(pid: int, name: str) -> str:
    return f"{PREFIX}{pid}/{name}"


def members_of(values: Mapping[str, Any]) -> list[int]:
    return [int(p) for p in str(values[MEMBERS]).split(",") if p]


def join_members(pids: list[int]) -> str:
    return ",".join(str(p) for p in pids)


def by_member(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """(what all members share, {pid: what is that member's own}) of a cohort message's arrays or config."""
    shared: dict[str, Any] = {}
    own: dict[int, dict[str, Any]] = {}
    for key, value in values.items():
        if key.startswith(PREFIX):
            pid, slash, name = key[len(PREFIX) :].partition("/")
            if not slash or not pid.isdecimal():
                raise ValueError(f"{key[:60]!r} names no member as {PREFIX}<pid>/<name>")
            own.setdefault(int(pid), {})[name] = value
        elif key != MEMBERS:
            shared[key] = value
    return shared, own


def member_views(values: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    """Each listed member's whole arrays or config (the shared part, then its own), split in one pass."""
    shared, own = by_member(values)
    return {pid: {**shared, **own.get(pid, {})} for pid in members_of(values)}


def join_configs(configs: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """One config for several members: a value all of them have alike once, the others per member."""
    pids = list(configs)
    keys = {k for config in configs.values() for k in config}
    out: dict[str, Any] = {MEMBERS: join_members(pids)}
    for key in sorted(keys):
        values = [configs[p].get(key) for p in pids]
        if all(key in configs[p] for p in pids) and all(_same(values[0], v) for v in values[1:]):
            out[key] = values[0]
        else:
            out.update({member_key(p, key): configs[p][key] for p in pids if key in configs[p]})
    return out


def join_arrays(arrays: Mapping[int, Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Each member's arrays under its own names (every array here is a member's own)."""
    return {member_key(pid, name): a for pid, named in arrays.items() for name, a in named.items()}


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b
