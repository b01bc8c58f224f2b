"""Named arrays inside Flower's legacy messages. Every array that travels has a name ("model/<key>",
"head/<key>", "control/<key>", "offset", ...); NumPyClient and the legacy Strategy still move plain
lists of arrays, so the list starts with one uint8 array holding the names (JSON), followed by the
arrays in that order. Only this module and the two adapters (``fedbr_flwr.app.node``,
``fedbr_flwr.app.strategy``) see the list; everything else sees ``{name: array}``."""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

Named = dict[str, np.ndarray]


class PayloadError(ValueError):
    """A message whose arrays are not a named payload of this project."""


def decode(data: bytes) -> np.ndarray:
    """One array as Flower serialises it (.npy bytes). The bytes may come from a hostile client: a header numpy
    cannot read, an array of Python objects, or a header whose shape and dtype claim other than the bytes that
    follow it (numpy allocates what it claims before reading) is a PayloadError."""
    fp = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(fp)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f".npy format {version}")
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran_order, dtype = read_header(fp)
        if dtype.hasobject:
            raise ValueError("an array of Python objects")
        count, held = math.prod(shape), len(data) - fp.tell()
        if count * dtype.itemsize != held:
            raise ValueError(f"its header claims {count * dtype.itemsize} bytes, {held} follow it")
        flat = np.frombuffer(data, dtype=dtype, count=count, offset=fp.tell())
        view = flat.reshape(shape[::-1]).transpose() if fortran_order else flat.reshape(shape)
        return view.copy(order="K")  # writable and its own, as np.load's
    except Exception as exc:  # noqa: BLE001 - whatever numpy raises on the bytes, they are not an array of ours
        raise PayloadError(f"an array's bytes are not a .npy array ({type(exc).__name__}: {str(exc)[:120]})") from None


def _names_array(names: list[str]) -> np.ndarray:
    return np.frombuffer(json.dumps(names).encode(), dtype=np.uint8)


def _names_of(header: np.ndarray) -> list[str]:
    try:
        names = json.loads(np.asarray(header, dtype=np.uint8).tobytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError, RecursionError) as exc:  # RecursionError: "[[[[..."
        raise PayloadError(f"the first array does not name the others ({exc})") from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise PayloadError("the first array must hold a JSON list of distinct names")
    return names


def to_list(arrays: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    return [_names_array(list(arrays)), *(np.asarray(a) for a in arrays.values())]


def from_list(arrays: list[np.ndarray]) -> Named:
    if not arrays:
        raise PayloadError("an empty message: expected the names, then the arrays")
    names = _names_of(arrays[0])
    if len(names) != len(arrays) - 1:
        raise PayloadError(f"{len(names)} names for {len(arrays) - 1} arrays")
    return dict(zip(names, arrays[1:]))


@dataclass
class Serialised:
    """Named arrays already serialised to Flower's tensor bytes, so that a message for each client can
    be assembled from parts (the global arrays, the round's, the client's own) without serialising
    any part twice."""

    names: list[str] = field(default_factory=list)
    tensors: list[bytes] = field(default_factory=list)

    @classmethod
    def of(cls, arrays: Mapping[str, np.ndarray]) -> "Serialised":
        from flwr.common import ndarray_to_bytes

        return cls(list(arrays), [ndarray_to_bytes(np.asarray(a)) for a in arrays.values()])

    @classmethod
    def from_parameters(cls, parameters) -> "Serialised":
        if not parameters.tensors:
            raise PayloadError("empty parameters: expected the names, then the arrays")
        names = _names_of(decode(parameters.tensors[0]))
        if len(names) != len(parameters.tensors) - 1:
            raise PayloadError(f"{len(names)} names for {len(parameters.tensors) - 1} arrays")
        return cls(names, list(parameters.tensors[1:]))

    def prefixed(self, prefix: str) -> "Serialised":
        """The same arrays, each name after ``prefix`` (a cohort member's: 'member/<pid>/')."""
        return Serialised([prefix + n for n in self.names], list(self.tensors))

    @classmethod
    def joined(cls, parts: list["Serialised"]) -> "Serialised":
        """One message of several parts, in one pass (a cohort's message joins hundreds)."""
        names = [n for part in parts for n in part.names]
        if len(set(names)) != len(names):
            repeated = sorted({n for n in names if names.count(n) > 1})
            raise PayloadError(f"arrays named twice in one message: {', '.join(repeated)}")
        return cls(names, [t for part in parts for t in part.tensors])

    def __add__(self, other: "Serialised") -> "Serialised":
        return Serialised.joined([self, other])

    def to_parameters(self):
        from flwr.common import Parameters, ndarray_to_bytes

        return Parameters(
            tensors=[ndarray_to_bytes(_names_array(self.names)), *self.tensors], tensor_type="numpy.ndarray"
        )


def to_parameters(arrays: Mapping[str, np.ndarray]):
    return Serialised.of(arrays).to_parameters()


def from_parameters(parameters) -> Named:
    return from_list([decode(t) for t in parameters.tensors])


def nbytes(parameters) -> int:
    return sum(len(t) for t in parameters.tensors)
