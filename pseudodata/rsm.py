"""Random Sample Means (FedMix-style, paper Algorithm 2), split between client and server."""

from __future__ import annotations

import numpy as np
import torch

from fedbr_flwr.core import seeds


def allot(total: int, partition_ids: list[int], seed: int, version: int) -> dict[int, int]:
    """How many means each client contributes so that there are exactly ``total``: an equal share,
    and the remainder one each to clients drawn at random (seeded)."""
    pids = sorted(partition_ids)
    if not pids:
        raise ValueError("no clients to build pseudo-data from")
    base, extra = divmod(total, len(pids))
    counts = {pid: base for pid in pids}
    rng = seeds.rng("rsm-allotment", seed, version)
    for pid in rng.choice(pids, size=extra, replace=False):
        counts[int(pid)] += 1
    return counts


def sample_means(x: torch.Tensor, count: int, m: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` means, each of ``m`` distinct random samples of ``x`` (with replacement across
    means; within a mean only when ``x`` holds fewer than ``m`` samples)."""
    n = len(x)
    if count == 0:
        return x.new_zeros((0, *x.shape[1:]))
    if n == 0:
        raise ValueError("cannot build pseudo-data from a client with no training samples")
    if n >= m:
        keys = torch.rand((count, n), generator=generator, device=generator.device)
        idx = keys.argsort(dim=1)[:, :m].to(x.device)
    else:
        idx = torch.randint(0, n, (count, m), generator=generator, device=generator.device).to(x.device)
    return x[idx].mean(dim=1)


def assemble(means: list[np.ndarray], size: int) -> np.ndarray:
    """The pseudo-batch of ``size``: the clients' means in the order given (the server passes partition order).
    Where clients were left out (their answers could not be used), the means that came are repeated from the
    first on until there are ``size``: component 2 pairs every sample of a batch with one of them."""
    parts = [np.asarray(part, dtype=np.float32) for part in means if len(part)]
    if not parts:
        raise RuntimeError("no client sent pseudo-data means that can be used (the lines above say why)")
    x = np.concatenate(parts)
    return x if len(x) >= size else np.resize(x, (size, *x.shape[1:]))
