"""Checkpoints of a run's server state, Flower-free.

One file, ``checkpoint.npz`` in the run folder, replaced atomically (written beside it, then renamed),
so a crash at any moment leaves either the previous checkpoint or the new one, never half of one.
It holds named arrays (the global weights, strategy state, clients' own state, RNG state) and a JSON
header (round, config, code version, elapsed time), stored as a byte array so that loading needs no
pickle.
"""

from __future__ import annotations

import json
import zipfile
import zlib
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..core.errors import ConfigError, quoted
from . import codec

CHECKPOINT_NAME = "checkpoint.npz"
ZIP_MAGIC = b"PK\x03\x04"  # how every .npz file starts
# what reading a cut-short or overwritten file raises (JSON and Unicode errors are ValueErrors)
DAMAGED = (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error)
HEADER_KEY = "__header__"
FORMAT_VERSION = 2  # 2: arrays by name ("global/model/<key>"); 1 (before): by position


def save_checkpoint(out_dir: Path, arrays: Mapping[str, np.ndarray], header: Mapping[str, Any]) -> Path:
    path = Path(out_dir) / CHECKPOINT_NAME
    if HEADER_KEY in arrays:
        raise ValueError(f"'{HEADER_KEY}' is reserved for the checkpoint header")
    return codec.write(path, {HEADER_KEY: _json_bytes({**header, "format": FORMAT_VERSION}), **arrays}, durable=True)


def checkpoint_round(out_dir: Path) -> int | None:
    """The round of the run folder's checkpoint; None where it has none whose header can be read."""
    try:
        return int(checkpoint_header(out_dir)["round"])
    except ConfigError:
        return None


def checkpoint_header(out_dir: Path) -> dict[str, Any]:
    """The header of the run folder's checkpoint (round, config, ...), read without its arrays, which may be
    gigabytes (clients' state); ConfigError as ``load_checkpoint``'s, where its arrays are not checked."""
    return load_checkpoint(out_dir, header_only=True)[1]


def load_checkpoint(out_dir: Path, header_only: bool = False) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(arrays, header) of the run folder's checkpoint; ConfigError when there is none or it is unreadable."""
    path = Path(out_dir) / CHECKPOINT_NAME
    if not path.is_file():
        raise ConfigError(
            f"no checkpoint to resume from: {path} does not exist (checkpoints are written every "
            "checkpoint-every rounds; a run stopped before its first one must start again)"
        )
    try:
        arrays, header = _read(path, header_only)
    except PermissionError as exc:
        raise ConfigError(f"checkpoint {path} cannot be read: {exc.strerror}") from None
    except ConfigError:
        raise
    except DAMAGED as exc:
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(
            f"checkpoint {path} is damaged or truncated ({detail}), so the run cannot be resumed "
            f"from it; start the run again with --overwrite (its config is in "
            f"{Path(out_dir) / 'manifest.json'}), or put back an intact copy of {CHECKPOINT_NAME} "
            "if you kept one"
        ) from None
    if not isinstance(header, dict):
        raise ConfigError(f"checkpoint {path} has a header that is not a JSON object, so the run cannot be resumed")
    if header.get("format") != FORMAT_VERSION:
        raise ConfigError(f"checkpoint {path} has format {header.get('format')}, this code reads {FORMAT_VERSION}")
    problem = header_problem(header)
    if problem is not None:
        raise ConfigError(f"checkpoint {path} has a header whose {problem}, so the run cannot be resumed")
    return arrays, header


def header_problem(header: dict[str, Any]) -> str | None:
    """What a readable checkpoint header lacks that a resume reads: a whole round >= 0, the config, the elapsed
    seconds."""
    round_, elapsed = header.get("round"), header.get("elapsed", 0.0)
    if isinstance(round_, bool) or not isinstance(round_, int) or round_ < 0:
        return f"round is {quoted(round_)}, not a whole number >= 0"
    if not isinstance(header.get("config"), dict):
        return f"config is {quoted(header.get('config'))}, not a mapping of keys"
    if isinstance(elapsed, bool) or not isinstance(elapsed, (int, float)):
        return f"elapsed is {quoted(elapsed)}, not a number of seconds"
    return None


def _read(path: Path, header_only: bool) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The checkpoint's arrays (none: ``header_only``) and header; one of DAMAGED when the file is not whole.
    Bytes that are no zip are refused before NumPy reads them (it would guess they were pickled)."""
    with open(path, "rb") as f:
        head = f.read(len(ZIP_MAGIC))
    if not head:
        raise EOFError("the file is empty")
    if head != ZIP_MAGIC:
        raise ValueError("it is not an .npz (zip) file")
    arrays = codec.read(path, (HEADER_KEY,) if header_only else None)
    if HEADER_KEY not in arrays:
        raise ConfigError(f"{path} is not a checkpoint of this project (no header)")
    return arrays, json.loads(arrays.pop(HEADER_KEY).tobytes().decode())


def _json_bytes(obj: Any) -> np.ndarray:
    return np.frombuffer(json.dumps(obj, default=str).encode(), dtype=np.uint8)


# ---------------------------------------------------------------- RNG state


def rng_state() -> dict[str, np.ndarray]:
    """The server process's global torch and numpy RNG states."""
    import torch

    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "rng/torch": torch.get_rng_state().numpy().copy(),
        "rng/numpy-keys": keys,
        "rng/numpy-meta": np.array([pos, has_gauss], dtype=np.int64),
        "rng/numpy-gauss": np.array(cached, dtype=np.float64),
    }


def set_rng_state(arrays: Mapping[str, np.ndarray]) -> None:
    import torch

    torch.set_rng_state(torch.from_numpy(np.asarray(arrays["rng/torch"], dtype=np.uint8).copy()))
    pos, has_gauss = (int(v) for v in arrays["rng/numpy-meta"])
    np.random.set_state(("MT19937", arrays["rng/numpy-keys"], pos, has_gauss, float(arrays["rng/numpy-gauss"])))
