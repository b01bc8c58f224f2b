"""The restructuring oracle: every strategy and combination, and checkpoint/resume runs, must give what
they gave when the golden files were recorded (``tests/golden.py``; timing, memory and traffic fields
aside). On the machine kind they were recorded on (same torch, numpy and CPU) the comparison is bit
for bit; elsewhere float kernels may round differently, so values are compared within a tolerance far
below what any change of behaviour moves them by."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import golden

FILES = sorted(golden.GOLDEN_DIR.glob("*.json"))
REL = 1e-3
ACC_ABS = 0.02  # an argmax may flip for a sample at a tie on another CPU


def test_every_case_has_a_golden_file():
    assert sorted(p.stem for p in FILES) == sorted([*golden.CASES, *golden.RESUME_CASES])


def same_machine_kind(recorded: dict) -> bool:
    return recorded == golden.environment()


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
        assert math.isclose(got, want, rel_tol=REL, abs_tol=tol), f"{path}: {got!r} vs {want!r}"
    else:
        assert got == want, f"{path}: {got!r} vs {want!r}"


def close_arrays(got: list[dict], want: list[dict], path: str, exact: bool):
    assert [(a["shape"], a["dtype"]) for a in got] == [(a["shape"], a["dtype"]) for a in want], path
    for i, (g, w) in enumerate(zip(got, want)):
        if exact:
            assert g["sha256"] == w["sha256"], f"{path}[{i}] differs"
        else:
            assert math.isclose(g["norm"], w["norm"], rel_tol=REL, abs_tol=1e-6), f"{path}[{i}] norm"
            assert abs(g["probe"] - w["probe"]) <= REL * max(1.0, w["norm"]) * 10, f"{path}[{i}] probe"


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_a_run_gives_what_it_gave_before(path, tmp_path):
    want = json.loads(path.read_text())
    got = golden.record(want["case"], tmp_path)
    exact = same_machine_kind(want["environment"])
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
