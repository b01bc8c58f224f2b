"""Data the server shares with every client (FedBR's pseudo-data, FedMix's mean data, VHL's virtual
data): it rides in the fit config, as npz bytes, only to clients that have not yet confirmed holding
its current version; clients keep it in their node state.

Keys, for a broadcast named ``name``: ``<name>-version`` in every fit config and in every fit
result's metrics; ``<name>-payload`` in the config when the client needs it."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..runfiles import codec


class SharedData:
    """Server side: the current (x, y) arrays, their version, and which client holds which version."""

    def __init__(self, name: str):
        self.name = name
        self.version = 0
        self.arrays: tuple[np.ndarray, np.ndarray] | None = None
        self.payload = b""
        self.held: dict[int, int] = {}  # partition id -> version it confirmed holding

    def publish(self, x: np.ndarray, y: np.ndarray, version: int) -> None:
        self.arrays, self.version = (x, y), version
        self.payload = codec.encode({"x": np.asarray(x, dtype=np.float32), "y": np.asarray(y, dtype=np.float32)})

    def fit_config(self, pid: int) -> dict[str, Any]:
        config: dict[str, Any] = {f"{self.name}-version": self.version}
        if self.held.get(pid) != self.version:
            config[f"{self.name}-payload"] = self.payload
        return config

    def confirm(self, returned: dict[int, dict], sampled: list[int]) -> None:
        """Record the version each answering client reports (a report that is no whole number: none, so it is
        sent the data again); a sampled client that did not answer may have lost its state, so it is too."""
        for pid, metrics in returned.items():
            version = metrics.get(f"{self.name}-version")
            self.held[pid] = version if isinstance(version, int) and not isinstance(version, bool) else -1
        for pid in set(sampled) - set(returned):
            self.held.pop(pid, None)


def receive_shared(state, name: str, config: dict, pid: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Client side (``state``: its ``NodeState``): store a payload that came with this message, else use the
    stored one, which must be the version the server says is current. Returns (x, y, version)."""
    version = int(config[f"{name}-version"])
    key, meta = f"{name}-data", f"{name}-meta"
    if f"{name}-payload" in config:
        arrays = codec.decode(config[f"{name}-payload"])
        state.put_arrays(key, {"x": arrays["x"], "y": arrays["y"]})
        state.put_meta(meta, {"version": version})
    stored = state.meta(meta)
    stored = int(stored["version"]) if stored is not None else None
    if stored != version:
        raise RuntimeError(
            f"client {pid} holds {name} data version {stored}, the server expects {version}; "
            "it resends the data to this client next round"
        )
    arrays = state.arrays(key)
    return arrays["x"], arrays["y"], version
