"""Datasets: rotation domains, per-client tensors, raw file parsing (synthetic files), augmentation."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from fedbr_flwr.core.config import COMMON, ConfigError, validate
from fedbr_flwr.data.catalog import INFO, ROTATIONS, Split, load_cifar, load_mnist, load_raw
from fedbr_flwr.data.dataset import (
    cifar_angle_prior,
    client_angle,
    client_indices,
    global_test_angles,
    image_angles,
    load_client_data,
    load_global_test,
    make_partition,
    normalise,
    normalised_black,
    partition_sizes,
    random_crop_flip,
    rotate,
    rotate_bilinear,
    to_float,
)

from datafiles import mnist_arrays, trust_cifar, trust_mnist, write_cifar, write_mnist

# ---------------------------------------------------------------- rotation domains and client data


def test_client_angle():
    for i in range(25):
        assert client_angle(i) == 15 * (i % 10)


@pytest.fixture(scope="module")
def cfg10():
    return validate({"num-clients": 10})


def _raw_client_images(cfg, pid):
    train_idx, test_idx = client_indices(cfg, pid)
    train, _ = load_raw("mnist5k", "")
    return train, train_idx, test_idx


def test_client3_images_are_rotated_by_45(cfg10):
    data = load_client_data(cfg10, 3, "cpu")
    train, train_idx, _ = _raw_client_images(cfg10, 3)
    raw = train.x[train_idx]
    expected = normalise(rotate(to_float(raw), np.full(len(raw), 45.0)), INFO["mnist5k"])
    assert data.x_train.shape == expected.shape
    assert torch.allclose(data.x_train, expected, atol=1e-6)
    unrotated = normalise(to_float(raw), INFO["mnist5k"])
    assert not torch.allclose(data.x_train, unrotated, atol=1e-3)
    np.testing.assert_array_equal(data.y_train.numpy(), train.y[train_idx])


def test_client0_images_are_unrotated(cfg10):
    data = load_client_data(cfg10, 0, "cpu")
    train, train_idx, test_idx = _raw_client_images(cfg10, 0)
    assert torch.allclose(data.x_train, normalise(to_float(train.x[train_idx]), INFO["mnist5k"]), atol=1e-6)
    assert torch.allclose(data.x_test, normalise(to_float(train.x[test_idx]), INFO["mnist5k"]), atol=1e-6)
    np.testing.assert_array_equal(data.y_test.numpy(), train.y[test_idx])


def test_rotate_false_leaves_client3_unrotated():
    cfg = validate({"num-clients": 10, "rotate": False})
    data = load_client_data(cfg, 3, "cpu")
    train, train_idx, _ = _raw_client_images(cfg, 3)
    assert torch.allclose(data.x_train, normalise(to_float(train.x[train_idx]), INFO["mnist5k"]), atol=1e-6)


@pytest.mark.parametrize("pid", [0, 3, 9])
def test_client_train_test_sizes(cfg10, pid):
    data = load_client_data(cfg10, pid, "cpu")
    parts, _ = make_partition(cfg10)
    n = len(parts[pid])
    assert len(data.x_train) + len(data.x_test) == n
    assert len(data.y_train) == len(data.x_train) and len(data.y_test) == len(data.x_test)
    assert len(data.x_test) == int(round(0.2 * n))
    assert data.num_classes == 10 and data.augment is False
    # the client's samples are exactly its partition part
    train_idx, test_idx = client_indices(cfg10, pid)
    np.testing.assert_array_equal(np.sort(np.concatenate([train_idx, test_idx])), parts[pid])


def test_a_classes_split_that_would_leave_classes_to_no_client_is_refused():
    """3 clients of 2 classes each on MNIST trained on 2,700 of its 4,500 samples, without a word."""
    with pytest.raises(ConfigError, match="holds 6 of the 10 classes of mnist5k: the others' samples would go"):
        make_partition(validate({"partition": "classes", "classes-per-client": 2, "num-clients": 3}))
    parts, _ = make_partition(validate({"partition": "classes", "classes-per-client": 2, "num-clients": 5}))
    assert sum(len(p) for p in parts) == 4500


def one_class_cfg(classes_each, **more):
    return validate({"num-clients": 10, "partition": "classes", "classes-per-client": classes_each, **more})


@pytest.mark.parametrize("pid", [0, 7])
def test_one_class_clients_test_on_as_many_images_of_the_other_classes(pid):
    """DisTrans' 100% heterogeneity: each local test holds its own class and, as many again, random test-split
    images of the other classes (the training split's own images unchanged), seeded by the run seed."""
    from fedbr_flwr.data.dataset import other_class_test_indices

    cfg = one_class_cfg(1)
    data = load_client_data(cfg, pid, "cpu")
    train, test = load_raw("mnist5k", "")
    train_idx, test_idx = client_indices(cfg, pid)
    own_class = int(train.y[test_idx[0]])
    assert set(train.y[test_idx].tolist()) == {own_class}
    others = other_class_test_indices(cfg, pid)
    assert (
        len(others) == len(test_idx) == int((data.y_test != own_class).sum()) == int((data.y_test == own_class).sum())
    )
    assert own_class not in set(test.y[others].tolist()) and len(set(others.tolist())) == len(others)
    np.testing.assert_array_equal(data.y_test.numpy(), np.concatenate([train.y[test_idx], test.y[others]]))
    angle = np.full(len(others), client_angle(pid))
    expected = normalise(rotate(to_float(test.x[others]), angle), INFO["mnist5k"])
    assert torch.allclose(data.x_test[len(test_idx) :], expected, atol=1e-6)
    assert torch.equal(data.y_train, torch.from_numpy(train.y[train_idx]))
    np.testing.assert_array_equal(other_class_test_indices(cfg, pid), others)  # the same on every call (engine)
    assert not np.array_equal(other_class_test_indices(one_class_cfg(1, seed=1), pid), others)
    assert partition_sizes(cfg)[pid] == (len(data.y_train), len(data.y_test))


def test_two_classes_per_client_keep_their_local_test_as_it_was():
    from fedbr_flwr.data.dataset import other_class_test_indices

    cfg = one_class_cfg(2)
    data = load_client_data(cfg, 4, "cpu")
    train, _ = load_raw("mnist5k", "")
    _, test_idx = client_indices(cfg, 4)
    assert len(other_class_test_indices(cfg, 4)) == 0
    assert torch.equal(data.y_test, torch.from_numpy(train.y[test_idx]))


def test_load_client_data_rejects_bad_partition_id(cfg10):
    with pytest.raises(ConfigError, match="partition-id"):
        load_client_data(cfg10, 10, "cpu")


def test_mnist5k_splits_and_global_test(cfg10):
    train, test = load_raw("mnist5k", "")
    assert train.x.shape == (4500, 1, 28, 28) and train.x.dtype == np.uint8
    assert test.x.shape == (500, 1, 28, 28) and test.x.dtype == np.uint8
    assert train.y.dtype == np.int64 and test.y.dtype == np.int64
    np.testing.assert_array_equal(np.bincount(test.y, minlength=10), np.full(10, 50))
    np.testing.assert_array_equal(np.bincount(train.y, minlength=10), np.full(10, 450))
    # no test image appears in the training pool
    train_images = {img.tobytes() for img in train.x}
    assert not any(img.tobytes() in train_images for img in test.x)

    copies = load_global_test(cfg10)
    assert sorted(copies) == [15 * k for k in range(10)]
    for angle, (x, y) in copies.items():  # each copy: the whole test split, rotated by its angle
        assert x.shape == (500, 1, 28, 28)
        np.testing.assert_array_equal(y.numpy(), test.y)
        assert torch.equal(x, normalise(rotate(to_float(test.x), np.full(500, float(angle))), INFO["mnist5k"]))


def test_global_test_rotated_when_num_clients_unresolved():
    cfg = validate({})  # num-clients = 0: one client per SuperNode, known only after discovery
    x, _ = load_global_test(cfg)[45]
    _, test = load_raw("mnist5k", "")
    assert not torch.allclose(x, normalise(to_float(test.x), INFO["mnist5k"]), atol=1e-3)


# ---------------------------------------------------------------- raw loaders: missing files


def test_load_mnist_missing_mentions_path_and_data_dir(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_mnist(str(tmp_path / "nonexistent"), download="never")
    msg = str(err.value)
    assert f"{tmp_path / 'nonexistent'}" in msg and "MNIST/raw" in msg
    assert "data-dir" in msg


def test_load_cifar_missing_mentions_folder(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_cifar("cifar10", str(tmp_path), download="never")
    assert "cifar-10-batches-py" in str(err.value)
    assert "data-dir" in str(err.value)
    with pytest.raises(ConfigError, match="cifar-100-python"):
        load_cifar("cifar100", str(tmp_path), download="never")


def test_load_cifar_partial_download_names_missing_file(tmp_path, monkeypatch):
    write_cifar(tmp_path, "cifar10")
    trust_cifar(monkeypatch, tmp_path, "cifar10")
    for i in range(2, 6):
        (tmp_path / "cifar-10-batches-py" / f"data_batch_{i}").unlink()
    with pytest.raises(ConfigError, match="data_batch_2"):
        load_cifar("cifar10", str(tmp_path), download="never")


# ---------------------------------------------------------------- raw loaders: synthetic files (tests/datafiles.py)


def test_load_cifar10_synthetic(tmp_path, monkeypatch):
    (rows, labels), (test_rows, test_labels) = write_cifar(tmp_path, "cifar10", per_file=20)
    trust_cifar(monkeypatch, tmp_path, "cifar10")
    train, test = load_cifar("cifar10", str(tmp_path), download="never")
    assert train.x.shape == (100, 3, 32, 32) and train.x.dtype == np.uint8
    assert test.x.shape == (20, 3, 32, 32)
    assert train.y.dtype == np.int64
    np.testing.assert_array_equal(train.y, labels)
    np.testing.assert_array_equal(test.y, test_labels)
    for i in (0, 37, 99):
        np.testing.assert_array_equal(rows[i].reshape(3, 32, 32), train.x[i])
    # channel-major layout: first 1024 bytes are the red plane
    np.testing.assert_array_equal(train.x[5, 0].ravel(), rows[5, :1024])
    np.testing.assert_array_equal(test.x[3], test_rows[3].reshape(3, 32, 32))
    assert train.x.flags.c_contiguous


def test_load_cifar100_synthetic(tmp_path, monkeypatch):
    (rows, labels), (_, test_labels) = write_cifar(tmp_path, "cifar100", per_file=30, seed=1)
    trust_cifar(monkeypatch, tmp_path, "cifar100")
    train, test = load_cifar("cifar100", str(tmp_path), download="never")
    assert train.x.shape == (30, 3, 32, 32) and test.x.shape == (30, 3, 32, 32)
    np.testing.assert_array_equal(train.y, labels)
    np.testing.assert_array_equal(test.y, test_labels)
    np.testing.assert_array_equal(train.x[7], rows[7].reshape(3, 32, 32))


@pytest.mark.parametrize("gz", [True, False], ids=["gzipped", "plain"])
def test_load_mnist_idx_files(tmp_path, monkeypatch, gz):
    raw = tmp_path / "MNIST" / "raw"
    arrays = mnist_arrays(n_train=12, n_test=5)
    write_mnist(raw, arrays, gz=gz)
    trust_mnist(monkeypatch, raw)
    train, test = load_mnist(str(tmp_path), download="never")
    assert train.x.shape == (12, 1, 28, 28) and test.x.shape == (5, 1, 28, 28)
    assert train.x.dtype == np.uint8 and train.y.dtype == np.int64
    np.testing.assert_array_equal(train.x[:, 0], arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(train.y, arrays["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(test.x[:, 0], arrays["t10k-images-idx3-ubyte"])
    np.testing.assert_array_equal(test.y, arrays["t10k-labels-idx1-ubyte"])
    assert train.x.flags.writeable


def test_load_raw_unknown_dataset():
    with pytest.raises(ConfigError, match="unknown dataset"):
        load_raw("svhn", "")


# ---------------------------------------------------------------- augmentation


def test_random_crop_flip_is_a_crop_of_the_padded_input():
    x = torch.randn(6, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    out = random_crop_flip(x, torch.Generator().manual_seed(42), pad=4)
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    for i in range(len(x)):
        matches = []
        for oy in range(9):
            for ox in range(9):
                crop = padded[i, :, oy : oy + 8, ox : ox + 8]
                for flip in (False, True):
                    cand = crop.flip(-1) if flip else crop
                    if torch.equal(cand, out[i]):
                        matches.append((oy, ox, flip))
        assert matches, f"image {i} is no (flipped) crop of the padded input"
    # same generator seed -> same output; another seed -> (almost surely) different output
    again = random_crop_flip(x, torch.Generator().manual_seed(42), pad=4)
    assert torch.equal(out, again)
    other = random_crop_flip(x, torch.Generator().manual_seed(43), pad=4)
    assert not torch.equal(out, other)


def test_random_crop_pads_with_the_normalised_black_pixel():
    # torchvision's order is crop, flip, then normalise: the padding is black before normalisation
    info = INFO["cifar100"]
    border = normalised_black(info)
    assert border == pytest.approx([-m / s for m, s in zip(info.mean, info.std)], rel=1e-6)
    x = torch.full((200, 3, 8, 8), 5.0)
    out = random_crop_flip(x, torch.Generator().manual_seed(0), pad=4, border=border)
    padding = out != 5.0
    assert padding.any()
    for c in range(3):
        assert torch.all(out[:, c][padding[:, c]] == torch.tensor(border[c]))


def test_random_crop_flip_covers_offsets_and_flips():
    # over many draws, all 9 offsets per axis and both flips occur, and pixels stay aligned per channel
    x = torch.arange(2 * 4 * 4, dtype=torch.float32).view(1, 2, 4, 4).repeat(400, 1, 1, 1) + 1
    out = random_crop_flip(x, torch.Generator().manual_seed(0), pad=2)
    padded = torch.nn.functional.pad(x[:1], (2, 2, 2, 2))[0]
    seen = set()
    for i in range(len(out)):
        for oy in range(5):
            for ox in range(5):
                crop = padded[:, oy : oy + 4, ox : ox + 4]
                if torch.equal(crop, out[i]):
                    seen.add((oy, ox, False))
                if torch.equal(crop.flip(-1), out[i]):
                    seen.add((oy, ox, True))
    assert len(seen) == 50


# ---------------------------------------------------------------- CIFAR10 angle prior


def test_cifar_angle_prior():
    priors = [cifar_angle_prior(pid, seed=0) for pid in range(5)]
    for p in priors:
        assert p.shape == (10,)
        assert p.sum() == pytest.approx(1.0)
        assert np.all(p >= 0)
    assert not np.allclose(priors[0], priors[1])
    np.testing.assert_array_equal(cifar_angle_prior(2, 0), cifar_angle_prior(2, 0))
    assert not np.allclose(cifar_angle_prior(2, 0), cifar_angle_prior(2, 1))


def test_image_angles():
    cfg = validate({"dataset": "cifar10", "data-dir": "/x", "num-clients": 10})
    a = image_angles(cfg, 4, 2000)
    assert a.shape == (2000,)
    assert set(np.unique(a)) <= set(15.0 * np.arange(10))
    # follows the client's prior: the most likely angle is the one drawn most often
    prior = cifar_angle_prior(4, cfg["seed"])
    counts = np.array([(a == 15.0 * k).sum() for k in range(10)])
    assert np.argmax(counts) == np.argmax(prior)
    np.testing.assert_array_equal(a, image_angles(cfg, 4, 2000))
    # MNIST: one angle per client; rotate off or CIFAR100: none
    mcfg = validate({"num-clients": 10})
    np.testing.assert_array_equal(image_angles(mcfg, 13, 4), np.full(4, 45.0))
    off = validate({"dataset": "cifar10", "data-dir": "/x", "rotate": False})
    assert not image_angles(off, 4, 10).any()
    c100 = validate({"dataset": "cifar100", "data-dir": "/x"})
    assert not image_angles(c100, 4, 10).any()


@pytest.mark.parametrize("shape", [(6, 1, 28, 28), (4, 3, 32, 32), (3, 2, 17, 23)])
def test_rotation_equals_torchvisions_bit_for_bit(shape):
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.functional import rotate as torchvision_rotate

    x = torch.rand(shape, generator=torch.Generator().manual_seed(len(shape) + shape[-1]))
    for angle in [15.0 * k for k in range(1, 24)] + [7.3, -30.0, 200.5]:
        expected = torchvision_rotate(x, angle, interpolation=InterpolationMode.BILINEAR, fill=0.0)
        assert torch.equal(rotate_bilinear(x, angle), expected), angle


def test_a_client_process_builds_rotated_mnist_without_importing_torchvision():
    code = (
        "import sys\n"
        "from fedbr_flwr.app import client_app\n"
        "from fedbr_flwr.data import dataset\n"
        "from fedbr_flwr.core.config import validate\n"
        "data = dataset.load_client_data(validate({'num-clients': 10}), 3, 'cpu')\n"
        "assert data.x_train.shape[0] > 0\n"
        "print(sorted(m for m in sys.modules if m.partition('.')[0] == 'torchvision'))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_rotate_and_normalise():
    x = torch.zeros(2, 1, 5, 5)
    x[:, 0, 2, 4] = 1.0  # a pixel right of centre
    out = rotate(x, np.array([0.0, 90.0]))
    assert torch.equal(out[0], x[0])  # angle 0 untouched
    assert out[1, 0, 0, 2] == pytest.approx(1.0)  # +90 deg (counter-clockwise) moves it to the top
    assert torch.equal(x[1, 0, 2, 4], torch.tensor(1.0))  # input not modified
    info = INFO["cifar10"]
    ones = torch.ones(1, 3, 2, 2)
    n = normalise(ones, info)
    for c in range(3):
        assert torch.allclose(n[0, c], torch.full((2, 2), (1 - info.mean[c]) / info.std[c]))
    assert torch.equal(to_float(np.array([[[[0, 255]]]], dtype=np.uint8)), torch.tensor([[[[0.0, 1.0]]]]))


# ---------------------------------------------------------------- the catalogue


def test_every_catalogue_entry_names_a_known_rotation_model_and_proxy():
    models = COMMON["model"].choices
    for name, info in INFO.items():
        assert info.rotation in ROTATIONS, name
        assert info.default_model in models and info.proxy in INFO, name
        assert len(info.mean) == len(info.std) == info.in_channels, name


def test_a_new_catalogue_entry_is_all_the_data_layer_needs(monkeypatch):
    """One entry carries a dataset's loader and rotation: a dataset added that way loads its own images (not
    another dataset's), and its clients' images and the balanced global test turn as its entry says."""
    rng = np.random.default_rng(0)
    train = Split(rng.integers(0, 256, (200, 1, 28, 28), dtype=np.uint8), np.arange(200) % 10)
    test = Split(rng.integers(0, 256, (50, 1, 28, 28), dtype=np.uint8), np.arange(50) % 10)
    monkeypatch.setitem(INFO, "digits", replace(INFO["mnist5k"], load=lambda _folder, _download: (train, test)))
    load_raw.cache_clear()
    assert load_raw("digits")[0] is train
    cfg = {**validate({"rotate": True}), "dataset": "digits"}
    assert image_angles(cfg, 3, 2).tolist() == [45.0, 45.0]
    assert global_test_angles(cfg) == tuple(range(0, 150, 15))
    monkeypatch.setitem(INFO, "digits", replace(INFO["digits"], rotation="none"))
    assert image_angles(cfg, 3, 2).tolist() == [0.0, 0.0] and global_test_angles(cfg) == (0,)
    load_raw.cache_clear()


def test_an_unknown_dataset_stops_with_one_line_naming_the_known_ones():
    with pytest.raises(ConfigError, match="unknown dataset 'digits'. Valid: mnist5k, mnist, cifar10"):
        load_raw("digits")


@pytest.mark.parametrize("dataset", ["mnist5k", "synthetic", "cifar10"])
def test_every_normalised_training_image_lies_within_the_datasets_input_range(dataset, tmp_path, monkeypatch):
    """The server refuses pseudo-data means and mean data outside ``input_range`` (a mean of images lies
    within it): the clients' own images, rotated and normalised, must never fall outside."""
    settings = {"dataset": dataset, "num-clients": 2, "rotate": True}
    if dataset == "cifar10":
        write_cifar(tmp_path, "cifar10", per_file=20)
        trust_cifar(monkeypatch, tmp_path, "cifar10")
        settings.update({"data-dir": str(tmp_path), "download": "never", "partition": "iid"})
    cfg = validate(settings)
    low, high = (np.array(bound).reshape(1, -1, 1, 1) for bound in INFO[dataset].input_range())
    for pid in range(2):
        x = load_client_data(cfg, pid, "cpu").x_train.numpy()
        assert (x >= low - 1e-6).all() and (x <= high + 1e-6).all()
        assert x.min() < low.max() + 0.05 and x.max() > high.min() - 0.05  # both ends are reached, nearly
