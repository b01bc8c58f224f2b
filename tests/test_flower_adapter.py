"""Flower's internals are reached from one module, ``fedbr_flwr.app.flower_adapter``, checked on the Flower versions
it names: an upgrade fails here first, and the re-check is of that module alone."""

from __future__ import annotations

from pathlib import Path

import flwr

from fedbr_flwr.app import flower_adapter

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fedbr_flwr", "clients", "strategies", "pseudodata")
# what only the adapter may name: Flower's private entry point, the engine module and classes it patches, the
# in-memory grid's poll
INTERNALS = ("_run_simulation", "raybackend", "vce_api", "pull_interval", "add_messages_to_queue")


def test_flower_is_a_version_the_adapter_was_checked_on():
    assert flwr.__version__ in flower_adapter.CHECKED_ON, (
        f"flwr {flwr.__version__}: re-check fedbr_flwr/app/flower_adapter.py against it (its private entry point and "
        "patches), run the e2e tests, then add the version to CHECKED_ON"
    )


def test_no_other_module_reaches_into_flowers_internals():
    adapter = ROOT / "fedbr_flwr" / "app" / "flower_adapter.py"
    found = [
        f"{path.relative_to(ROOT)}: {name}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if path != adapter
        for name in INTERNALS
        if name in path.read_text()
    ]
    assert not found, found
    assert all(name in adapter.read_text() for name in INTERNALS)  # each is still the adapter's
