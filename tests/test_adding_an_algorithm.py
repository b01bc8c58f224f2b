"""Adding an algorithm touches its client file, its strategy file and an experiment file, nothing else.
FedDyn is built in, and the guide (docs/adding-an-algorithm.md) walks through its real files: the guide
shows them as they are, a copy under another name in a contributor's folder is found by the registry
alone, and FedDyn's rule is checked by hand, run and resumed."""

from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import clients
import strategies
from fedbr_flwr.app import payload
from fedbr_flwr.app.checkpointing import ResumedRun
from fedbr_flwr.commands.cli import list_keys, write_pyproject
from fedbr_flwr.core import registry
from fedbr_flwr.core.algorithm import MemoryState, client_class
from fedbr_flwr.core.config import ConfigError, load_yaml, pyproject_table, validate
from fedbr_flwr.data.dataset import ClientData
from fedbr_flwr.launch.plan import check_pyproject
from fedbr_flwr.runfiles.run_io import RunRecorder
from fedbr_flwr.server.robust import AggregationRound, RoundPlan
from fedbr_flwr.server.updates import ClientUpdate
from strategies.base import strategy_class

from fakes import in_process_federation, records_without_timing, run_rounds

ROOT = Path(__file__).resolve().parents[1]
FEDDYN_FILES = ["clients/feddyn.py", "experiments/feddyn_rotmnist5k.yaml", "strategies/feddyn.py"]


def guide_files() -> dict[str, str]:
    """The files the guide's worked example shows: '`path`:' then a fenced block."""
    text = (ROOT / "docs" / "adding-an-algorithm.md").read_text()
    section = text[text.index("## Worked example") :]
    return {m.group(1): m.group(2) for m in re.finditer(r"^`([\w/.]+)`:\n\n```\w+\n(.*?)^```", section, re.M | re.S)}


def test_the_guide_shows_feddyns_real_files_as_they_are():
    files = guide_files()
    assert sorted(files) == FEDDYN_FILES
    for path, text in files.items():
        assert text == (ROOT / path).read_text(), f"the guide's {path} differs from the file: copy the file into it"
    # short enough to read in one go, with FedDyn run as its authors run it (alpha_k, the reported model)
    assert sum(len(t.splitlines()) for p, t in files.items() if p.endswith(".py")) < 130


def as_new_algorithm(text: str) -> str:
    return text.replace("feddyn", "mydyn").replace("FedDyn", "MyDyn")


@contextlib.contextmanager
def contributed(folder: Path, files: dict[str, str]):
    """``files`` (paths under clients/ and strategies/) in a contributor's folder, found by the registry; the
    registry is restored afterwards, also when the test fails."""
    for path, text in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    registry.load_all()  # what is there before the new one
    tables = [registry.CLIENTS, registry.STRATEGIES, registry.VARIANTS, registry.COMPONENTS, registry.SERVER_COMPONENTS]
    saved = [dict(t) for t in tables]
    clients.__path__.append(str(folder / "clients"))
    strategies.__path__.append(str(folder / "strategies"))
    registry._loaded = False
    try:
        registry.load_all()
        yield
    finally:
        clients.__path__.remove(str(folder / "clients"))
        strategies.__path__.remove(str(folder / "strategies"))
        for table, before in zip(tables, saved):
            table.clear()
            table.update(before)
        for path in files:
            sys.modules.pop(path.removesuffix(".py").replace("/", "."), None)
        registry._loaded = True


@pytest.fixture
def mydyn(tmp_path):
    """FedDyn's three files under another name, in a contributor's checkout (here: beside ours)."""
    files = {as_new_algorithm(path): as_new_algorithm((ROOT / path).read_text()) for path in FEDDYN_FILES}
    with contributed(tmp_path, files):
        yield files, tmp_path


def test_a_new_algorithm_is_three_files_and_the_registry_finds_everything_else(mydyn):
    files, folder = mydyn
    assert "mydyn" in registry.algorithm_names() and client_class("mydyn").vectorised
    cfg = validate(load_yaml(folder / "experiments/mydyn_rotmnist5k.yaml"))
    assert cfg["strategy"] == "mydyn" and cfg["mydyn-alpha"] == 0.01
    with pytest.raises(ConfigError, match=r"'mydyn-alpha' belongs to mydyn \(strategy=mydyn\), not to 'fedavg'"):
        validate({"strategy": "fedavg", "mydyn-alpha": 0.1})
    with pytest.raises(ConfigError, match="must be > 0"):
        validate({"strategy": "mydyn", "mydyn-alpha": 0.0})
    with pytest.raises(ConfigError, match="Did you mean 'mydyn-alpha'"):
        validate({"strategy": "mydyn", "mydyn-alfa": 0.1})
    listed = list_keys()
    assert "mydyn keys (strategy=mydyn):" in listed and "mydyn-alpha (0.01)" in listed
    assert "# mydyn\nmydyn-alpha = 0.01\n" in pyproject_table()  # what --write-pyproject would write
    with pytest.raises(ConfigError, match="run `fedbr-run --write-pyproject`"):  # Flower would refuse the key
        check_pyproject()
    copy = folder / "pyproject.toml"
    copy.write_text((ROOT / "pyproject.toml").read_text())
    assert write_pyproject(copy) and not write_pyproject(copy)
    check_pyproject(copy)
    assert "mydyn-alpha = 0.01" in copy.read_text()


def toy_data(n=16):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)
    return ClientData(0, x, y, x[:4], y[:4], 10, False)


def test_feddyn_follows_its_rule_by_hand(tmp_path):
    alpha, lr = 0.5, 0.1
    cfg = validate(
        {
            "strategy": "feddyn",
            "feddyn-alpha": alpha,
            "lr": lr,
            "local-steps": 1,
            "batch-size": 16,
            "num-clients": 4,
            "output-dir": str(tmp_path / "run"),
            "global-test": False,
        }
    )
    client = client_class("feddyn")(cfg, toy_data(), "cpu", MemoryState())
    names = [name for name, _ in client.model.named_parameters()]
    g = {name: np.full(p.shape, 0.3, np.float32) for name, p in client.model.named_parameters()}
    client.state.put_arrays("feddyn-g", g)
    w_round = {name: p.detach().clone() for name, p in client.model.named_parameters()}
    step = client.make_step(1, {})
    with torch.no_grad():  # away from the round's weights, so the proximal gradient is not zero
        for p in client.model.parameters():
            p.add_(0.01)
    x, y = client.data.x_train, client.data.y_train
    before = {name: p.detach().clone() for name, p in client.model.named_parameters()}
    ce_grads = torch.autograd.grad(F.cross_entropy(client.model(x), y), list(client.model.parameters()))
    step.update(x, y)
    for (name, p), ce_grad in zip(client.model.named_parameters(), ce_grads):
        expected = before[name] - lr * (ce_grad - torch.as_tensor(g[name]) + alpha * (before[name] - w_round[name]))
        torch.testing.assert_close(p.detach(), expected, atol=1e-6, rtol=1e-5)
    client.after_fit(step)  # g <- g - alpha (w - w_round)
    kept = client.state.arrays("feddyn-g")
    for name, p in client.model.named_parameters():
        np.testing.assert_allclose(kept[name], g[name] - alpha * (p.detach() - w_round[name]).numpy(), atol=1e-6)
    assert sorted(kept) == sorted(names)

    modules = client_class("feddyn").build_modules(cfg)
    strategy = strategy_class("feddyn")(cfg, RunRecorder(cfg, tmp_path / "run"), modules, None)
    start = strategy.initial_arrays()
    updates = [ClientUpdate(pid, {k: a + pid + 1.0 for k, a in start.items()}, 10) for pid in range(2)]
    new = strategy.aggregate(AggregationRound(1, start, updates, [1.0, 1.0], RoundPlan()))
    for name, a in start.items():
        h = -alpha / 4 * (1.0 + 2.0)  # the drifts of the 2 clients that answered, over all m = 4 clients
        np.testing.assert_allclose(strategy.h[name], h, rtol=1e-6)
        np.testing.assert_allclose(new[name], a + 1.5 - h / alpha, rtol=1e-5)


def test_feddyn_runs_and_resumes_like_an_uninterrupted_run(tmp_path):
    cfg = validate(
        {
            "strategy": "feddyn",
            "num-clients": 3,
            "local-steps": 2,
            "batch-size": 8,
            "num-rounds": 4,
            "eval-every": 2,
            "checkpoint-every": 2,
            "global-test": False,
            "model": "cnn-small",
        }
    )
    straight, _, proxies = in_process_federation(cfg, tmp_path / "straight")
    expected = payload.from_parameters(run_rounds(straight, proxies, 4))
    assert all(np.isfinite(a).all() for a in expected.values()) and any(h.any() for h in straight.h.values())

    first, _, proxies = in_process_federation(cfg, tmp_path / "stopped")
    run_rounds(first, proxies, 3)
    resumed, _, proxies = in_process_federation({**cfg, "resume": True}, tmp_path / "stopped")
    final = payload.from_parameters(run_rounds(ResumedRun(resumed, 2), proxies, 2))
    for name, want in expected.items():
        np.testing.assert_array_equal(final[name], want)
    for file in ("metrics.jsonl", "rounds.jsonl"):
        stopped, straight = tmp_path / "stopped" / file, tmp_path / "straight" / file
        assert records_without_timing(stopped) == records_without_timing(straight)


SERVER_ONLY = {
    "strategies/myavgm.py": '''"""FedAvgM's server (Hsu et al. 2019): the sent model plus a momentum of the updates."""

from dataclasses import dataclass

from fedbr_flwr.core.registry import register_strategy
from fedbr_flwr.core.settings import Settings, setting

from .base import FederatedStrategy


@dataclass(frozen=True)
class MyAvgMSettings(Settings):  # read by the server only, so declared here
    momentum: float = setting("myavgm-momentum", 0.9, "FedAvgM: server momentum")


@register_strategy("myavgm")
class MyAvgMStrategy(FederatedStrategy):
    Settings = MyAvgMSettings
    velocity = None

    def aggregate(self, rnd):
        mean = super().aggregate(rnd)
        step = {name: mean[name] - rnd.sent[name] for name in mean}
        if self.velocity is not None:
            step = {name: self.settings.momentum * self.velocity[name] + step[name] for name in step}
        self.velocity = step
        return {name: (rnd.sent[name] + step[name]).astype(mean[name].dtype) for name in mean}
'''
}


def test_a_server_only_algorithm_is_one_strategy_file_on_fedavgs_client(tmp_path):
    """The guide's claim: a strategy file alone; its clients run FedAvg's, and its rule is the only change."""
    settings = {"num-clients": 2, "local-steps": 2, "batch-size": 8, "model": "cnn-small", "global-test": False}
    with contributed(tmp_path / "contrib", SERVER_ONLY):
        assert client_class("myavgm") is client_class("fedavg")
        finals = {}
        for name in ("fedavg", "myavgm"):
            for rounds in (1, 2):
                finals[name, rounds] = final_arrays({**settings, "strategy": name, "num-rounds": rounds}, tmp_path)
        without = {**settings, "strategy": "myavgm", "num-rounds": 2, "myavgm-momentum": 0.0}  # its strategy's key
        finals["myavgm", "no momentum"] = final_arrays(without, tmp_path)
        with pytest.raises(ConfigError, match="belongs to myavgm"):
            validate({"strategy": "fedavg", "myavgm-momentum": 0.5})

    def same(rounds, theirs=None):  # sent + (mean - sent) rounds differently from the mean in float32: 1e-6 apart
        mine = finals["myavgm", theirs or rounds]
        return all(np.allclose(a, mine[k], atol=1e-6) for k, a in finals["fedavg", rounds].items())

    assert same(1) and not same(2)  # no momentum yet in round 1; round 2 adds 0.9 of round 1's step
    assert same(2, "no momentum")  # the key its strategy file declares reaches it


def final_arrays(settings, tmp_path):
    cfg = validate(settings)
    strategy, _, proxies = in_process_federation(cfg, tmp_path / f"run{len(list(tmp_path.iterdir()))}")
    return payload.from_parameters(run_rounds(strategy, proxies, cfg["num-rounds"]))


BUILT_ON = {
    # a server-only change to SCAFFOLD: its clients must run SCAFFOLD's client, not FedAvg's
    "strategies/myscaffold.py": """from fedbr_flwr.core.registry import register_strategy

from .scaffold import ScaffoldStrategy


@register_strategy("myscaffold")
class MyScaffoldStrategy(ScaffoldStrategy):
    pass
""",
    # a client-only change to FedBR: FedBR's server and FedBR's keys
    "clients/myfedbr.py": """from fedbr_flwr.core.registry import register_client

from .fedbr import FedBRClient


@register_client("myfedbr")
class MyFedBRClient(FedBRClient):
    pass
""",
    # a variant with a server of its own: its own strategy, not its base's
    "strategies/myprox.py": """from fedbr_flwr.core.registry import register_strategy, register_variant

from .base import FederatedStrategy

register_variant("myprox", "fedavg", ("fedprox",), "FedProx with a server of its own")


@register_strategy("myprox")
class MyProxStrategy(FederatedStrategy):
    pass
""",
}


def test_an_algorithm_built_on_another_gets_its_other_side_and_its_keys(tmp_path):
    settings = {"num-clients": 2, "local-steps": 2, "batch-size": 8, "model": "cnn-small", "global-test": False}
    with contributed(tmp_path / "contrib", BUILT_ON):
        assert registry.lineage("myscaffold") == ["myscaffold", "scaffold"]
        assert client_class("myscaffold") is client_class("scaffold")
        assert strategy_class("myfedbr") is strategy_class("fedbr")
        assert strategy_class("myprox").__name__ == "MyProxStrategy"
        assert client_class("myprox") is client_class("fedavg")
        cfg = validate({"strategy": "myfedbr", "fedbr-mu": 0.25})  # FedBR's key applies to what builds on FedBR
        assert registry.settings_of("myfedbr") is registry.settings_of("fedbr") and cfg["fedbr-mu"] == 0.25
        keys = registry.owned_keys()
        assert keys["fedbr-mu"].owner == "fedbr" and "strategy=myfedbr" in registry.how_to_enable("fedbr")
        with pytest.raises(ConfigError, match="belongs to fedbr"):
            validate({"strategy": "myscaffold", "fedbr-mu": 0.25})
        finals = {
            name: final_arrays({**settings, "strategy": name, "num-rounds": 1}, tmp_path)
            for name in ("scaffold", "myscaffold", "fedbr", "myfedbr")
        }
    for mine, theirs in (("myscaffold", "scaffold"), ("myfedbr", "fedbr")):  # the same code ran: the same arrays
        assert finals[mine].keys() == finals[theirs].keys()
        assert all(np.array_equal(a, finals[theirs][k]) for k, a in finals[mine].items())


def test_two_algorithms_declaring_one_key_stop_with_a_config_error(tmp_path):
    clash = {"clients/myclash.py": FEDBR_CLASH}
    with contributed(tmp_path / "contrib", clash), pytest.raises(ConfigError, match="'fedbr-mu' is declared by both"):
        registry.owned_keys()


FEDBR_CLASH = """from dataclasses import dataclass

from fedbr_flwr.core.algorithm import ClientAlgorithm
from fedbr_flwr.core.registry import register_client
from fedbr_flwr.core.settings import Settings, setting


@dataclass(frozen=True)
class ClashSettings(Settings):
    mu: float = setting("fedbr-mu", 0.5, "a key FedBR already declares")


@register_client("myclash")
class MyClashClient(ClientAlgorithm):
    Settings = ClashSettings
"""
