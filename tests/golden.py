"""Golden runs: short in-process federations of every strategy and combination, and checkpoint/resume
runs, reduced to what must not change when the code is restructured: the final global arrays, the
metric and round lines (timing, memory and traffic fields aside), the data files a run writes and
the manifest's partition facts.

The federation is driven through Flower's legacy API only, in the order Flower's server loop uses:
the strategy is built and asked for its initial parameters, then the clients are built (with
``client_app.build_client``, the simulation's own path) and every message goes through an
in-process proxy. Recording:

    python tests/golden.py            # (re)writes tests/golden/*.json from the code as it is

    python tests/golden.py --this-machine   # records this CPU kind's files in tests/golden/machines/

The reference files hold exact hashes and, for other machines, values to compare within a tolerance. Float
kernels round differently on another CPU model, so a machine kind whose files are in ``machines/`` (recorded
at a commit whose suite passes, and checked against the reference by ``tests/test_golden.py``) is held to
its own files bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

# The golden files were recorded with torch's AVX2 CPU kernels (and oneDNN's and MKL's). On a machine with
# AVX-512 torch would pick wider kernels, which round differently. Pinned to AVX2, a machine of the same CPU
# model reproduces the files bit for bit; another model's MKL and oneDNN still block their loops their own
# way, hence the per-kind files in golden/machines/. Set before torch is imported (conftest imports this
# module first); a value already in the environment wins.
KERNELS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
for _name, _value in KERNELS.items():
    os.environ.setdefault(_name, _value)
# torch.compile's C++ code in inductor's disk cache is reused whatever ATEN_CPU_CAPABILITY it was compiled under
# (torch 2.14): the suite's AVX2 code crashed a later unpinned process on an AVX-512 machine, and the reverse
# gave NaN. So the suite compiles into a cache folder of its own pin (docs/implementation-choices.md).
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(tempfile.gettempdir(), f"torchinductor-fedbr-tests-{os.environ['ATEN_CPU_CAPABILITY'].lower()}"),
)

from fakes import TIMING_KEYS, FixedClientManager, InProcessProxy, run_rounds  # noqa: E402

HERE = Path(__file__).resolve().parent
GOLDEN_DIR = HERE / "golden"
MACHINES_DIR = GOLDEN_DIR / "machines"

BASE = {
    "num-clients": 3,
    "num-rounds": 3,
    "local-steps": 2,
    "batch-size": 8,
    "eval-every": 2,
    "checkpoint-every": 2,
    "global-test": False,
    "test-fraction": 0.05,
    "device": "cpu",
}

# name: settings over BASE; every strategy, FedBR's variants and ablations, and its combinations
CASES: dict[str, dict] = {
    "fedavg": {"strategy": "fedavg", "global-test": True},
    "fedavg-samples-momentum-sampled": {
        "strategy": "fedavg",
        "weighting": "samples",
        "momentum": 0.9,
        "weight-decay": 1e-4,
        "fraction-fit": 0.67,
    },
    "fedprox": {"strategy": "fedprox"},
    "scaffold": {"strategy": "scaffold"},
    "moon": {"strategy": "moon"},
    "fedmix": {"strategy": "fedmix"},
    "vhl": {"strategy": "vhl", "vhl-size": 50, "global-test": True},
    "feddecorr": {"strategy": "feddecorr"},
    "fedntd": {"strategy": "fedntd"},
    "fedcm": {"strategy": "fedcm"},
    "mixup": {"strategy": "mixup"},
    "groupdro": {"strategy": "groupdro"},
    "dann": {"strategy": "dann"},
    "feddyn": {"strategy": "feddyn", "feddyn-alpha": 0.1},  # added after the restructuring, recorded on its own
    "distrans-none": {"strategy": "distrans", "distrans-agg": "none"},
    "distrans-avg": {"strategy": "distrans", "distrans-agg": "avg", "weighting": "samples"},
    "distrans-nn": {"strategy": "distrans", "distrans-agg": "nn", "global-test": True},
    "distrans-alternating-auto": {
        "strategy": "distrans",
        "distrans-update": "alternating",
        "partition": "classes",
        "classes-per-client": 6,
    },
    "fedbr": {"strategy": "fedbr"},
    "fedbr-sampled": {"strategy": "fedbr", "fraction-fit": 0.67},
    "fedbr-mixture": {"strategy": "fedbr", "pseudo-data": "mixture"},
    "fedbr-mixture-k0-every-round": {
        "strategy": "fedbr",
        "pseudo-data": "mixture",
        "mixture-k": 0,
        "pseudo-refresh": "every-round",
    },
    "fedbr-rsm-every-round": {"strategy": "fedbr", "pseudo-refresh": "every-round", "pseudo-m": 5},
    "fedbr-no-balance": {"strategy": "fedbr", "fedbr-balance": False},
    "fedbr-no-contrastive": {"strategy": "fedbr", "fedbr-contrastive": False},
    "fedbr-no-max-step": {"strategy": "fedbr", "fedbr-max-step": False},
    "fedaug-mean-output": {"strategy": "fedbr", "fedbr-balance-loss": "mean-output", "fedbr-contrastive": False},
    "fedbr-scales-widths": {
        "strategy": "fedbr",
        "fedbr-tau1-scale": 1.0,
        "fedbr-tau2-scale": 0.0,
        "fedbr-proj-hidden": 64,
        "fedbr-proj-out": 32,
        "fedbr-lambda": 0.5,
        "fedbr-mu": 0.2,
    },
    "fedbr+fedcm": {"strategy": "fedbr", "fedbr-with": "fedcm"},
    "fedbr+feddecorr": {"strategy": "fedbr", "fedbr-with": "feddecorr"},
    "fedbr+fedntd": {"strategy": "fedbr", "fedbr-with": "fedntd"},
    "fedbr+mixup": {"strategy": "fedbr", "fedbr-with": "mixup"},  # recorded as mixup=true, the key it replaced
}

# resumed after round 2 of 4 (stopped after round 3), with fresh strategy, clients and node states
RESUME_CASES: dict[str, dict] = {
    "resume-scaffold": {"strategy": "scaffold"},
    "resume-moon": {"strategy": "moon"},
    "resume-distrans-nn": {"strategy": "distrans", "distrans-agg": "nn"},
    "resume-fedbr+fedcm-every-round": {"strategy": "fedbr", "fedbr-with": "fedcm", "pseudo-refresh": "every-round"},
    "resume-groupdro": {"strategy": "groupdro"},
    "resume-fedmix": {"strategy": "fedmix"},
    "resume-feddyn": {"strategy": "feddyn", "feddyn-alpha": 0.1},
}

MANIFEST_KEYS = ("partition_hash", "num_partitions", "class_counts", "distributional_heterogeneity", "distrans")
DATA_FILES = ("partition.npz", "pseudo_data.npz", "fedmix_data.npz", "vhl_data.npz", "offsets.npz")


# ---------------------------------------------------------------- how this code base is driven
# (the only part that may follow a restructuring: it names the entry points, not the algorithms)


def case_config(settings: dict) -> dict:
    from fedbr_flwr.core.config import validate

    return validate({**BASE, **settings})


def global_arrays(parameters) -> list[np.ndarray]:
    """The global arrays a Parameters object carries, in order (since the restructuring, by name:
    'model/...', then 'head/...' or 'discriminator/...', the order they were recorded in)."""
    from fedbr_flwr.app.payload import from_parameters

    return list(from_parameters(parameters).values())


def build_server(cfg: dict, out: Path):
    from fedbr_flwr.app.checkpointing import ResumedRun
    from fedbr_flwr.app.server_app import build_strategy

    strategy = build_strategy({**cfg, "output-dir": str(out)})
    done = strategy.resumed_round
    return (ResumedRun(strategy, done) if done else strategy), done


def build_clients(cfg: dict) -> list:
    """One NumPyClient per node: per client, or per cohort with engine=cohort (added after recording)."""
    from flwr.common import RecordDict

    from fedbr_flwr.app.node import build_client

    n = cfg["cohorts"] if cfg.get("engine") == "cohort" else cfg["num-clients"]
    return [build_client(cfg, {"partition-id": pid, "num-partitions": n}, RecordDict()) for pid in range(n)]


# ---------------------------------------------------------------- Flower's server loop, in process


def federate(cfg: dict, out: Path, rounds: int):
    """Flower's order: strategy, initial parameters, (clients start), then Flower's rounds (``run_rounds``),
    with discovery in round 1. Returns the last global Parameters."""
    strategy, _ = build_server(cfg, out)
    parameters = strategy.initialize_parameters(None)
    proxies = [InProcessProxy(c, f"node-{1000 + 7 * pid}") for pid, c in enumerate(build_clients(cfg))]
    return run_rounds(strategy, proxies, rounds, FixedClientManager(proxies), parameters)


# ---------------------------------------------------------------- what is recorded


def array_record(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    flat = a.astype(np.float64).ravel()
    probe = np.random.default_rng(len(flat)).standard_normal(len(flat))
    return {
        "shape": list(a.shape),
        "dtype": str(a.dtype),
        "sha256": hashlib.sha256(a.tobytes()).hexdigest(),
        "norm": float(np.linalg.norm(flat)),
        "probe": float(flat @ probe),
    }


def lines_without_timing(path: Path) -> list[dict]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        record = json.loads(line)
        for k in TIMING_KEYS:
            record.pop(k, None)
        record.get("train", {}).pop("fit-seconds", None)
        out.append(record)
    return out


def run_record(out: Path, final) -> dict:
    manifest = json.loads((out / "manifest.json").read_text())
    files = {}
    for name in DATA_FILES:
        if (out / name).exists():
            with np.load(out / name) as data:
                files[name] = {k: array_record(data[k]) for k in sorted(data.files)}
    return {
        "global": [array_record(a) for a in global_arrays(final)],
        "metrics": lines_without_timing(out / "metrics.jsonl"),
        "rounds": lines_without_timing(out / "rounds.jsonl"),
        "manifest": {k: manifest[k] for k in MANIFEST_KEYS if k in manifest},
        "files": files,
    }


def straight_record(settings: dict, out: Path) -> dict:
    cfg = case_config(settings)
    final = federate(cfg, out, cfg["num-rounds"])
    return run_record(out, final)


def resumed_record(settings: dict, out: Path) -> dict:
    """4 rounds, checkpoints every 2: stopped after round 3, resumed from round 2 by new objects."""
    cfg = case_config({**settings, "num-rounds": 4})
    federate(cfg, out, 3)
    final = federate({**cfg, "resume": True}, out, 2)
    return run_record(out, final)


def environment() -> dict:
    import torch

    cpu = ""
    try:
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return {
        "torch": torch.__version__,
        "numpy": np.__version__,
        "machine": platform.machine(),
        "cpu": cpu,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def machine_dir(env: dict) -> Path:
    """Where the golden files of one machine kind (CPU, kernels, torch and numpy) live."""
    kind = f"{env['cpu']} {env['cpu_capability']} torch {env['torch']} numpy {env['numpy']}"
    return MACHINES_DIR / re.sub(r"[^a-z0-9.]+", "-", kind.lower()).strip("-")


def record(name: str, tmp: Path, **overrides) -> dict:
    """A case's record; ``overrides`` change settings that must not change it (engine=cohort)."""
    import torch

    torch.set_num_threads(1)  # what build_client sets for a client with client-cpus = 1
    if name in CASES:
        return straight_record({**CASES[name], **overrides}, tmp)
    return resumed_record({**RESUME_CASES[name], **overrides}, tmp)


def main() -> int:
    args = sys.argv[1:]
    this_machine = "--this-machine" in args
    names = [a for a in args if a != "--this-machine"] or [*CASES, *RESUME_CASES]
    env = environment()
    folder = machine_dir(env) if this_machine else GOLDEN_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        reference = GOLDEN_DIR / f"{name}.json"
        if this_machine and json.loads(reference.read_text())["environment"] == env:
            print(f"{name}: the reference file is this machine kind's already", flush=True)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            result = record(name, Path(tmp))
        path = folder / f"{name}.json"
        path.write_text(
            json.dumps(
                {"case": name, "settings": {**CASES, **RESUME_CASES}[name], "environment": env, **result},
                indent=1,
                sort_keys=True,
            )
            + "\n"
        )
        print(f"wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
