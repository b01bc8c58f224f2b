"""The one format for named arrays as bytes and as files: NumPy's .npz (a zip of .npy entries), never
pickled. It carries the data the server broadcasts, a client's saved state, the answers to the
server's requests, the checkpoint, and every .npz file a run writes."""

from __future__ import annotations

import ast
import functools
import io
import threading
from pathlib import Path
from typing import Mapping

import numpy as np

from .jsonsafe import write_atomically

_ast_lock = threading.RLock()  # re-entrant: a finalizer the GC runs inside a parse may parse too


def serialize_ast_parsing() -> None:
    """Make this process's ``ast.parse`` calls take turns. CPython 3.11 keeps the AST converter's recursion depth
    per interpreter, not per thread, so two threads parsing at once can fail one of them with "SystemError: AST
    constructor recursion depth mismatch". numpy parses every array header it reads that way, and arrays are
    decoded in threads: the server asks its clients for their state in parallel (a client's state went missing
    from a checkpoint), and Flower decodes messages in its worker threads (a cohort dropped out of a round). So
    importing this codec installs the guard, once per process; an uncontended lock costs well under a
    microsecond, against milliseconds of decoding."""
    if getattr(ast.parse, "serialized_by_fedbr", False):
        return
    parse = ast.parse

    @functools.wraps(parse)
    def serialized_parse(*args, **kwargs):
        with _ast_lock:
            return parse(*args, **kwargs)

    serialized_parse.serialized_by_fedbr = True  # type: ignore[attr-defined]
    ast.parse = serialized_parse  # type: ignore[assignment]


serialize_ast_parsing()


def encode(arrays: Mapping[str, np.ndarray], compressed: bool = False) -> bytes:
    buffer = io.BytesIO()
    save = np.savez_compressed if compressed else np.savez
    save(buffer, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds as the allow_pickle flag
    return buffer.getvalue()


def decode(payload: bytes) -> dict[str, np.ndarray]:
    return read(io.BytesIO(payload))


def to_uint8(payload: bytes) -> np.ndarray:
    """Bytes as an array, for channels that carry only arrays (a client's answer to a request)."""
    return np.frombuffer(payload, dtype=np.uint8)


def write(path: Path, arrays: Mapping[str, np.ndarray], compressed: bool = False, durable: bool = False) -> Path:
    """Write an .npz file that readers (and a crash) see whole or not at all: written beside it, then
    renamed over it. ``durable``: flushed to the disk before the rename (checkpoints)."""
    path = Path(path)
    write_atomically(path, encode(arrays, compressed), durable)
    return path


def read(path: Path | io.BytesIO, only: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """The arrays of an .npz file, or just those named ``only`` that it holds (the others are not read)."""
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files if only is None or k in only}
