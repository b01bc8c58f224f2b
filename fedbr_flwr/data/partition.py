"""Label partitioners (SPEC section 2 and 3). Pure numpy, seeded, and bounded: none loops forever.

Each partitioner maps a label vector to one index array per client; every sample goes to at most
one client, and every partitioner here assigns every sample (tests check both), but for ``classes`` with
fewer clients x classes each than classes, which ``make_partition`` refuses.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..core import seeds

DIRICHLET_MAX_TRIES = 100


def fedbr_lda(labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """The FedBR authors' "LDA" split: clients are filled one by one with N/num_clients samples each.

    For each client, q ~ Dirichlet(alpha * p) where p are the class proportions still unassigned;
    the client's samples are drawn from q without replacement, and q is renormalised over the
    classes that still have samples whenever one runs out.
    """
    labels = np.asarray(labels)
    classes = np.unique(labels)
    pools = {c: list(rng.permutation(np.flatnonzero(labels == c))) for c in classes}
    sizes = _even_sizes(len(labels), num_clients)
    parts = []
    for size in sizes:
        remaining = np.array([len(pools[c]) for c in classes], dtype=float)
        q = _dirichlet_over_available(alpha * remaining / remaining.sum(), rng)
        counts = np.zeros(len(classes), dtype=int)
        need = size
        for _ in range(len(classes) + 1):  # each pass fills the client or exhausts a class: C + 1 at most
            if need == 0:
                break
            available = remaining - counts
            q = np.where(available > 0, q, 0.0)
            if q.sum() <= 0:
                q = available / available.sum()
            q = q / q.sum()
            draw = np.minimum(rng.multinomial(need, q), available.astype(int))
            counts += draw
            need -= int(draw.sum())
        if need:  # a broken invariant would otherwise loop for ever
            raise RuntimeError(f"the LDA split left {need} of a client's {size} samples unassigned")
        taken = []
        for c, n in zip(classes, counts):
            taken.extend(pools[c][:n])
            del pools[c][:n]
        parts.append(np.sort(np.array(taken, dtype=np.int64)))
    return parts


def _dirichlet_over_available(concentration: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Dirichlet over the entries with positive concentration. Tiny concentrations (alpha * p of
    about 0.01) can underflow to all zeros; then put all mass on one class drawn from the prior."""
    q = np.zeros_like(concentration)
    pos = concentration > 0
    sample = rng.dirichlet(concentration[pos])
    if not np.all(np.isfinite(sample)) or sample.sum() <= 0:
        sample = np.zeros(pos.sum())
        sample[rng.choice(pos.sum(), p=concentration[pos] / concentration[pos].sum())] = 1.0
    q[pos] = sample
    return q


def dirichlet(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator, min_size: int = 2
) -> list[np.ndarray]:
    """Per-class Dirichlet over clients (NIID-Bench, flwr-datasets): class c is split among clients
    in proportions p_c ~ Dir(alpha * 1). Redrawn until every client holds ``min_size`` samples, at
    most DIRICHLET_MAX_TRIES times; then the attempt with the largest smallest client is kept."""
    labels = np.asarray(labels)
    best: list[np.ndarray] = []
    best_min = -1
    for _ in range(DIRICHLET_MAX_TRIES):
        buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == c))
            shares = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(idx)).astype(int)
            for client, chunk in enumerate(np.split(idx, cuts)):
                buckets[client].append(chunk)
        parts = [np.sort(np.concatenate(b)).astype(np.int64) for b in buckets]
        smallest = min(len(p) for p in parts)
        if smallest > best_min:
            best, best_min = parts, smallest
        if smallest >= min_size:
            break
    return best


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    perm = rng.permutation(len(labels))
    return [np.sort(p).astype(np.int64) for p in np.array_split(perm, num_clients)]


def classes_per_client(
    labels: np.ndarray,
    num_clients: int,
    classes_each: int,
    rng: np.random.Generator,
    share_low: float = 0.4,
    share_high: float = 0.6,
) -> list[np.ndarray]:
    """pFedHN split: client i holds classes order[(i*u + j) mod C] for j < u (order a seeded
    permutation), so every class has about the same number of holders; each class is divided among
    its holders with shares s ~ U(share_low, share_high), normalised."""
    labels = np.asarray(labels)
    classes = np.unique(labels)
    if classes_each > len(classes):
        raise ValueError(f"classes_each={classes_each} exceeds the {len(classes)} classes")
    order = rng.permutation(classes)
    held = [[order[(i * classes_each + j) % len(classes)] for j in range(classes_each)] for i in range(num_clients)]
    buckets: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in classes:
        holders = [i for i in range(num_clients) if c in held[i]]
        if not holders:  # fewer clients x classes than classes: the class stays unused
            continue
        idx = rng.permutation(np.flatnonzero(labels == c))
        shares = rng.uniform(share_low, share_high, size=len(holders))
        cuts = (np.cumsum(shares / shares.sum())[:-1] * len(idx)).astype(int)
        for client, chunk in zip(holders, np.split(idx, cuts)):
            buckets[client].append(chunk)
    return [np.sort(np.concatenate(b)).astype(np.int64) if b else np.zeros(0, np.int64) for b in buckets]


def partition(
    labels: np.ndarray, num_clients: int, method: str, seed: int, alpha: float = 0.1, classes_each: int = 2
) -> list[np.ndarray]:
    rng = seeds.rng("partition", seed)
    if method == "fedbr":
        return fedbr_lda(labels, num_clients, alpha, rng)
    if method == "dirichlet":
        return dirichlet(labels, num_clients, alpha, rng)
    if method == "iid":
        return iid(labels, num_clients, rng)
    if method == "classes":
        return classes_per_client(labels, num_clients, classes_each, rng)
    raise ValueError(f"unknown partition '{method}'. Valid: fedbr, dirichlet, iid, classes")


def split_train_test(
    indices: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Hold out ``test_fraction`` of a client's samples (at least one each side when possible)."""
    perm = rng.permutation(indices)
    n_test = int(round(len(perm) * test_fraction))
    if len(perm) >= 2:
        n_test = min(max(n_test, 1), len(perm) - 1)
    return np.sort(perm[n_test:]), np.sort(perm[:n_test])


def _even_sizes(n: int, k: int) -> list[int]:
    return [len(p) for p in np.array_split(np.arange(n), k)]


def partition_hash(parts: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(np.asarray(p, dtype=np.int64).tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def label_skew(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """Mean total-variation distance between each client's label distribution and the global one
    (0 = IID, close to 1 = each client holds one class of many)."""
    labels = np.asarray(labels)
    classes = np.unique(labels)
    glob = np.array([(labels == c).mean() for c in classes])
    tvs = []
    for p in parts:
        if len(p) == 0:
            continue
        local = np.array([(labels[p] == c).mean() for c in classes])
        tvs.append(0.5 * np.abs(local - glob).sum())
    return float(np.mean(tvs))


def class_counts(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """(clients, classes) matrix of how many samples of each class each client holds."""
    labels = np.asarray(labels)
    return np.stack([np.bincount(labels[p], minlength=num_classes) for p in parts])


def heterogeneity_from_counts(counts: np.ndarray) -> float:
    """DisTrans' DH = 1 - sum_j c_j / (N * C) over a (C clients, N classes) count matrix, where c_j is
    the number of clients holding class j, counted as 0 when only one client holds it."""
    counts = np.asarray(counts)
    holders = (counts > 0).sum(axis=0)
    c = np.where(holders > 1, holders, 0)
    return float(1.0 - c.sum() / counts.size)


def distributional_heterogeneity(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """DH of a partition, over the classes present in ``labels``."""
    labels = np.asarray(labels)
    _, dense = np.unique(labels, return_inverse=True)
    return heterogeneity_from_counts(class_counts(dense, parts, int(dense.max()) + 1))
