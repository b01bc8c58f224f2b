"""Domain shifts, partitions and per-client data, built from the catalogue's raw splits (``catalog``).

Each client process builds only its own partition, once, as normalised float tensors on its training
device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from ..core import seeds
from ..core.attack import flipped_labels, is_label_flipper
from ..core.config import common
from ..core.errors import ConfigError
from ..runfiles import codec
from .catalog import INFO, DatasetInfo, load_raw, source_folder
from .partition import fedbr_lda, partition, partition_hash, split_train_test

ROTATION_STEP = 15.0
ROTATION_DOMAINS = 10  # client i is rotated by 15 * (i mod 10) degrees: 0..135, as in the paper


# ---------------------------------------------------------------- domain shift and normalisation


def client_angle(partition_id: int) -> float:
    return ROTATION_STEP * (partition_id % ROTATION_DOMAINS)


def cifar_angle_prior(partition_id: int, seed: int) -> np.ndarray:
    """RotatedCIFAR10: client's prior over {0, 15, ..., 135} degrees, q ~ Dir(1.0 * uniform/10)."""
    rng = seeds.rng("cifar-angle-prior", seed, partition_id)
    return rng.dirichlet(np.full(ROTATION_DOMAINS, 1.0 / ROTATION_DOMAINS))


def rotate(x: torch.Tensor, angles: np.ndarray) -> torch.Tensor:
    """Rotate each image of a float batch by its angle (bilinear, fill 0), one call per angle."""
    out = x.clone()
    for angle in np.unique(angles):
        if angle == 0:
            continue
        sel = torch.from_numpy(np.flatnonzero(angles == angle))
        out[sel] = rotate_bilinear(x[sel], float(angle))
    return out


def rotate_bilinear(x: torch.Tensor, angle: float) -> torch.Tensor:
    """Images (N, C, H, W) turned ``angle`` degrees counter-clockwise about their centre, bilinear,
    0 where the source falls outside. Bit for bit what torchvision's tensor ``rotate(x, angle,
    BILINEAR, fill=0)`` gives (tests/test_dataset.py checks it), in plain torch: a client process
    that builds RotatedMNIST then never imports torchvision, about 1.4 CPU-s of its start-up."""
    n, _, h, w = x.shape
    grid = _rotation_grid(angle, h, w, x.dtype).expand(n, h, w, 2)
    inside = torch.ones((n, 1, h, w), dtype=x.dtype)
    sampled = torch.nn.functional.grid_sample(
        torch.cat((x, inside), dim=1), grid, mode="bilinear", padding_mode="zeros", align_corners=False
    )
    weight = sampled[:, -1:].expand_as(x)  # how much of each output pixel the source image covers
    return sampled[:, :-1] * weight + (1.0 - weight) * 0.0  # the fill's term, as torchvision adds it (-0.0 -> 0.0)


def _rotation_grid(angle: float, h: int, w: int, dtype: torch.dtype) -> torch.Tensor:
    """grid_sample's grid (1, H, W, 2): the centre of each output pixel, in pixels from the image
    centre, taken back through the rotation to where it samples the source, then scaled to [-1, 1]."""
    t = math.radians(-angle)
    to_source = torch.tensor([[math.cos(t), math.sin(t), 0.0], [-math.sin(t), math.cos(t), 0.0]], dtype=dtype)
    pixels = torch.empty(1, h, w, 3, dtype=dtype)
    pixels[..., 0].copy_(torch.linspace(-w * 0.5 + 0.5, w * 0.5 - 0.5, steps=w))
    pixels[..., 1].copy_(torch.linspace(-h * 0.5 + 0.5, h * 0.5 - 0.5, steps=h).unsqueeze_(-1))
    pixels[..., 2].fill_(1)
    scaled = to_source.unsqueeze(0).transpose(1, 2) / torch.tensor([0.5 * w, 0.5 * h], dtype=dtype)
    return pixels.view(1, h * w, 3).bmm(scaled).view(1, h, w, 2)


def to_float(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).float().div_(255.0)


def normalise(x: torch.Tensor, info: DatasetInfo) -> torch.Tensor:
    mean = torch.tensor(info.mean).view(1, -1, 1, 1)
    std = torch.tensor(info.std).view(1, -1, 1, 1)
    return (x - mean) / std


def domain_rotation(cfg: Mapping[str, Any]) -> str:
    """How this run turns its clients' images: the dataset's rotation kind under rotate=true, else "none"."""
    run = common(cfg)
    return INFO[run.dataset].rotation if run.rotate else "none"


def image_angles(cfg: Mapping[str, Any], partition_id: int, n: int) -> np.ndarray:
    """Rotation of each of a client's n images under the configured domain shift."""
    run = common(cfg)
    rotation = domain_rotation(cfg)
    if rotation == "none":
        return np.zeros(n)
    if rotation == "client":
        return np.full(n, client_angle(partition_id))
    rng = seeds.rng("cifar-angles", run.seed, partition_id)
    choices = ROTATION_STEP * np.arange(ROTATION_DOMAINS)
    return rng.choice(choices, size=n, p=cifar_angle_prior(partition_id, run.seed))


# ---------------------------------------------------------------- per-client data


@dataclass
class ClientData:
    partition_id: int
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    augment: bool  # random crop (pad 4) + horizontal flip on every training batch (DatasetInfo.augment)
    border: tuple[float, ...] = ()  # a black pixel after normalisation: what the crop's padding holds


PARTITION_KEYS = ("num-clients", "partition", "alpha", "classes-per-client", "seed")


def make_partition(cfg: Mapping[str, Any]) -> tuple[list[np.ndarray], str]:
    run = common(cfg)
    parts = _cached_partition(
        run.dataset,
        source_folder(run.dataset, run.data_dir),
        run.download,
        *(cfg[k] for k in PARTITION_KEYS),
    )
    return parts, partition_hash(parts)


@lru_cache(maxsize=4)
def _cached_partition(dataset, folder, download, num_clients, method, alpha, classes_each, seed):
    train, _ = load_raw(dataset, folder, download)
    if 2 * num_clients > len(train.y):
        raise ConfigError(
            f"num-clients = {num_clients} but {dataset} has {len(train.y)} training samples: every "
            "client needs at least 2 (one to train on, one to test on)"
        )
    classes = len(np.unique(train.y))
    if method == "classes" and num_clients * classes_each < classes:
        raise ConfigError(
            f"partition=classes with {num_clients} clients of {classes_each} class(es) each holds "
            f"{num_clients * classes_each} of the {classes} classes of {dataset}: the others' samples would go to "
            "no client (use more clients or a larger 'classes-per-client')"
        )
    parts = partition(train.y, num_clients, method, seed, alpha=alpha, classes_each=classes_each)
    empty = [i for i, p in enumerate(parts) if len(p) < 2]
    if empty:
        raise ConfigError(
            f"partition '{method}' left client(s) {empty[:10]} with fewer than 2 samples "
            f"({len(train.y)} samples over {num_clients} clients): use fewer clients or a larger alpha"
        )
    return parts


def client_indices(cfg: Mapping[str, Any], partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    run = common(cfg)
    parts, _ = make_partition(cfg)
    rng = seeds.rng("client-split", run.seed, partition_id)
    return split_train_test(parts[partition_id], run.test_fraction, rng)


def one_class_per_client(cfg: Mapping[str, Any]) -> bool:
    run = common(cfg)
    return run.partition == "classes" and run.classes_per_client == 1


def other_class_test_indices(cfg: Mapping[str, Any], partition_id: int) -> np.ndarray:
    """Indices into the dataset's test split of the images added to a client's local test set: with one
    class per client (DisTrans' 100% heterogeneity) as many images of the other classes as its local test
    holds of its own, drawn at random without replacement from the test split (which no client trains on),
    as the DisTrans paper does, so that predicting the client's one class does not score 100%. Otherwise none."""
    run = common(cfg)
    if not one_class_per_client(cfg):
        return np.empty(0, dtype=np.int64)
    train, test = load_raw(run.dataset, run.data_dir, run.download)
    _, test_idx = client_indices(cfg, partition_id)
    others = np.flatnonzero(~np.isin(test.y, np.unique(train.y[test_idx])))
    if len(test_idx) > len(others):
        raise ConfigError(
            f"client {partition_id}'s local test holds {len(test_idx)} images of its class but {run.dataset}'s "
            f"test split only {len(others)} of the others: lower test-fraction"
        )
    rng = seeds.rng("other-class-test", run.seed, partition_id)
    return np.sort(rng.choice(others, size=len(test_idx), replace=False))


def save_partition(cfg: Mapping[str, Any], path: Path) -> str:
    """Write every client's train and test indices (into the dataset's training split) to an .npz
    file (arrays ``train_<i>``, ``test_<i>``; with one class per client also ``test_others_<i>``, into the
    test split); return the partition hash."""
    arrays = {}
    for pid in range(common(cfg).num_clients):
        arrays[f"train_{pid}"], arrays[f"test_{pid}"] = client_indices(cfg, pid)
        if one_class_per_client(cfg):
            arrays[f"test_others_{pid}"] = other_class_test_indices(cfg, pid)
    codec.write(path, arrays, compressed=True)
    return make_partition(cfg)[1]


def partition_sizes(cfg: Mapping[str, Any]) -> dict[int, tuple[int, int]]:
    """Every client's (training, local test) sample counts, from the server's own partition."""
    sizes = {}
    for pid in range(common(cfg).num_clients):
        train, test = client_indices(cfg, pid)
        sizes[pid] = (len(train), len(test) + len(other_class_test_indices(cfg, pid)))
    return sizes


def partition_class_counts(cfg: Mapping[str, Any]) -> dict[int, np.ndarray]:
    """Every client's training samples per class (true labels), from the server's own partition."""
    run = common(cfg)
    train, _ = load_raw(run.dataset, run.data_dir, run.download)
    classes = INFO[run.dataset].num_classes
    return {pid: np.bincount(train.y[client_indices(cfg, pid)[0]], minlength=classes) for pid in range(run.num_clients)}


def load_client_data(cfg: Mapping[str, Any], partition_id: int, device: torch.device | str) -> ClientData:
    """This client's train/test tensors on ``device``. The node's client cache (``fedbr_flwr.app.node``)
    keeps them with the client that uses them, for as long as it keeps that client."""
    run = common(cfg)
    if not 0 <= partition_id < run.num_clients:
        raise ConfigError(f"partition-id {partition_id} outside 0..{run.num_clients - 1}")
    device = torch.device(device)
    info = INFO[run.dataset]
    train, test = load_raw(run.dataset, run.data_dir, run.download)
    train_idx, test_idx = client_indices(cfg, partition_id)
    own = np.concatenate([train_idx, test_idx])
    images, labels = train.x[own], train.y[own]
    others = other_class_test_indices(cfg, partition_id)
    if len(others):  # after its own test images, under the client's rotation like them
        images, labels = np.concatenate([images, test.x[others]]), np.concatenate([labels, test.y[others]])
    x = normalise(rotate(to_float(images), image_angles(cfg, partition_id, len(labels))), info)
    y = torch.from_numpy(labels)
    n = len(train_idx)
    if is_label_flipper(cfg, partition_id):  # a simulated attacker trains on flipped labels (its test set keeps them)
        y = torch.cat([flipped_labels(y[:n], info.num_classes), y[n:]])
    return ClientData(
        partition_id=partition_id,
        x_train=x[:n].to(device),
        y_train=y[:n].to(device),
        x_test=x[n:].to(device),
        y_test=y[n:].to(device),
        num_classes=info.num_classes,
        augment=info.augment,
        border=normalised_black(info),
    )


@dataclass
class PackedPartitions:
    """A cohort's training partitions one after another in one tensor on the device; each member's
    ``x_train``/``y_train`` is a view of its rows, so the cohort's data lives on the device once and every
    member's batch of a step comes from one gather. The rows are not padded to the longest partition: Dirichlet
    partitions differ in length many times over, and padding would hold clients x longest images."""

    x: torch.Tensor
    y: torch.Tensor
    offsets: dict[int, int]  # partition id -> its first row


def pack_partitions(
    members: Mapping[int, ClientData], device: torch.device | str
) -> tuple[dict[int, ClientData], PackedPartitions]:
    """``members`` (loaded anywhere, e.g. on the host) on ``device``: their training partitions packed into one
    tensor, which their own ``x_train``/``y_train`` view."""
    x = torch.cat([d.x_train for d in members.values()]).to(device)
    y = torch.cat([d.y_train for d in members.values()]).to(device)
    packed, offsets, start = {}, {}, 0
    for pid, data in members.items():
        n = len(data.y_train)
        offsets[pid] = start
        packed[pid] = replace(
            data,
            x_train=x[start : start + n],
            y_train=y[start : start + n],
            x_test=data.x_test.to(device),
            y_test=data.y_test.to(device),
        )
        start += n
    return packed, PackedPartitions(x, y, offsets)


def load_cohort_data(
    cfg: Mapping[str, Any], partition_ids: list[int], device: torch.device | str
) -> tuple[dict[int, ClientData], PackedPartitions]:
    """A cohort's clients' data on ``device``, their training partitions packed (``pack_partitions``)."""
    return pack_partitions({pid: load_client_data(cfg, pid, "cpu") for pid in partition_ids}, device)


def global_test_angles(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    """The angles of the balanced global test's copies: 0, 15, ..., 135 under rotation (RotatedMNIST,
    RotatedCIFAR10), else one unrotated copy."""
    if domain_rotation(cfg) != "none":
        return tuple(int(ROTATION_STEP) * k for k in range(ROTATION_DOMAINS))
    return (0,)


@dataclass
class ServerTests:
    """The test environments the server evaluates the global model on, built from the dataset's test
    split (normalised, on the CPU): the balanced global test, one full copy per angle (the paper's Table
    6), and RotatedMNIST's extra local tests (``extra_local``: set k rotated 15*k), each ``(x, y)``."""

    global_copies: dict[int, tuple[torch.Tensor, torch.Tensor]]  # angle -> the test split rotated by it
    extra_local: list[tuple[torch.Tensor, torch.Tensor]]


def load_server_tests(cfg: Mapping[str, Any]) -> ServerTests | None:
    """What ``global-test`` and ``extra-local-tests`` ask for, or None when neither is on. Neither depends
    on the number of clients, which the server learns only when the clients answer."""
    run = common(cfg)
    if not run.global_test and not run.extra_local_tests:
        return None
    return ServerTests(
        load_global_test(cfg) if run.global_test else {},
        load_extra_local_tests(cfg) if run.extra_local_tests else [],
    )


def load_global_test(cfg: Mapping[str, Any]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The balanced global test: the whole test split once per angle of ``global_test_angles`` (the 0
    degree copy unrotated), as the reference code builds its test environments."""
    run = common(cfg)
    info = INFO[run.dataset]
    _, test = load_raw(run.dataset, run.data_dir, run.download)
    images, labels = to_float(test.x), torch.from_numpy(test.y)
    return {
        angle: (normalise(rotate(images, np.full(len(labels), angle)), info), labels)
        for angle in global_test_angles(cfg)
    }


def extra_local_test_indices(labels: np.ndarray, alpha: float, seed: int) -> list[np.ndarray]:
    """RotatedMNIST's extra local tests (the reference code's): the test split dealt into 10 sets of
    len/10 images by the authors' "LDA" draw (``fedbr_lda``: each set's class mix a fresh Dirichlet draw),
    without replacement, from a seed stream of their own: 1000 images each for MNIST, 50 for mnist5k."""
    return fedbr_lda(labels, ROTATION_DOMAINS, alpha, seeds.rng("extra-local-tests", seed))


def load_extra_local_tests(cfg: Mapping[str, Any]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The 10 extra local test sets, set k rotated by 15*k degrees (unrotated with rotate=false)."""
    run = common(cfg)
    info = INFO[run.dataset]
    _, test = load_raw(run.dataset, run.data_dir, run.download)
    sets = []
    for k, idx in enumerate(extra_local_test_indices(test.y, run.alpha, run.seed)):
        angle = client_angle(k) if run.rotate else 0.0
        sets.append(
            (normalise(rotate(to_float(test.x[idx]), np.full(len(idx), angle)), info), torch.from_numpy(test.y[idx]))
        )
    return sets


def normalised_black(info: DatasetInfo) -> tuple[float, ...]:
    return tuple(normalise(torch.zeros(1, len(info.mean), 1, 1), info).flatten().tolist())


def random_crop_flip(
    x: torch.Tensor, generator: torch.Generator, pad: int = 4, border: tuple[float, ...] = ()
) -> torch.Tensor:
    """Batched RandomCrop(size, padding=pad) + RandomHorizontalFlip, without a per-image loop. The
    batch is already normalised, so the padding holds ``border`` (per channel; default 0): the
    normalised black pixel that torchvision's crop-then-normalise order pads with."""
    b, c, h, w = x.shape
    padded = x.new_zeros(b, c, h + 2 * pad, w + 2 * pad)
    if border:
        padded[:] = torch.tensor(border, dtype=x.dtype, device=x.device).view(1, c, 1, 1)
    padded[:, :, pad : pad + h, pad : pad + w] = x
    dev = x.device
    oy = torch.randint(0, 2 * pad + 1, (b,), device=dev, generator=generator)
    ox = torch.randint(0, 2 * pad + 1, (b,), device=dev, generator=generator)
    rows = (oy[:, None] + torch.arange(h, device=dev))[:, None, :, None]
    cols = ox[:, None] + torch.arange(w, device=dev)
    flip = torch.rand(b, device=dev, generator=generator) < 0.5
    cols = torch.where(flip[:, None], cols.flip(1), cols)[:, None, None, :]
    bi = torch.arange(b, device=dev)[:, None, None, None]
    ci = torch.arange(c, device=dev)[None, :, None, None]
    return padded[bi, ci, rows, cols]
