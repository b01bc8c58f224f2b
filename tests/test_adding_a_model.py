"""Adding a backbone is one entry of ``MODELS`` (docs/adding-a-model.md): the guide's code, appended to
fedbr_flwr/core/model.py as the guide says, gives a model the config accepts, the configuration page's check
asks for, and FedAvg, FedBR and DisTrans train."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from fedbr_flwr.core import model
from fedbr_flwr.core.config import ConfigError, configuration_reference, validate
from fedbr_flwr.runfiles.metrics import read_jsonl

from fakes import in_process_federation, run_rounds

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "adding-a-model.md"


def add_the_guides_model(monkeypatch) -> model.ModelInfo:
    """The guide's block run at the end of model.py; ``MODELS`` is restored after the test (``monkeypatch``)."""
    block = re.search(r"```python\n(.*?)```", GUIDE.read_text(), re.S)
    assert block, "the guide shows its code in a python block"
    monkeypatch.setitem(model.MODELS, "mlp", model.MODELS["cnn"])  # undone (removed) after the test
    exec(block.group(1), vars(model))
    return model.MODELS["mlp"]


@pytest.fixture
def mlp(monkeypatch) -> model.ModelInfo:
    return add_the_guides_model(monkeypatch)


def test_the_config_offers_exactly_the_declared_models(mlp):
    assert validate({"model": "mlp"})["model"] == "mlp"
    assert "`mlp`" in configuration_reference()  # what --write-docs writes: the page's test then asks for the rewrite
    with pytest.raises(ConfigError, match="'model' = 'mpl' is not one of: auto, cnn, .*, mlp"):
        validate({"model": "mpl"})


def test_the_guides_entry_says_what_its_features_give(mlp):
    net = model.build_model("mlp", 10, 1, 28)
    x = torch.randn(3, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    assert net.features(x).shape == (3, mlp.feature_dim) and net(x).shape == (3, 10)
    assert torch.allclose(net.features(x)[:1], net.features(x[:1]), atol=1e-6)  # each sample on its own


@pytest.mark.parametrize("strategy", ["fedavg", "fedbr", "distrans"])
def test_a_federation_learns_with_the_guides_model(mlp, strategy, tmp_path):
    cfg = validate(
        {
            "strategy": strategy,
            "dataset": "mnist5k",
            "model": "mlp",
            "rotate": False,
            "partition": "iid",
            "global-test": False,
            "num-clients": 3,
            "local-steps": 10,
            "eval-every": 1,
        }
    )
    strategy_, _, proxies = in_process_federation(cfg, tmp_path)
    run_rounds(strategy_, proxies, 3)
    accuracy = read_jsonl(strategy_.recorder.metrics_path)[-1]["mean_acc"]
    assert accuracy > 0.6, f"{strategy} reached {accuracy:.2f} with the guide's model (chance 0.10)"
