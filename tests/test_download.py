"""The data folder, downloads through torchvision (from a local server: no internet here), corrupt
files, and full MNIST giving the same arrays and partitions as before the move to torchvision."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import torchvision.datasets as tvd

from fedbr_flwr.commands import cli
from fedbr_flwr.core.config import ConfigError, validate
from fedbr_flwr.data import catalog, dataset

from datafiles import (
    MNIST_STEMS,
    cifar_class,
    cifar_tarball,
    md5,
    mnist_arrays,
    trust_cifar,
    trust_mnist,
    write_cifar,
    write_mnist,
)


@pytest.fixture(autouse=True)
def fresh_caches():
    catalog.load_raw.cache_clear()
    dataset._cached_partition.cache_clear()
    yield
    catalog.load_raw.cache_clear()
    dataset._cached_partition.cache_clear()


def one_line_error(exc_info) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


# ---------------------------------------------------------------- the data folder


def test_data_dir_wins_and_is_made_absolute(monkeypatch, tmp_path):
    monkeypatch.setenv("FEDBR_DATA_DIR", str(tmp_path / "env"))
    monkeypatch.chdir(tmp_path)
    assert catalog.data_folder("given") == tmp_path / "given"
    assert catalog.data_folder(str(tmp_path / "abs")) == tmp_path / "abs"


def test_env_var_is_the_default_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("FEDBR_DATA_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert catalog.data_folder("") == tmp_path / "env"


def test_xdg_cache_then_home_cache_are_the_default_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("FEDBR_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert catalog.data_folder("") == tmp_path / "xdg" / "fedbr-flwr" / "datasets"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for xdg in ("", "relative/cache"):  # unset, or relative (which the XDG spec says to ignore)
        monkeypatch.setenv("XDG_CACHE_HOME", xdg)
        assert catalog.data_folder("") == tmp_path / "home" / ".cache" / "fedbr-flwr" / "datasets"


def test_file_datasets_load_from_the_default_folder_without_data_dir(monkeypatch, tmp_path):
    arrays = mnist_arrays(n_train=20)
    write_mnist(tmp_path / "env" / "MNIST" / "raw", arrays)
    trust_mnist(monkeypatch, tmp_path / "env" / "MNIST" / "raw")
    monkeypatch.setenv("FEDBR_DATA_DIR", str(tmp_path / "env"))
    cfg = validate({"dataset": "mnist", "num-clients": 2, "download": "never"})  # no data-dir needed
    parts, _ = dataset.make_partition(cfg)
    assert sorted(np.concatenate(parts)) == list(range(20))
    train, _ = catalog.load_raw("mnist", "", "never")
    np.testing.assert_array_equal(train.y, arrays["train-labels-idx1-ubyte"])


@pytest.mark.parametrize(
    "name, missing",
    [
        ("mnist", "MNIST/raw/train-images-idx3-ubyte.gz"),
        ("cifar10", "cifar-10-batches-py/data_batch_1"),
        ("cifar100", "cifar-100-python/train"),
    ],
)
def test_download_never_on_an_empty_folder_says_where_and_how(monkeypatch, tmp_path, name, missing):
    empty = tmp_path / "empty"
    monkeypatch.setenv("FEDBR_DATA_DIR", str(empty))
    with pytest.raises(ConfigError) as err:
        catalog.load_raw(name, "", "never")
    msg = one_line_error(err)
    assert str(empty) in msg and missing in msg
    assert "FEDBR_DATA_DIR" in msg and "data-dir=" in msg and "download=never" in msg
    assert (
        f"torchvision.datasets.{cifar_class(name).__name__ if name != 'mnist' else 'MNIST'}('{empty}', "
        "download=True)" in msg
    )
    assert not empty.exists()  # never: nothing written


def test_config_download_key():
    assert validate({})["download"] == "auto"
    assert validate({"download": "never"})["download"] == "never"
    with pytest.raises(ConfigError, match="'download' = 'sometimes' is not one of: auto, never"):
        validate({"download": "sometimes"})


# ---------------------------------------------------------------- downloads from a local server


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # torchvision's redirect probe closes its connection before reading the body


@pytest.fixture
def server(tmp_path):
    """A folder served over HTTP on 127.0.0.1, stopped after the test (pass or fail)."""
    served = tmp_path / "served"
    served.mkdir()
    httpd = QuietServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(served)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield served, f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


@pytest.fixture
def mnist_mirror(server, monkeypatch):
    """Valid small MNIST .gz files on the local server, torchvision's mirror list and md5s pointing at them."""
    served, url = server
    arrays = mnist_arrays()
    write_mnist(served / "mnist", arrays)
    trust_mnist(monkeypatch, served / "mnist")
    monkeypatch.setattr(tvd.MNIST, "mirrors", [f"{url}/mnist/"])
    return served / "mnist", arrays


def test_mnist_downloads_into_an_empty_folder(mnist_mirror, tmp_path, monkeypatch):
    _, arrays = mnist_mirror
    monkeypatch.setenv("FEDBR_DATA_DIR", str(tmp_path / "data"))
    train, test = catalog.load_raw("mnist", "", "auto")
    np.testing.assert_array_equal(train.x[:, 0], arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(train.y, arrays["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(test.x[:, 0], arrays["t10k-images-idx3-ubyte"])
    np.testing.assert_array_equal(test.y, arrays["t10k-labels-idx1-ubyte"])
    assert train.x.shape == (12, 1, 28, 28) and train.y.dtype == np.int64
    raw = tmp_path / "data" / "MNIST" / "raw"
    assert all((raw / f"{stem}.gz").is_file() for stem in MNIST_STEMS)
    # then it reads the folder offline
    catalog.load_raw.cache_clear()
    monkeypatch.setattr(tvd.MNIST, "mirrors", ["http://127.0.0.1:1/"])
    np.testing.assert_array_equal(catalog.load_raw("mnist", "", "never")[0].y, train.y)


def test_mnist_download_fetches_only_what_is_missing(mnist_mirror, tmp_path):
    served, arrays = mnist_mirror
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    shutil.copy(served / "train-images-idx3-ubyte.gz", raw)
    (served / "train-images-idx3-ubyte.gz").unlink()  # the server lacks it: it must not be fetched again
    train, _ = catalog.load_mnist(str(tmp_path), "auto")
    np.testing.assert_array_equal(train.x[:, 0], arrays["train-images-idx3-ubyte"])


def test_mnist_download_with_a_bad_md5_stops(mnist_mirror, tmp_path):
    served, _ = mnist_mirror
    path = served / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-10])  # the served file no longer matches torchvision's md5
    with pytest.raises(ConfigError) as err:
        catalog.load_mnist(str(tmp_path / "data"), "auto")
    msg = one_line_error(err)
    assert "download=auto failed" in msg and "t10k-images-idx3-ubyte.gz" in msg and str(tmp_path / "data") in msg


def test_mnist_download_offline_stops(monkeypatch, tmp_path):
    monkeypatch.setattr(tvd.MNIST, "mirrors", ["http://127.0.0.1:1/"])  # nothing listens there
    with pytest.raises(ConfigError) as err:
        catalog.load_mnist(str(tmp_path / "data"), "auto")
    msg = one_line_error(err)
    assert "download=auto failed" in msg and str(tmp_path / "data") in msg and "download=True" in msg


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_downloads_into_an_empty_folder(server, monkeypatch, tmp_path, name):
    served, url = server
    cls = cifar_class(name)
    source = tmp_path / "source"
    (train_rows, train_y), (test_rows, test_y) = write_cifar(source, name)
    trust_cifar(monkeypatch, source, name)
    archive = cifar_tarball(source, name, served / cls.filename)
    monkeypatch.setattr(cls, "url", f"{url}/{cls.filename}")
    monkeypatch.setattr(cls, "tgz_md5", md5(archive))
    train, test = catalog.load_cifar(name, str(tmp_path / "data"), "auto")
    assert train.x.shape == (len(train_y), 3, 32, 32) and train.x.dtype == np.uint8 and train.y.dtype == np.int64
    np.testing.assert_array_equal(train.x.reshape(len(train_y), -1), train_rows)  # channel-major rows
    np.testing.assert_array_equal(train.y, train_y)
    np.testing.assert_array_equal(test.x.reshape(len(test_y), -1), test_rows)
    np.testing.assert_array_equal(test.y, test_y)
    assert (tmp_path / "data" / cls.base_folder / cls.test_list[0][0]).is_file()


def test_cifar_download_with_a_bad_md5_stops(server, monkeypatch, tmp_path):
    served, url = server
    source = tmp_path / "source"
    write_cifar(source, "cifar10")
    trust_cifar(monkeypatch, source, "cifar10")
    archive = cifar_tarball(source, "cifar10", served / tvd.CIFAR10.filename)
    monkeypatch.setattr(tvd.CIFAR10, "url", f"{url}/{tvd.CIFAR10.filename}")
    monkeypatch.setattr(tvd.CIFAR10, "tgz_md5", md5(archive))
    archive.write_bytes(archive.read_bytes()[:-100])  # corrupted on the server
    with pytest.raises(ConfigError) as err:
        catalog.load_cifar("cifar10", str(tmp_path / "data"), "auto")
    msg = one_line_error(err)
    assert "download=auto failed" in msg and str(tmp_path / "data") in msg


# ---------------------------------------------------------------- corrupt files


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


CORRUPTIONS = {
    # name: (files written gzipped?, how to damage the folder, the file the message must name)
    "truncated train-images gz": (
        True,
        lambda raw: _truncate(raw / "train-images-idx3-ubyte.gz"),
        "train-images-idx3-ubyte.gz",
    ),
    "truncated t10k-images gz": (
        True,
        lambda raw: _truncate(raw / "t10k-images-idx3-ubyte.gz"),
        "t10k-images-idx3-ubyte.gz",
    ),
    "garbage gz": (
        True,
        lambda raw: (raw / "t10k-labels-idx1-ubyte.gz").write_bytes(os.urandom(300)),
        "t10k-labels-idx1-ubyte.gz",
    ),
    "empty file": (
        True,
        lambda raw: (raw / "train-labels-idx1-ubyte.gz").write_bytes(b""),
        "train-labels-idx1-ubyte.gz",
    ),
    "truncated raw idx": (False, lambda raw: _truncate(raw / "train-images-idx3-ubyte"), "train-images-idx3-ubyte"),
    "t10k labels over train labels": (
        True,
        lambda raw: shutil.copy(raw / "t10k-labels-idx1-ubyte.gz", raw / "train-labels-idx1-ubyte.gz"),
        "train-labels-idx1-ubyte.gz",
    ),
}


@pytest.mark.parametrize("md5_matches", [False, True], ids=["md5-differs", "md5-matches"])
@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_mnist_file_stops_naming_it(monkeypatch, tmp_path, case, md5_matches):
    """Caught by the md5 check; and, should a file match its md5 anyway (edited tables), by reading."""
    gz, damage, culprit = CORRUPTIONS[case]
    raw = tmp_path / "MNIST" / "raw"
    write_mnist(raw, mnist_arrays(), gz=gz)
    trust_mnist(monkeypatch, raw)
    damage(raw)
    if md5_matches:
        trust_mnist(monkeypatch, raw)
    with pytest.raises(ConfigError) as err:
        catalog.load_mnist(str(tmp_path), "never")
    msg = one_line_error(err)
    assert str(raw / culprit) in msg and "corrupt" in msg


def test_real_md5_tables_refuse_other_files(tmp_path):
    """Without patched tables, files that are not the real MNIST never load."""
    raw = tmp_path / "MNIST" / "raw"
    write_mnist(raw, mnist_arrays())
    with pytest.raises(ConfigError, match="train-images-idx3-ubyte.gz is corrupt or incomplete .md5"):
        catalog.load_mnist(str(tmp_path), "never")


def test_corrupt_mnist_through_the_cli_exits_2_with_one_line(capsys, monkeypatch, tmp_path):
    raw = tmp_path / "data" / "MNIST" / "raw"
    write_mnist(raw, mnist_arrays())
    trust_mnist(monkeypatch, raw)
    _truncate(raw / "train-images-idx3-ubyte.gz")
    code = cli.main(["dataset=mnist", f"data-dir={tmp_path / 'data'}", f"output-dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("fedbr-run: error:") and "Traceback" not in err
    assert str(raw / "train-images-idx3-ubyte.gz") in err


def _pickle_garbage(path: Path) -> None:
    path.write_bytes(b"not a pickle" + bytes(range(50)))


@pytest.mark.parametrize("md5_matches", [False, True], ids=["md5-differs", "md5-matches"])
@pytest.mark.parametrize(
    "name, culprit, damage",
    [
        ("cifar10", "data_batch_3", _truncate),
        ("cifar10", "test_batch", _pickle_garbage),
        ("cifar100", "train", _truncate),
        ("cifar100", "meta", _pickle_garbage),
    ],
)
def test_corrupt_cifar_file_stops_naming_it(monkeypatch, tmp_path, name, culprit, damage, md5_matches):
    write_cifar(tmp_path, name)
    trust_cifar(monkeypatch, tmp_path, name)
    path = tmp_path / cifar_class(name).base_folder / culprit
    damage(path)
    if md5_matches:
        trust_cifar(monkeypatch, tmp_path, name)
    with pytest.raises(ConfigError) as err:
        catalog.load_cifar(name, str(tmp_path), "never")
    msg = one_line_error(err)
    assert str(path) in msg and "corrupt" in msg


def test_cifar_labels_not_matching_images_stop(monkeypatch, tmp_path):
    import pickle

    write_cifar(tmp_path, "cifar10")
    path = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    with open(path, "rb") as f:
        batch = pickle.load(f)
    batch["labels"] = batch["labels"][:-1]
    with open(path, "wb") as f:
        pickle.dump(batch, f)
    trust_cifar(monkeypatch, tmp_path, "cifar10")
    with pytest.raises(ConfigError, match="labels for .* images"):
        catalog.load_cifar("cifar10", str(tmp_path), "never")


def test_a_read_only_folder_of_gz_files_is_read_in_place(monkeypatch, tmp_path):
    """Reading never writes into the data folder (it may be read-only, or read by other processes)."""
    raw = tmp_path / "MNIST" / "raw"
    arrays = mnist_arrays()
    write_mnist(raw, arrays)
    trust_mnist(monkeypatch, raw)
    before = sorted(p.name for p in raw.iterdir())
    train, test = catalog.load_mnist(str(tmp_path), "never")
    assert sorted(p.name for p in raw.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["MNIST"]
    np.testing.assert_array_equal(train.x[:, 0], arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(test.x[:, 0], arrays["t10k-images-idx3-ubyte"])


# ---------------------------------------------------------------- full MNIST: unchanged results

# Recorded with the hand-written idx reader that torchvision's loading replaced (full MNIST, md5-correct).
FULL_MNIST_SHA256 = {
    "train.x": "741c988805d008ac6e4c904b69001ba184c24b2c540a4ef403f4c71b676cf757",
    "train.y": "e474323ac02fc156161b0bbb1f8c9cfeb327a74bcd9f9680a8385269a24f566c",
    "test.x": "6d87418db22cc8025d05968bec9bd5c3932904b23485740db143a061a2c9d161",
    "test.y": "2fd8de6bdb8d11780b4b96dc57847bcfe6953f7c32aa48bfcd8237c3b7847243",
}
FULL_MNIST_PARTITIONS = {
    (10, "iid"): "0e7d9bd1a1c885c3",
    (10, "dirichlet"): "a8edad320e2f9029",
    (10, "fedbr"): "3eb12ab991351f74",
    (100, "iid"): "41337c4c76faf188",
    (100, "dirichlet"): "a7f6232393a3683f",
    (100, "fedbr"): "9ad3ceaa3f2e2fa5",
}


@pytest.fixture(scope="module")
def full_mnist_folder():
    folder = os.environ.get("FEDBR_TEST_DATA", "")
    if not folder or not (Path(folder) / "MNIST" / "raw").is_dir():
        pytest.skip("set FEDBR_TEST_DATA to a folder holding full MNIST (MNIST/raw/*.gz)")
    return folder


def test_full_mnist_arrays_and_partitions_are_unchanged(full_mnist_folder, monkeypatch):
    train, test = catalog.load_raw("mnist", full_mnist_folder, "never")
    arrays = {"train.x": train.x, "train.y": train.y, "test.x": test.x, "test.y": test.y}
    assert train.x.shape == (60000, 1, 28, 28) and test.x.shape == (10000, 1, 28, 28)
    assert {
        k: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for k, a in arrays.items()
    } == FULL_MNIST_SHA256
    assert train.x.dtype == np.uint8 and train.y.dtype == np.int64
    monkeypatch.setenv("FEDBR_DATA_DIR", full_mnist_folder)  # the same through the default folder
    for (num_clients, method), expected in FULL_MNIST_PARTITIONS.items():
        cfg = validate({"dataset": "mnist", "num-clients": num_clients, "partition": method, "download": "never"})
        assert dataset.make_partition(cfg)[1] == expected, (num_clients, method)


def test_the_manifest_records_the_servers_data_folder(monkeypatch, tmp_path):
    import json

    from test_strategy import FakeProxy, make_strategy

    from fedbr_flwr.app import payload

    raw = tmp_path / "env" / "MNIST" / "raw"
    write_mnist(raw, mnist_arrays(n_train=20))
    trust_mnist(monkeypatch, raw)
    monkeypatch.setenv("FEDBR_DATA_DIR", str(tmp_path / "env"))
    out = tmp_path / "run"
    strategy, manager = make_strategy(out, [FakeProxy("a", 0), FakeProxy("b", 1)], dataset="mnist", download="never")
    strategy.configure_fit(1, payload.to_parameters({}), manager)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["data_folder"] == str(tmp_path / "env")
