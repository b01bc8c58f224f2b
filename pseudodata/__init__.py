"""FedBR's globally shared, label-agnostic pseudo-data (paper section 4.2, Algorithms 2 and 3).

``rsm``: each pseudo-sample is the mean of M samples of ONE client, computed on that client; only
the means leave it, and the server assembles the B of them. ``mixture``: means of a public proxy
dataset, mixed on each client at each step with K local samples. Both are Flower-free: FedBR's
client and strategy files move them (a named request for the RSM means, a broadcast for the batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from fedbr_flwr.core.config import common
from fedbr_flwr.core.settings import NON_NEGATIVE, POSITIVE, Settings, setting
from fedbr_flwr.data.catalog import INFO

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class PseudoDataSettings(Settings):
    """The pseudo-data's keys, read here; FedBR's settings (clients/fedbr.py) take them over."""

    pseudo_data: str = setting(
        "pseudo-data",
        "rsm",
        "FedBR pseudo-data: rsm (means of M samples of one client) or "
        "mixture (means of a public proxy dataset mixed with K local samples each step)",
        choices=("rsm", "mixture"),
    )
    pseudo_size: int = setting(
        "pseudo-size",
        0,
        "pseudo-samples B; 0 = batch-size (component 2 pairs them with the local batch)",
        check=NON_NEGATIVE,
    )
    pseudo_m: int = setting(
        "pseudo-m", 10, "local (RSM) or proxy (mixture) samples averaged into one pseudo-sample", check=POSITIVE
    )
    mixture_k: int = setting(
        "mixture-k", 1, "local samples mixed into each pseudo-sample per step (mixture)", check=NON_NEGATIVE
    )
    proxy_dataset: str = setting(
        "proxy-dataset",
        "auto",
        "public dataset for mixture pseudo-data, read from "
        "the data folder; auto: cifar100 for cifar10, cifar10 for cifar100, mnist5k for MNIST",
        choices=("auto", *INFO),
    )
    pseudo_refresh: str = setting(
        "pseudo-refresh",
        "once",
        "send the pseudo-data once (at round 1) or rebuild it every round",
        choices=("once", "every-round"),
    )


def uniform_labels(count: int, num_classes: int) -> np.ndarray:
    """The label-agnostic pseudo-label 1/C for every class."""
    return np.full((count, num_classes), 1.0 / num_classes, dtype=np.float32)


def pseudo_size(cfg: Mapping[str, Any]) -> int:
    """B: the pseudo-batch size (pseudo-size, or the batch size when 0)."""
    return PseudoDataSettings.from_config(cfg).pseudo_size or common(cfg).batch_size


def proxy_dataset(cfg: Mapping[str, Any]) -> str:
    """Mixture's public dataset: proxy-dataset, or by the run's dataset when 'auto'."""
    name = PseudoDataSettings.from_config(cfg).proxy_dataset
    return name if name != "auto" else INFO[common(cfg).dataset].proxy


def build(
    cfg: Mapping[str, Any],
    version: int,
    partition_ids: list[int],
    collect_means: Callable[[dict[int, int], int], list[np.ndarray]],
    proxy: torch.Tensor | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The pseudo-batch (x, uniform labels) of one version. RSM: ``collect_means({pid: count}, version)``
    returns the means of the listed clients that sent usable ones, in the order of the mapping (partition
    order); the share of a client left out is filled by repeating the others' (``assemble``). Mixture: B means
    of M samples of ``proxy``, seeded by (seed, version)."""
    run = common(cfg)
    from fedbr_flwr.core import seeds

    from .rsm import allot, assemble, sample_means

    size, own = pseudo_size(cfg), PseudoDataSettings.from_config(cfg)
    if own.pseudo_data == "rsm":
        counts = {pid: n for pid, n in sorted(allot(size, partition_ids, run.seed, version).items()) if n > 0}
        x = assemble(collect_means(counts, version), size)
    else:
        if proxy is None:
            raise ValueError("mixture pseudo-data needs the proxy dataset")
        generator = seeds.torch_generator("mixture-means", run.seed, version)
        x = sample_means(proxy, size, own.pseudo_m, generator).numpy()
    return x, uniform_labels(size, INFO[run.dataset].num_classes)
