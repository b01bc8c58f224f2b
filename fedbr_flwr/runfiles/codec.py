"""The one format for named arrays as bytes and as files: NumPy's .npz (a zip of .npy entries), never
pickled. It carries the data the server broadcasts, a client's saved state, the answers to the
server's requests, the checkpoint, and every .npz file a run writes."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Mapping

import numpy as np

from .jsonsafe import write_atomically


def encode(arrays: Mapping[str, np.ndarray], compressed: bool = False) -> bytes:
    buffer = io.BytesIO()
    save = np.savez_compressed if compressed else np.savez
    save(buffer, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as the allow_pickle flag
    return buffer.getvalue()


def decode(payload: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(payload), allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def to_uint8(payload: bytes) -> np.ndarray:
    """Bytes as an array, for channels that carry only arrays (a client's answer to a request)."""
    return np.frombuffer(payload, dtype=np.uint8)


def write(path: Path, arrays: Mapping[str, np.ndarray], compressed: bool = False, durable: bool = False) -> Path:
    """Write an .npz file that readers (and a crash) see whole or not at all: written beside it, then
    renamed over it. ``durable``: flushed to the disk before the rename (checkpoints)."""
    path = Path(path)
    write_atomically(path, encode(arrays, compressed), durable)
    return path


def read(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}
