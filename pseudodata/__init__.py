"""FedBR's globally shared, label-agnostic pseudo-data (paper section 4.2, Algorithms 2 and 3).

``rsm``: each pseudo-sample is the mean of M samples of ONE client, computed on that client; only
the means leave it, and the server assembles the B of them. ``mixture``: means of a public proxy
dataset, mixed on each client at each step with K local samples. Both are Flower-free; the FedBR
strategy and client move them through Flower messages with ``encode``/``decode``.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

if TYPE_CHECKING:
    import torch


def uniform_labels(count: int, num_classes: int) -> np.ndarray:
    """The label-agnostic pseudo-label 1/C for every class."""
    return np.full((count, num_classes), 1.0 / num_classes, dtype=np.float32)


def encode(x: np.ndarray, y: np.ndarray) -> bytes:
    """Pseudo-data as bytes for a Flower config value (float32 arrays, no pickle)."""
    buffer = io.BytesIO()
    np.savez(buffer, x=np.asarray(x, dtype=np.float32), y=np.asarray(y, dtype=np.float32))
    return buffer.getvalue()


def decode(payload: bytes) -> tuple[np.ndarray, np.ndarray]:
    with np.load(io.BytesIO(payload), allow_pickle=False) as arrays:
        return arrays["x"], arrays["y"]


def build(cfg: Mapping[str, Any], version: int, partition_ids: list[int],
          collect_means: Callable[[dict[int, int], int], list[np.ndarray]],
          proxy: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The pseudo-batch (x, uniform labels) of one version. RSM: ``collect_means({pid: count}, version)`` must
    return each listed client's means, in the order of the mapping (partition order). Mixture: B means
    of M samples of ``proxy``, seeded by (seed, version)."""
    import torch

    from fedbr_flwr.config import pseudo_size
    from fedbr_flwr.dataset import INFO
    from fedbr_flwr.training import step_seed

    from .rsm import allot, assemble, sample_means

    size = pseudo_size(cfg)
    if cfg["pseudo-data"] == "rsm":
        counts = {pid: n for pid, n in sorted(allot(size, partition_ids, cfg["seed"], version).items()) if n > 0}
        x = assemble(collect_means(counts, version))
    else:
        if proxy is None:
            raise ValueError("mixture pseudo-data needs the proxy dataset")
        generator = torch.Generator().manual_seed(step_seed(cfg["seed"], version, 103))
        x = sample_means(proxy, size, cfg["pseudo-m"], generator).numpy()
    if len(x) != size:
        raise RuntimeError(f"pseudo-data has {len(x)} samples, {size} were asked for")
    return x, uniform_labels(size, INFO[cfg["dataset"]].num_classes)
