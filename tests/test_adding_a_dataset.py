"""Adding a dataset is one catalogue entry (docs/adding-a-dataset.md): the guide's code, appended to the
catalogue as the guide says, gives a dataset the config accepts and FedAvg and FedBR learn, with the
statistics and sizes the entry claims."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fedbr_flwr.core.config import COMMON, validate
from fedbr_flwr.data import catalog
from fedbr_flwr.runfiles.metrics import read_jsonl

from fakes import in_process_federation, run_rounds

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "adding-a-dataset.md"


def add_the_guides_dataset(monkeypatch) -> catalog.DatasetInfo:
    """The guide's block run at the end of the catalogue; the catalogue and the schema are restored after the
    test (``monkeypatch``)."""
    block = re.search(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    assert block, "the guide shows its code in a python block"
    monkeypatch.setitem(catalog.INFO, "stripes", catalog.INFO["mnist5k"])  # undone (removed) after the test
    exec(block.group(1), vars(catalog))
    # the config reads the names when it is imported, as it would after the user's edit
    monkeypatch.setitem(COMMON, "dataset", replace(COMMON["dataset"], choices=tuple(catalog.INFO)))
    catalog.load_raw.cache_clear()
    return catalog.INFO["stripes"]


@pytest.fixture
def stripes(monkeypatch):
    yield add_the_guides_dataset(monkeypatch)
    catalog.load_raw.cache_clear()


def test_the_guides_entry_says_what_its_loader_gives(stripes):
    train, test = catalog.load_raw("stripes")
    x = train.x / 255
    assert train.x.shape == (stripes.train_size, stripes.in_channels, stripes.image_size, stripes.image_size)
    assert train.x.dtype == np.uint8 and train.y.dtype == np.int64 and set(test.y) == set(range(stripes.num_classes))
    assert x.mean() == pytest.approx(stripes.mean[0], abs=0.01) and x.std() == pytest.approx(stripes.std[0], abs=0.01)


@pytest.mark.parametrize("strategy", ["fedavg", "fedbr"])
def test_a_federation_learns_the_guides_dataset(stripes, strategy, tmp_path):
    cfg = validate(
        {
            "strategy": strategy,
            "dataset": "stripes",
            "rotate": False,
            "global-test": False,
            "num-clients": 4,
            "local-steps": 10,
            "lr": 0.05,
            "model": "auto",
            "eval-every": 1,
        }
    )
    strategy_, _, proxies = in_process_federation(cfg, tmp_path)
    run_rounds(strategy_, proxies, 4)
    accuracy = read_jsonl(strategy_.recorder.metrics_path)[-1]["mean_acc"]
    assert accuracy > 0.5, f"{strategy} reached {accuracy:.2f} on stripes (chance 0.10)"


def broken(split: catalog.Split, fault: str) -> catalog.Split:
    x, y = split.x, split.y
    return {
        "no channel axis": catalog.Split(x[:, 0], y),
        "another size": catalog.Split(x[:, :, :20, :20], y),
        "float pixels": catalog.Split(x / 255, y),
        "two labels per image": catalog.Split(x, np.repeat(y, 2)),
        "float labels": catalog.Split(x, y.astype(np.float32)),
        "a label past num_classes": catalog.Split(x, np.where(y == 9, 10, y)),
    }[fault]


@pytest.mark.parametrize(
    "fault, message",
    [
        ("no channel axis", r"images of uint8 \(2000, 28, 28\); its entry says uint8 \(N, 1, 28, 28\)"),
        ("another size", r"images of uint8 \(2000, 1, 20, 20\)"),
        ("float pixels", r"images of float64 \(2000, 1, 28, 28\)"),
        ("two labels per image", r"labels of int64 \(4000,\); its entry says int64 \(2000,\)"),
        ("float labels", r"labels of float32"),
        ("a label past num_classes", r"labels 0\.\.10; num_classes=10 allows 0\.\.9"),
    ],
)
def test_a_loader_that_gives_other_images_than_its_entry_says_stops_with_one_line(stripes, monkeypatch, fault, message):
    good = stripes.load("", "auto")
    monkeypatch.setitem(catalog.INFO, "stripes", replace(stripes, load=lambda *_: (broken(good[0], fault), good[1])))
    catalog.load_raw.cache_clear()
    with pytest.raises(catalog.ConfigError, match=f"^dataset 'stripes': its loader's train split has {message}"):
        catalog.load_raw("stripes")


def test_an_entry_whose_normalisation_has_another_channel_count_stops(stripes, monkeypatch):
    monkeypatch.setitem(catalog.INFO, "stripes", replace(stripes, mean=(0.5, 0.5, 0.5)))
    with pytest.raises(catalog.ConfigError, match=r"mean and std need one value per channel \(1\)"):
        catalog.load_raw("stripes")
