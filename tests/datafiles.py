"""Small MNIST and CIFAR files in torchvision's on-disk formats, written by the tests themselves, and
the md5 tables patched to trust them (torchvision's tables hold the md5 sums of the real files)."""

from __future__ import annotations

import gzip
import hashlib
import pickle
import struct
import tarfile
from pathlib import Path

import numpy as np
import torchvision.datasets as tvd

from fedbr_flwr.data import catalog

MNIST_STEMS = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def md5(path: Path) -> str:
    return hashlib.md5(Path(path).read_bytes()).hexdigest()


def idx_bytes(arr: np.ndarray) -> bytes:
    """An idx (SN3) file of unsigned bytes: magic 0x0000_08_<ndim>, the sizes, the data."""
    header = struct.pack(">I", 0x0800 | arr.ndim) + b"".join(struct.pack(">I", s) for s in arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def mnist_arrays(n_train: int = 12, n_test: int = 5, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": rng.integers(0, 10, n_train).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test).astype(np.uint8),
    }


def write_mnist(raw: Path, arrays: dict[str, np.ndarray], gz: bool = True) -> None:
    raw.mkdir(parents=True, exist_ok=True)
    for stem, arr in arrays.items():
        payload = idx_bytes(arr)
        if gz:
            (raw / f"{stem}.gz").write_bytes(gzip.compress(payload, mtime=0))
        else:
            (raw / stem).write_bytes(payload)


def trust_mnist(monkeypatch, raw: Path) -> None:
    """Make torchvision's MNIST.resources (.gz md5s) and catalog.MNIST_RAW_MD5 (uncompressed md5s)
    match the files now in ``raw``."""
    resources, plain = [], {}
    for stem in MNIST_STEMS:
        gz = raw / f"{stem}.gz"
        resources.append((f"{stem}.gz", md5(gz) if gz.is_file() else "0" * 32))
        if (raw / stem).is_file():
            plain[stem] = md5(raw / stem)
        elif gz.is_file():
            try:
                plain[stem] = hashlib.md5(gzip.decompress(gz.read_bytes())).hexdigest()
            except Exception:  # a corrupt .gz: its contents have no md5
                plain[stem] = "0" * 32
    monkeypatch.setattr(tvd.MNIST, "resources", resources)
    monkeypatch.setattr(catalog, "MNIST_RAW_MD5", plain)


def cifar_class(name: str):
    return tvd.CIFAR10 if name == "cifar10" else tvd.CIFAR100


def write_cifar(root: Path, name: str, per_file: int = 4, seed: int = 0):
    """Every file of torchvision's list for ``name`` under ``root``; returns the train and test
    (rows, labels) in file order."""
    cls = cifar_class(name)
    rng = np.random.default_rng(seed)
    folder = root / cls.base_folder
    folder.mkdir(parents=True, exist_ok=True)
    key, num_classes = ("labels", 10) if name == "cifar10" else ("fine_labels", 100)
    out = []
    for files in (cls.train_list, cls.test_list):
        rows, labels = [], []
        for filename, _ in files:
            data = rng.integers(0, 256, size=(per_file, 3072), dtype=np.uint8)
            y = rng.integers(0, num_classes, size=per_file).tolist()
            with open(folder / filename, "wb") as f:
                pickle.dump({"batch_label": filename, "data": data, key: y}, f)
            rows.append(data)
            labels += y
        out.append((np.concatenate(rows), np.asarray(labels)))
    with open(folder / cls.meta["filename"], "wb") as f:
        pickle.dump({cls.meta["key"]: [f"class{i}" for i in range(num_classes)]}, f)
    return out[0], out[1]


def trust_cifar(monkeypatch, root: Path, name: str) -> None:
    """Make torchvision's md5 lists for ``name`` match the files now under ``root``."""
    cls = cifar_class(name)
    folder = root / cls.base_folder

    def listed(files):
        return [[f, md5(folder / f) if (folder / f).is_file() else "0" * 32] for f, _ in files]

    monkeypatch.setattr(cls, "train_list", listed(cls.train_list))
    monkeypatch.setattr(cls, "test_list", listed(cls.test_list))
    meta = dict(cls.meta)
    meta["md5"] = md5(folder / meta["filename"])
    monkeypatch.setattr(cls, "meta", meta)


def cifar_tarball(root: Path, name: str, archive: Path) -> Path:
    """torchvision's archive for ``name``: a .tar.gz holding its folder."""
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(root / cifar_class(name).base_folder, arcname=cifar_class(name).base_folder)
    return archive
