"""Strict JSON for every file a run writes (metrics.jsonl, rounds.jsonl, progress.jsonl, summary.json,
manifest.json): NaN and +-Infinity, which Python's ``json`` would write as bare ``NaN``/``Infinity``
tokens that strict readers (``jq``, JavaScript, pandas with a strict parser) reject, are written as
``null``. Readers treat ``null`` as a missing value. And one way to replace a whole file so that no reader
sees half of it."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every non-finite float (in dicts, lists and tuples, at any depth) replaced by None."""
    if isinstance(obj, (float, np.floating)):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """``json.dumps`` that writes ``null`` for NaN and +-Infinity (and never a bare NaN token)."""
    return json.dumps(finite_or_none(obj), allow_nan=False, **kwargs)


def write_atomically(path: Path, data: bytes, durable: bool = False) -> None:
    """Readers (and a crash) see the old file or the new one, never half of it: written beside it, then renamed
    over it. ``durable``: flushed to the disk before the rename (checkpoints)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, say: the old file stays whole, and no half-written one is left
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomically(path: Path, text: str) -> None:
    write_atomically(path, text.encode())
