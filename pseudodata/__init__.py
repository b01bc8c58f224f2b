"""FedBR's globally shared, label-agnostic pseudo-data (paper section 4.2, Algorithms 2 and 3).

``rsm``: each pseudo-sample is the mean of M samples of ONE client, computed on that client; only
the means leave it, and the server assembles the B of them. ``mixture``: means of a public proxy
dataset, mixed on each client at each step with K local samples. Both are Flower-free: FedBR's
client and strategy files move them (a named request for the RSM means, a broadcast for the batch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from fedbr_flwr.core.config import common
from fedbr_flwr.data.catalog import INFO

if TYPE_CHECKING:
    import torch


def uniform_labels(count: int, num_classes: int) -> np.ndarray:
    """The label-agnostic pseudo-label 1/C for every class."""
    return np.full((count, num_classes), 1.0 / num_classes, dtype=np.float32)


def pseudo_size(cfg: Mapping[str, Any]) -> int:
    """B: the pseudo-batch size (pseudo-size, or the batch size when 0)."""
    return cfg["pseudo-size"] or common(cfg).batch_size


def proxy_dataset(cfg: Mapping[str, Any]) -> str:
    """Mixture's public dataset: proxy-dataset, or by the run's dataset when 'auto'."""
    if cfg["proxy-dataset"] != "auto":
        return cfg["proxy-dataset"]
    return INFO[common(cfg).dataset].proxy


def build(
    cfg: Mapping[str, Any],
    version: int,
    partition_ids: list[int],
    collect_means: Callable[[dict[int, int], int], list[np.ndarray]],
    proxy: torch.Tensor | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The pseudo-batch (x, uniform labels) of one version. RSM: ``collect_means({pid: count}, version)`` must
    return each listed client's means, in the order of the mapping (partition order). Mixture: B means
    of M samples of ``proxy``, seeded by (seed, version)."""
    run = common(cfg)
    from fedbr_flwr.core import seeds

    from .rsm import allot, assemble, sample_means

    size = pseudo_size(cfg)
    if cfg["pseudo-data"] == "rsm":
        counts = {pid: n for pid, n in sorted(allot(size, partition_ids, run.seed, version).items()) if n > 0}
        x = assemble(collect_means(counts, version))
    else:
        if proxy is None:
            raise ValueError("mixture pseudo-data needs the proxy dataset")
        generator = seeds.torch_generator("mixture-means", run.seed, version)
        x = sample_means(proxy, size, cfg["pseudo-m"], generator).numpy()
    if len(x) != size:
        raise RuntimeError(f"pseudo-data has {len(x)} samples, {size} were asked for")
    return x, uniform_labels(size, INFO[run.dataset].num_classes)
