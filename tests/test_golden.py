"""The restructuring oracle: every strategy and combination, and checkpoint/resume runs, must give what
they gave when the golden files were recorded (``tests/golden.py``; timing, memory and traffic fields
aside). On a machine kind with files of its own (the reference's, or one in ``golden/machines/``: same
CPU model, torch and numpy) the comparison is bit for bit. Elsewhere float kernels round differently, and
3 rounds of training grow that, so values are compared within the cross-machine tolerance below, which
catches a broken algorithm but not one as small as FedProx's term (docs/development.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import golden

FILES = sorted(golden.GOLDEN_DIR.glob("*.json"))
# A case and its cohort-engine copy (tests/test_cohort.py) evaluate one model: under pytest-xdist's
# --dist loadgroup they share a worker, and so the server's tests evaluate it once (tests/conftest.py).
CASES = [pytest.param(p, id=p.stem, marks=pytest.mark.xdist_group(p.stem)) for p in FILES]
MACHINE_FILES = sorted(golden.MACHINES_DIR.glob("*/*.json"))

# The cross-machine tolerance: about twice the largest difference measured between the two recorded CPU
# kinds (AMD EPYC and Intel Xeon, same torch and numpy), every case and every value.
NORM_ABS = 1e-4  # an array's norm; measured 4.3e-5 (a GroupNorm bias, which training alone moves from 0)
PROBE_ABS = 1.2e-2  # an array's probe, whose change estimates the L2 distance moved; measured 5.8e-3
FLOAT_REL = 5e-3  # a loss or other metric; measured 2.1e-3 (feddecorr's decorrelation loss)
ACC_ABS = 0.04  # an accuracy; measured 0.027: 2 of a client's 75 test images flip at an argmax tie


def test_every_case_has_a_golden_file():
    assert sorted(p.stem for p in FILES) == sorted([*golden.CASES, *golden.RESUME_CASES])


def to_reproduce(path: Path) -> tuple[dict, bool]:
    """The record this machine must give for a golden case, and whether bit for bit: its own kind's
    record if there is one, else the reference, within the cross-machine tolerance."""
    reference = json.loads(path.read_text())
    env = golden.environment()
    if reference["environment"] == env:
        return reference, True
    own = golden.machine_dir(env) / path.name
    if own.exists():
        return json.loads(own.read_text()), True
    return reference, False


def close_json(got, want, path="", exact=True, added_ok=False):
    """Equal structure; equal non-floats; floats equal (exact) or within tolerance. With ``added_ok``, a
    record may hold keys the golden file lacks (a metric added since it was recorded), never fewer."""
    assert type(got) is type(want) or {type(got), type(want)} <= {int, float}, f"{path}: {got!r} vs {want!r}"
    if isinstance(want, dict):
        missing, added = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        assert not missing and (added_ok or not added), f"{path}: keys missing {missing}, added {added}"
        for k in want:
            close_json(got[k], want[k], f"{path}/{k}", exact, added_ok)
    elif isinstance(want, list):
        assert len(got) == len(want), f"{path}: {len(got)} items vs {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            close_json(g, w, f"{path}[{i}]", exact, added_ok)
    elif isinstance(want, float) and not exact:
        tol = ACC_ABS if "acc" in path else 1e-6
        assert math.isclose(got, want, rel_tol=FLOAT_REL, abs_tol=tol), f"{path}: {got!r} vs {want!r}"
    else:
        assert got == want, f"{path}: {got!r} vs {want!r}"


def close_arrays(got: list[dict], want: list[dict], path: str, exact: bool):
    assert [(a["shape"], a["dtype"]) for a in got] == [(a["shape"], a["dtype"]) for a in want], path
    for i, (g, w) in enumerate(zip(got, want)):
        if exact:
            assert g["sha256"] == w["sha256"], f"{path}[{i}] differs"
        else:
            assert abs(g["norm"] - w["norm"]) <= NORM_ABS, f"{path}[{i}] norm"
            assert abs(g["probe"] - w["probe"]) <= PROBE_ABS, f"{path}[{i}] probe"


def close_records(got: dict, want: dict, exact: bool):
    close_arrays(got["global"], want["global"], "global", exact)
    for name in sorted(set(want["files"]) | set(got["files"])):
        assert name in got["files"] and name in want["files"], f"{name} written in one run only"
        for key in want["files"][name]:
            close_arrays([got["files"][name][key]], [want["files"][name][key]], f"{name}/{key}", exact)
        assert sorted(got["files"][name]) == sorted(want["files"][name]), name
    close_json(got["manifest"], want["manifest"], "manifest", exact)
    # a metric added later is a new key in these records: it leaves every recorded figure as it was
    close_json(got["rounds"], want["rounds"], "rounds", exact, added_ok=True)
    close_json(got["metrics"], want["metrics"], "metrics", exact, added_ok=True)


@pytest.mark.parametrize("path", CASES)
def test_a_run_gives_what_it_gave_before(path, tmp_path):
    want, exact = to_reproduce(path)
    close_records(golden.record(want["case"], tmp_path), want, exact)


@pytest.mark.parametrize("path", MACHINE_FILES, ids=[f"{p.parent.name}/{p.stem}" for p in MACHINE_FILES])
def test_a_machine_kinds_files_agree_with_the_reference_within_the_cross_machine_tolerance(path):
    """Another CPU kind's records differ from the reference by rounding only; this is also where the
    tolerance meets every value a second machine kind gave."""
    mine = json.loads(path.read_text())
    assert golden.machine_dir(mine["environment"]) == path.parent and mine["case"] == path.stem
    close_records(mine, json.loads((golden.GOLDEN_DIR / path.name).read_text()), exact=False)


def test_a_machine_kind_has_a_file_for_every_case():
    """Else its missing cases would fall back to the tolerance unnoticed."""
    for folder in {p.parent for p in MACHINE_FILES}:
        assert sorted(p.name for p in folder.glob("*.json")) == sorted(p.name for p in FILES), folder.name


def test_the_cross_machine_tolerance_tells_a_different_algorithm_apart():
    """FedAvg's and GroupDRO's runs share a model and differ in the loss only (measured: 1.8e-2 apart
    by probe, 9.5e-4 by norm)."""
    fedavg, groupdro = (json.loads((golden.GOLDEN_DIR / f"{n}.json").read_text()) for n in ("fedavg", "groupdro"))
    with pytest.raises(AssertionError):
        close_arrays(groupdro["global"], fedavg["global"], "global", exact=False)


def test_the_comparison_can_fail():
    record = {"global": [golden.array_record(np.ones(3, np.float32))]}
    other = {"global": [golden.array_record(np.full(3, 1.01, np.float32))]}
    with pytest.raises(AssertionError):
        close_arrays(other["global"], record["global"], "global", exact=True)
    with pytest.raises(AssertionError):
        close_arrays(other["global"], record["global"], "global", exact=False)
    with pytest.raises(AssertionError):
        close_json({"train": {"loss": 1.01}}, {"train": {"loss": 1.0}}, exact=False)
    close_json({"mean_acc": 0.51}, {"mean_acc": 0.5}, exact=False)  # one sample's argmax may flip
    # an added metric passes the metric lines, a dropped one does not, and the manifest takes neither
    close_json({"mean_acc": 0.5, "median_acc": 0.4}, {"mean_acc": 0.5}, added_ok=True)
    with pytest.raises(AssertionError, match="missing"):
        close_json({"median_acc": 0.4}, {"mean_acc": 0.5, "median_acc": 0.4}, added_ok=True)
    with pytest.raises(AssertionError, match="added"):
        close_json({"seed": 0, "extra": 1}, {"seed": 0})
