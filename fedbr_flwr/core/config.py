"""Run configuration: one schema, validated the same way by the CLI and the Flower apps.

The schema is the common keys below (``CommonSettings``; ``common(cfg)`` reads them typed) plus the keys
each algorithm and component declares next to its code (``fedbr_flwr.core.settings``), collected by the
registry. Keys are kebab-case, as in Flower's
``[tool.flwr.app.config]``; YAML experiment files may use ``snake_case`` too. ``pyproject.toml``
repeats every key with its default (Flower rejects run-config keys it does not know):
``fedbr-run --write-pyproject`` rewrites that table from the schema, and a test keeps them equal.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from ..data.catalog import INFO
from ..server.robust import RULES, WEIGHTED_RULES, minimum_updates, trimmed_count
from .errors import ConfigError, describe, quoted
from .settings import (
    BELOW_ONE,
    FRACTION,
    NON_NEGATIVE,
    OPEN_FRACTION,
    POSITIVE,
    UNIT_INTERVAL,
    Check,
    DeclaredChoices,
    Key,
    Settings,
    names_list,
    setting,
)

__all__ = ["COMMON", "CommonSettings", "ConfigError", "Key", "common", "defaults", "schema", "validate"]

HALF_FRACTION = Check(lambda v: 0 <= v < 0.5, "in [0, 0.5)")
ATTACKS = ("none", "sign-flip", "scale", "noise", "label-flip", "collude")  # attack.py runs them
TRACKERS = ("tensorboard", "wandb")  # runfiles/tracking.py opens them


def model_names() -> tuple[str, ...]:
    from .model import MODELS  # late: the backbones import torch, which a command loads only to train

    return ("auto", *MODELS)


def common_key(default: Any, help: str, **options: Any) -> Any:
    """A field of ``CommonSettings``: its run-config key is the field's name in kebab-case."""
    return setting("", default, help, **options)


@dataclass(frozen=True)
class CommonSettings(Settings):
    """Every run's keys, typed: ``common(cfg).num_clients`` reads a validated config's ``num-clients``. The
    schema's common part (``COMMON``) is made from these fields, so the two cannot drift."""

    # what runs
    strategy: str = common_key("fedavg", "algorithm name (see `fedbr-run --list`)")
    seed: int = common_key(0, "seed for partition, sampling, init and batches", check=NON_NEGATIVE)
    num_rounds: int = common_key(20, "communication rounds", check=POSITIVE)
    output_dir: str = common_key(
        "", "where the run files go; empty: runs/<strategy>-<dataset>-<time> under the server's cwd"
    )
    git_commit: str = common_key(
        "", "code version recorded in the manifest (fedbr-run fills it in; give it to plain flwr run)"
    )
    # data
    dataset: str = common_key(
        "mnist5k",
        "dataset; synthetic: random CIFAR-size images and labels, for benchmarks",
        choices=tuple(INFO),
    )
    data_dir: str = common_key(
        "",
        "folder holding torchvision's MNIST/ or CIFAR files (not read for mnist5k); empty: "
        "$FEDBR_DATA_DIR, else ${XDG_CACHE_HOME:-~/.cache}/fedbr-flwr/datasets",
        placement=True,
    )
    download: str = common_key(
        "auto",
        "a missing MNIST/CIFAR dataset: download it into the data folder (auto), or stop with a message (never)",
        choices=("auto", "never"),
        placement=True,
    )
    num_clients: int = common_key(
        0,
        "number of clients; 0 = one per SuperNode (Flower's simulation default is 2, fedbr-run then starts 10)",
        check=NON_NEGATIVE,
    )
    partition: str = common_key("fedbr", "label split", choices=("fedbr", "dirichlet", "iid", "classes"))
    alpha: float = common_key(0.1, "Dirichlet concentration of the fedbr/dirichlet splits", check=POSITIVE)
    classes_per_client: int = common_key(2, "classes per client of the 'classes' (pFedHN) split", check=POSITIVE)
    rotate: bool = common_key(True, "domain shift: RotatedMNIST (client i at 15*i deg) / RotatedCIFAR10 angle prior")
    test_fraction: float = common_key(
        0.2, "share of each client's data held out as its local test set", check=OPEN_FRACTION
    )
    # model and local training
    model: str = common_key("auto", "backbone (fedbr_flwr/core/model.py: MODELS)", choices=DeclaredChoices(model_names))
    local_steps: int = common_key(10, "local SGD steps per round (batches drawn with replacement)", check=POSITIVE)
    batch_size: int = common_key(32, "local batch size", check=POSITIVE)
    lr: float = common_key(0.05, "client SGD learning rate", check=POSITIVE)
    momentum: float = common_key(0.0, "client SGD momentum", check=BELOW_ONE)
    weight_decay: float = common_key(0.0, "client SGD weight decay", check=NON_NEGATIVE)
    clip_grad_norm: float = common_key(
        0.0,
        "clip each local SGD step's gradient to this L2 norm, per client, over the parameters the step "
        "trains, after the algorithm's corrections (the FedDyn authors' code clips at 10); 0: no clipping",
        check=NON_NEGATIVE,
    )
    device: str = common_key(
        "auto", "client training device; auto = cuda when available", choices=("auto", "cpu", "cuda")
    )
    precision: str = common_key(
        "fp32",
        "local steps in fp32, or in bf16 (weights and optimiser stay fp32): per client and "
        "with cohort-step=loop under autocast (a region per step, no weight cache); with cohort-step=vmap/graph "
        "every module cast to bf16 (norm layers and softmax too); both land about equally far from fp32, "
        "and as far from each other: bf16 rounding (docs/implementation-choices.md; measured: docs/benchmarks.md)",
        choices=("fp32", "bf16"),
    )
    compile: bool = common_key(
        False,
        "torch.compile on the clients: the backbone's feature extractor, and in a vmapped cohort step "
        "(cohort-step=vmap or graph) each local step's gradients; the first round pays the compilation",
    )
    tf32: bool = common_key(
        True,
        "on CUDA, fp32 matrix products and convolutions on TF32 tensor cores (what the authors' PyTorch 1.7 "
        "did on Ampere by default); false: strict fp32. No effect on a CPU",
    )
    cudnn_autotune: bool = common_key(
        True,
        "on CUDA, cuDNN times its convolution algorithms once per shape and keeps the fastest "
        "(torch.backends.cudnn.benchmark). No effect on a CPU",
    )
    # server
    fraction_fit: float = common_key(1.0, "share of clients sampled per round", check=FRACTION)
    weighting: str = common_key("uniform", "averaging weights", choices=("uniform", "samples"))
    aggregation: str = common_key(
        "mean",
        "how the server combines the clients' arrays (every array of every strategy): mean, coordinate-wise "
        "median or trimmed-mean, krum / multi-krum (Krum's pick, or the mean of the n - f best-scored updates), "
        "norm-bound (each update clipped to a norm, then averaged); docs/robust-aggregation.md",
        choices=RULES,
    )
    trim_fraction: float = common_key(
        0.1,
        "aggregation=trimmed-mean: share of values cut at each end of each coordinate",
        check=HALF_FRACTION,
    )
    byzantine_clients: int = common_key(
        1,
        "aggregation=krum / multi-krum: attackers assumed among a round's updates (f; needs n > 2f + 2)",
        check=NON_NEGATIVE,
    )
    norm_bound: float = common_key(
        0.0,
        "aggregation=norm-bound: the largest norm of a client's update (0: norm-bound-multiple x the round's median)",
        check=NON_NEGATIVE,
    )
    norm_bound_multiple: float = common_key(
        1.0,
        "aggregation=norm-bound with norm-bound = 0: the bound as a multiple of the median update norm",
        check=POSITIVE,
    )
    eval_every: int = common_key(2, "evaluate the global model every E rounds (and at the last)", check=POSITIVE)
    global_test: bool = common_key(
        True,
        "also evaluate the global model on the balanced global test (server side): the dataset's test split "
        "once per angle 0, 15, ..., 135 under rotation (the 0 degree copy unrotated), else once",
    )
    extra_local_tests: bool = common_key(
        False,
        "RotatedMNIST (mnist, mnist5k): also evaluate the global model on the reference code's 10 extra local "
        "test sets (server side): the test split dealt into 10 sets by fresh Dirichlet(alpha) label draws, set k "
        "rotated 15*k degrees",
    )
    server_test_every: int = common_key(
        0,
        "run the server-side tests (global-test, extra-local-tests) every N rounds, a multiple of eval-every, "
        "and at the last; 0: at every evaluation",
        check=NON_NEGATIVE,
    )
    target_acc: float = common_key(0.5, "threshold for 'rounds to reach' in the summary", check=FRACTION)
    engine: str = common_key(
        "clients",
        "simulation engine: one Flower node per client (clients), or per cohort of clients "
        "that one process trains (cohort; simulation only)",
        choices=("clients", "cohort"),
        placement=True,
    )
    cohorts: int = common_key(
        0,
        "engine=cohort: the number of cohorts (Flower nodes); 0 = one per GPU, or on a CPU one per client-cpus cores",
        check=NON_NEGATIVE,
        placement=True,
    )
    cohort_step: str = common_key(
        "auto",
        "engine=cohort: how a cohort steps its clients: loop (one after another), vmap (all "
        "at once, torch.func.vmap over the clients), graph (vmap, each round's step captured "
        "once as a CUDA graph and replayed; GPU only), auto (on a GPU graph where the "
        "algorithm's graph step is checked on a GPU, else vmap where it has a vectorised step; else loop)",
        choices=("auto", "loop", "vmap", "graph"),
        placement=True,
    )
    cohort_conv: str = common_key(
        "grouped",
        "engine=cohort with a vmapped step (cohort-step=vmap or graph): how the clients' convolutions are "
        "batched: grouped (vmap's own, one grouped convolution), matmul (each client's weights times its "
        "unfolded input patches, batched matrix products); the same up to rounding (docs/engines.md)",
        choices=("grouped", "matmul"),
        placement=True,
    )
    # simulation resources (used by the CLI; recorded in the manifest)
    client_cpus: int = common_key(
        1, "CPU cores per simulated client (also its torch threads)", check=POSITIVE, placement=True
    )
    client_gpus: float = common_key(
        0.0,
        "GPU share per simulated client; the CLI picks one when CUDA is present",
        check=UNIT_INTERVAL,
        placement=True,
    )
    backend: str = common_key(
        "auto",
        "simulation: where the clients run: in-process (threads of the simulation process: no Ray or client processes "
        "to start; fedbr-run and fedbr-sweep on this machine's CPUs), ray (Flower's Ray backend: "
        "processes of their own, GPU shares, clusters; what `flwr run` always uses), auto (in-process on a CPU "
        "without a Ray cluster, else ray)",
        choices=("auto", "in-process", "ray"),
        placement=True,
    )
    ray_address: str = common_key(
        "",
        "simulation: the running Ray cluster to join (host:port of its head, or auto for the one `ray start` "
        "left on this machine); empty: the RAY_ADDRESS environment variable if set, else a private Ray runtime "
        "(local forces that)",
        placement=True,
    )
    # faults and checkpoints
    min_fit_clients: int = common_key(
        1,
        "fewest valid client updates that may change the global model; a round with fewer "
        "keeps it unchanged (recorded in rounds.jsonl)",
        check=POSITIVE,
    )
    round_timeout: float = common_key(
        0.0,
        "seconds the server waits for a round's answers; clients still busy then count as "
        "failed (0: wait for every client)",
        check=NON_NEGATIVE,
    )
    checkpoint_every: int = common_key(
        5,
        "save the server's whole state to checkpoint.npz every N rounds and at the last (0: never)",
        check=NON_NEGATIVE,
    )
    # simulated attacks (experiments): docs/robust-aggregation.md
    attack: str = common_key(
        "none",
        "what the attacking clients send after local training: sign-flip (g - factor x update), scale "
        "(g + factor x update), noise (g + sigma x its own normal draw), label-flip (trains on labels C-1-y), "
        "collude (g + sigma x one normal draw all attackers share)",
        choices=ATTACKS,
    )
    attack_clients: int = common_key(0, "how many clients attack, drawn from the run seed", check=NON_NEGATIVE)
    attack_ids: str = common_key("", "which clients attack, as partition ids (e.g. 0,4,7); instead of attack-clients")
    attack_factor: float = common_key(
        10.0, "attack=sign-flip / scale: the factor on the attacker's update", check=POSITIVE
    )
    attack_noise: float = common_key(
        1.0, "attack=noise / collude: sigma of the noise sent as the update", check=POSITIVE
    )
    attack_arrays: str = common_key(
        "model",
        "which arrays an attacker poisons: model (the ones the server sent it: its model update), all (also those "
        "it returns beside them, each as a change from zero: SCAFFOLD's control-variate change, DisTrans' offset "
        "where the server sent none)",
        choices=("model", "all"),
    )
    resume: bool = common_key(
        False, "continue the run in output-dir from its checkpoint (`fedbr-run --resume DIR` sets it)"
    )
    overwrite: bool = common_key(
        False,
        "start the run again in an output-dir that holds one, replacing its files (`fedbr-run --overwrite` sets "
        "it); without it the server refuses such a folder",
    )
    # experiment tracking (server side; docs/running.md)
    tracking: tuple[str, ...] = common_key(
        "none",
        "also log each round's metrics, evaluations and the config to tensorboard (the run folder's tensorboard/) "
        "and/or wandb (respects WANDB_MODE=offline), comma-separated; each needs its extra "
        '(pip install -e ".[tensorboard]", ".[wandb]"; docs/running.md)',
        check=Check(
            lambda v: set(names_list(v)) <= set(TRACKERS), f"none or a comma-separated list of: {', '.join(TRACKERS)}"
        ),
        names=True,
    )


COMMON: dict[str, Key] = CommonSettings.keys(owner=None)


def common(cfg: Mapping[str, Any]) -> CommonSettings:
    """The typed view of a validated config's common keys (``names`` keys as tuples)."""
    return CommonSettings.from_config(cfg)


# where a run's data and clients are, not what it computes (``Key.placement``)
PLACEMENT_KEYS = tuple(name for name, key in COMMON.items() if key.placement)
# ... and the keys that only record or report it: a sweep keeps a finished run that differs in these only
NO_EFFECT_KEYS = (*PLACEMENT_KEYS, "output-dir", "git-commit", "checkpoint-every", "tracking", "overwrite")
# a run continued from its checkpoint (fedbr-run --resume) may differ in these too: it may run longer, evaluate
# on another schedule or wait for other clients; any other key must equal the checkpoint's
RESUMABLE_KEYS = (*NO_EFFECT_KEYS, "num-rounds", "round-timeout", "min-fit-clients", "eval-every", "resume")
# ... as a resume's messages name them (the three that fedbr-run --resume sets itself left out)
CHANGEABLE_ON_RESUME = ", ".join(k for k in RESUMABLE_KEYS if k not in ("resume", "git-commit", "output-dir"))

# keys of earlier versions: what replaced them
REPLACED = {
    "mixup": "FedBR on the Mixup backbone is fedbr-with=mixup now (and strategy=mixup is FedAvg + Mixup)",
}


def schema() -> dict[str, Key]:
    """Every key of a run: the common ones, then each algorithm's and component's (by owner name)."""
    from .registry import owned_keys  # late import: the registry imports the algorithm packages

    return {**COMMON, **owned_keys()}


def defaults() -> dict[str, Any]:
    return {k: v.default for k, v in schema().items()}


def as_it_ran(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A stored run's config (its manifest's or checkpoint's) with the keys its version did not have yet at their
    defaults: a new key keeps the old behaviour by default, so that is how the run behaved."""
    return {**defaults(), **saved}


def changed_on_resume(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """The keys of ``now`` that a resume may not change (not RESUMABLE_KEYS) whose value differs from the stored
    run's config ``saved`` (as it ran)."""
    ran = as_it_ran(saved)
    return sorted(k for k in now if k not in RESUMABLE_KEYS and k in ran and ran[k] != now[k])


def _coerce(key: str, spec: Key, value: Any) -> Any:
    default = spec.default
    if spec.names and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        value = ",".join(value) or "none"
    if isinstance(value, str) and isinstance(default, (int, float)) and not isinstance(default, bool):
        value = _yaml_number(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):  # YAML's .inf / .nan, or 1e999
                raise ConfigError(f"config key '{key}' must be a finite number, got {quoted(value)}")
            return float(value)
    elif isinstance(default, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if not INT64_MIN <= value <= INT64_MAX:  # Flower's run config carries 64-bit integers
                raise ConfigError(f"config key '{key}' = {quoted(value)} does not fit a 64-bit integer")
            return value
    elif isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        value = str(value)  # YAML reads attack-ids=3 or output-dir=2024 as a number: the text was meant
        if not value.isprintable():  # run_config.toml, Flower's copy of it, could not hold it
            raise ConfigError(
                f"config key '{key}' = {quoted(value)} holds a control character or bytes that are not UTF-8 text"
            )
        return ",".join(v.strip() for v in value.split(",")) if spec.names else value
    hint = ""
    if isinstance(value, bool) and isinstance(default, str):  # output-dir=on, tracking=off
        hint = f"; YAML reads yes, no, on, off, true and false as a bool: quote the text, e.g. {key}=\"'on'\""
    if isinstance(value, list) and isinstance(default, str):  # attack-ids: [0, 3] in a YAML file
        hint = f"; write it as text, comma-separated: {key}: {','.join(map(str, value))}"
    raise ConfigError(
        f"config key '{key}' must be {'a list of names' if spec.names else type(default).__name__}, "
        f"got {type(value).__name__} {quoted(value)}{hint}"
    )


def _yaml_number(text: str) -> Any:
    """A number YAML left as text: ``1e-3`` (1.1 wants a dot), and ``nan`` or ``inf`` (it wants ``.nan``, which
    the finite check then names); other text stays text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def normalise_key(key: str) -> str:
    return str(key).strip().replace("_", "-")


def unknown_key(raw_key: str, keys: Mapping[str, Key]) -> ConfigError:
    key = normalise_key(raw_key)
    if key in REPLACED:
        return ConfigError(f"config key '{raw_key}' is gone: {REPLACED[key]}")
    close = difflib.get_close_matches(key, keys, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown config key {quoted(raw_key)}.{hint} Valid keys: {', '.join(keys)}")


def validate(overrides: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Return a complete config: ``base`` (default: the defaults) updated with checked ``overrides``."""
    keys = schema()
    cfg = dict(defaults() if base is None else base)
    for raw_key, value in overrides.items():
        key = normalise_key(raw_key)
        if key not in keys:
            raise unknown_key(raw_key, keys)
        cfg[key] = _coerce(key, keys[key], value)
    for key, spec in keys.items():
        v = cfg[key]
        if spec.choices is not None and v not in spec.choices:
            raise ConfigError(f"config key '{key}' = {quoted(v)} is not one of: {', '.join(spec.choices)}")
        if spec.check is not None and not spec.check(v):
            raise ConfigError(f"config key '{key}' = {quoted(v)} must be {spec.check.message}")
    _check_consistency(cfg)
    _check_ownership(cfg, overrides, keys)
    return cfg


def components_of(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """The components a run's local steps carry: its variant's, its client's own (GroupDRO's mixup), then
    those its host's key lists (FedBR's ``fedbr-with``), in that order."""
    from .registry import COMPONENTS, VARIANTS, load_all, lookup_client

    load_all()
    name = cfg["strategy"]
    built_in = (VARIANTS[name].components if name in VARIANTS else ()) + lookup_client(name).carried_components(cfg)
    key = lookup_client(name).component_key
    if not key:
        return built_in
    listed = names_list(cfg[key])
    unknown = [c for c in listed if c not in COMPONENTS]
    if unknown or len(set(listed)) != len(listed):
        close = difflib.get_close_matches(unknown[0], COMPONENTS, n=1) if unknown else []
        problem = f"names no component {', '.join(unknown)}" if unknown else "names a component twice"
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"config key '{key}' = {cfg[key]!r} {problem}.{hint} Components: {', '.join(sorted(COMPONENTS))}"
        )
    return built_in + listed


def active_owners(cfg: Mapping[str, Any]) -> list[str]:
    """The names whose keys apply to a run: its algorithm and what that builds on (``registry.lineage``: a
    variant's base, a subclassed algorithm), then its components."""
    from .registry import lineage

    return list(dict.fromkeys(lineage(cfg["strategy"]) + list(components_of(cfg))))


def _check_ownership(cfg: Mapping[str, Any], overrides: Mapping[str, Any], keys: Mapping[str, Key]) -> None:
    """A key set to a non-default value for a run that ignores it is a mistake worth stopping for."""
    from .registry import how_to_enable

    active = active_owners(cfg)
    for raw_key in overrides:
        key = normalise_key(raw_key)
        owner = keys[key].owner
        if owner is not None and owner not in active and cfg[key] != keys[key].default:
            valid = [k for k, spec in keys.items() if spec.owner in active]
            name = " + ".join(active)
            raise ConfigError(
                f"config key '{raw_key}' belongs to {owner} ({how_to_enable(owner)}), not to '{name}'. "
                f"Keys of '{name}': {', '.join(valid) or 'none beyond the common ones'}"
            )


def parse_ids(text: str) -> list[int]:
    """``attack-ids`` ("0,4,7") as partition ids."""
    try:
        named = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        named = []
    if not named:  # "," named no client: an attack run without an attacker
        raise ConfigError(f"attack-ids = '{text}' must be partition ids separated by commas, e.g. 0,4,7")
    if len(set(named)) < len(named):  # a typo for another client, which then did not attack
        raise ConfigError(f"attack-ids = '{text}' names a client twice")
    return sorted(set(named))


def check_attack(cfg: Mapping[str, Any]) -> None:
    """One-line errors for an attack that cannot run as configured."""
    kind, count, ids = cfg["attack"], cfg["attack-clients"], cfg["attack-ids"]
    if kind == "none":
        if count or ids or cfg["attack-arrays"] != "model":
            raise ConfigError(
                "attack-clients / attack-ids / attack-arrays are set but attack = none: name the attack "
                f"({', '.join(ATTACKS[1:])})"
            )
        return
    if kind == "label-flip" and cfg["attack-arrays"] != "model":
        raise ConfigError("attack-arrays = all changes a reply, and label-flip sends its reply as trained")
    if count and ids:
        raise ConfigError("set attack-clients (how many, drawn by the seed) or attack-ids (which), not both")
    if not count and not ids:
        raise ConfigError(f"attack = {kind} needs the attackers: attack-clients (a count) or attack-ids (e.g. 0,4,7)")
    n = cfg["num-clients"]
    chosen = parse_ids(ids) if ids else []
    if n and count > n:
        raise ConfigError(f"attack-clients = {count} attackers, but the run has {n} clients")
    if n and any(not 0 <= p < n for p in chosen):
        raise ConfigError(f"the attackers ({ids}) must be among the {n} clients (ids 0..{n - 1})")


def check_batch_sizes(cfg: Mapping[str, Any]) -> None:
    """batch-size (and a pseudo-batch's size) at most the dataset's training split: a client draws its batch
    from its own partition, a part of that split."""
    limit = INFO[cfg["dataset"]].train_size
    for key in ("batch-size", "pseudo-size"):
        if cfg.get(key, 0) > limit:
            raise ConfigError(
                f"config key '{key}' = {cfg[key]} exceeds the {limit} training images of {cfg['dataset']}: "
                f"a batch is drawn from one client's share of them; use at most {limit}"
            )


def _check_consistency(cfg: Mapping[str, Any]) -> None:
    from .registry import algorithm_names, settings_of

    names = algorithm_names()
    if cfg["strategy"] not in names:
        close = difflib.get_close_matches(cfg["strategy"], names, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown strategy {quoted(cfg['strategy'])}.{hint} Valid: {', '.join(names)}")
    num_classes = INFO[cfg["dataset"]].num_classes
    if cfg["partition"] == "classes" and cfg["classes-per-client"] > num_classes:
        raise ConfigError(
            f"'classes-per-client' = {cfg['classes-per-client']} exceeds the {num_classes} classes of {cfg['dataset']}"
        )
    check_batch_sizes(cfg)
    check_sampling(cfg)
    check_cohort_step(cfg)
    check_server_tests(cfg)
    check_aggregation(cfg)
    check_attack(cfg)
    for settings in dict.fromkeys(settings_of(owner) for owner in active_owners(cfg)):  # their cross-key checks
        settings.check(cfg)


def check_cohort_step(cfg: Mapping[str, Any]) -> None:
    from .registry import lookup_client

    step = cfg["cohort-step"]
    if cfg["cohort-conv"] != "grouped" and (step == "loop" or cfg["engine"] != "cohort"):
        raise ConfigError(
            f"cohort-conv={cfg['cohort-conv']} batches the convolutions of a vmapped cohort step: it needs "
            "engine=cohort and cohort-step=vmap, graph or auto"
        )
    if step not in ("vmap", "graph"):
        return
    if cfg["engine"] != "cohort":
        raise ConfigError(f"cohort-step={step} steps the clients of a cohort together: it needs engine=cohort")
    if step == "graph" and cfg["device"] == "cpu":
        raise ConfigError(
            "cohort-step=graph replays CUDA graphs: it needs device=cuda or auto on a GPU (on a CPU use loop or vmap)"
        )
    if not lookup_client(cfg["strategy"]).vectorised:
        raise ConfigError(
            f"strategy '{cfg['strategy']}' has no vectorised local step: use cohort-step=loop "
            "(or auto, which picks loop for it)"
        )
    if cfg["compile"] and not lookup_client(cfg["strategy"]).compiles_vectorised:
        raise ConfigError(
            f"compile=true cannot compile the vectorised step of strategy '{cfg['strategy']}': use compile=false, "
            "or cohort-step=loop (or auto, which picks loop for it)"
        )


def check_server_tests(cfg: Mapping[str, Any]) -> None:
    every, eval_every = cfg["server-test-every"], cfg["eval-every"]
    if every and every % eval_every:
        raise ConfigError(
            f"server-test-every = {every} is not a multiple of eval-every = {eval_every}: the server-side tests "
            "are recorded with an evaluation (use a multiple of eval-every, or 0 for every evaluation)"
        )
    if cfg["extra-local-tests"] and INFO[cfg["dataset"]].rotation != "client":
        raise ConfigError(
            f"extra-local-tests = true is RotatedMNIST's (dataset mnist or mnist5k), not {cfg['dataset']}'s: "
            "the reference code builds them for RotatedMNIST only"
        )


def sampled_per_round(fraction_fit: float, num_clients: int) -> int:
    return min(num_clients, max(1, int(round(fraction_fit * num_clients))))


def check_sampling(cfg: Mapping[str, Any]) -> None:
    """min-fit-clients must be reachable (checked once num-clients is known)."""
    if not cfg["num-clients"]:
        return
    sampled = sampled_per_round(cfg["fraction-fit"], cfg["num-clients"])
    if cfg["min-fit-clients"] > sampled:
        raise ConfigError(
            f"min-fit-clients = {cfg['min-fit-clients']} but only {sampled} of the {cfg['num-clients']} "
            f"clients are sampled per round (fraction-fit = {cfg['fraction-fit']}): lower "
            "min-fit-clients or raise fraction-fit"
        )


def check_aggregation(cfg: Mapping[str, Any]) -> None:
    """A rule without a weighted form refuses weights; once num-clients is known, each rule needs the sampled
    clients it can aggregate as itself (``minimum_updates``: Krum's n > 2f + 2, 3 for the median and relative
    norm-bound; trimmed mean a cut at each end)."""
    rule = cfg["aggregation"]
    if rule not in WEIGHTED_RULES:
        if cfg["weighting"] == "samples":
            raise ConfigError(
                f"aggregation={rule} has no weighted form: use weighting=uniform, or one of {', '.join(WEIGHTED_RULES)}"
            )
        if cfg["strategy"] == "groupdro":
            raise ConfigError(
                f"groupdro weighs clients by its own rule, and aggregation={rule} has no weighted form: "
                f"use one of {', '.join(WEIGHTED_RULES)}"
            )
    if not cfg["num-clients"]:
        return
    sampled = sampled_per_round(cfg["fraction-fit"], cfg["num-clients"])
    from .registry import lookup_strategy  # late import: the registry imports the algorithm packages

    # arrays beside the model (SCAFFOLD's control changes) are bounded by a multiple of their median size
    judged = lookup_strategy(cfg["strategy"]).may_judge_groups(cfg)
    need = minimum_updates(rule, cfg["byzantine-clients"], cfg["trim-fraction"], cfg["norm-bound"], judged)
    clients = f"the {sampled} client{'s' if sampled > 1 else ''} sampled a round"
    if rule == "trimmed-mean":
        check_trim_cuts(cfg["trim-fraction"], sampled)
    elif rule == "median" and sampled < need:
        raise ConfigError(f"aggregation=median over {clients} is their mean: sample at least {need}")
    elif rule == "norm-bound" and sampled < need and cfg["norm-bound"] > 0:
        raise ConfigError(
            f"aggregation=norm-bound bounds {cfg['strategy']}'s arrays beside the model by a multiple of their median "
            f"size, and over {clients} that is their mean size, which one of them sets: sample at least {need}"
        )
    elif rule == "norm-bound" and sampled < need:
        raise ConfigError(
            f"aggregation=norm-bound relative to the median norm of {clients} is relative to their mean norm, which "
            f"one of them sets: sample at least {need}, or set norm-bound"
        )
    elif rule in ("krum", "multi-krum") and sampled < need:
        raise ConfigError(
            f"aggregation={rule} with byzantine-clients = {cfg['byzantine-clients']} needs n > 2f + 2, i.e. at least "
            f"{need} clients a round, but {sampled} are sampled: lower byzantine-clients or sample more clients"
        )


def check_trim_cuts(fraction: float, sampled: int) -> None:
    """trimmed-mean must cut a value at each end of a full round, else it is the plain mean under another name."""
    if trimmed_count(sampled, fraction):
        return
    fix = (
        f"raise trim-fraction to at least {math.ceil(100 / sampled) / 100:g}, or sample more clients"
        if sampled > 2
        else "sample at least 3 clients a round"
    )
    raise ConfigError(
        f"aggregation=trimmed-mean with trim-fraction = {fraction:g} cuts floor({fraction:g} x {sampled}) = 0 values "
        f"at each end of the {sampled} clients sampled a round: it would be the plain mean; {fix}"
    )


def from_run_config(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Config inside the Flower apps: the run config Flower hands over, checked again."""
    keys = schema()
    return validate({k: v for k, v in run_config.items() if normalise_key(k) in keys})


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
YAML_MAX_BYTES = 1 << 20  # an experiment file is a few dozen lines
YAML_MAX_DEPTH = 20


class BoundedLoader(yaml.SafeLoader):
    """YAML's safe loader without anchors and aliases (a few hundred bytes of nested aliases expand to
    gigabytes) and with a bounded nesting depth (a deep list would exhaust Python's stack)."""

    def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
        """A mapping whose key appears twice is refused: YAML would keep the last value without a word."""
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.YAMLError(f"key {quoted(str(key))} appears twice (line {key_node.start_mark.line + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError("anchors and aliases (& and *) are not supported here; write the values out")
        self._depth = getattr(self, "_depth", 0) + 1
        try:
            if self._depth > YAML_MAX_DEPTH:
                raise yaml.YAMLError(f"nested deeper than {YAML_MAX_DEPTH} levels")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


YAML_INT, YAML_TIMESTAMP = "tag:yaml.org,2002:int", "tag:yaml.org,2002:timestamp"
# YAML 1.2's integers rather than PyYAML's 1.1 ones (010 is ten, not octal 8; 1:30 is text, not 90), and no
# timestamps (no key takes a date; output-dir=2024-01-01 is a folder's name)
BoundedLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag not in (YAML_INT, YAML_TIMESTAMP)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
BoundedLoader.add_implicit_resolver(
    YAML_INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)


def yaml12_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node))
    return int(text, 0) if text[:2] in ("0o", "0x") else int(text, 10)


BoundedLoader.add_constructor(YAML_INT, yaml12_int)


def read_yaml(text: str) -> Any:
    try:
        return yaml.load(text, Loader=BoundedLoader)  # noqa: S506  (a safe loader, bounded)
    except (TypeError, ValueError, OverflowError) as exc:  # a value YAML's constructors cannot build: {[1]: 2},
        raise yaml.YAMLError(f"a value that cannot be read ({describe(exc)})") from None  # 2024-13-01, !!float x


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        if path.is_dir():
            raise ConfigError(f"{quoted(str(path), 300)} is a directory; give the experiment file (.yaml) in it")
        if path.exists() and not path.is_file():
            raise ConfigError(f"{quoted(str(path), 300)} is not a regular file; give an experiment file (.yaml)")
        if not path.is_file():
            raise ConfigError(f"experiment file not found: {quoted(str(path), 300)}")
        if path.stat().st_size > YAML_MAX_BYTES:
            raise ConfigError(
                f"{path} holds {path.stat().st_size} bytes; an experiment file may hold at most {YAML_MAX_BYTES}"
            )
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text; save the experiment file as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {quoted(str(path), 300)}: {exc.strerror}") from None
    try:
        data = read_yaml(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {yaml_problem(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, got {type(data).__name__}")
    spelled: dict[str, Any] = {}
    for key in data:  # num_rounds and num-rounds: YAML keeps both, and one would silently win
        first = spelled.setdefault(normalise_key(key), key)
        if first != key:
            raise ConfigError(f"{path}: {quoted(str(first))} and {quoted(str(key))} are the same config key; keep one")
    return data


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error in one line: the problem and where (PyYAML's own text spans 2-5 lines with a caret)."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        context = getattr(exc, "context", None)
        text = f"{context}, {problem}" if context else problem
        return f"line {mark.line + 1}, column {mark.column + 1}: {text}"[:500]
    return " ".join(str(exc).split())[:500]


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as YAML (``lr=0.01``, ``rotate=false``, ``dataset=mnist``)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key=value")
    key, raw = text.split("=", 1)
    if raw.strip() == "~":  # YAML's null, but on a command line the home folder (data-dir=~)
        return key.strip(), "~"
    try:
        value = read_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), "" if value is None else value


def to_toml(cfg: Mapping[str, Any]) -> str:
    """Serialise a flat config as a TOML run-config file for ``flwr run --run-config``."""
    lines = []
    for k, v in cfg.items():
        if isinstance(v, bool):
            lines.append(f"{k} = {'true' if v else 'false'}")
        elif isinstance(v, (int, float)):
            lines.append(f"{k} = {v!r}")
        else:
            escaped = str(v).replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'{k} = "{escaped}"')
    return "\n".join(lines) + "\n"


def resolved_model(cfg: Mapping[str, Any]) -> str:
    if cfg["model"] != "auto":
        return cfg["model"]
    return INFO[cfg["dataset"]].default_model


CONFIGURATION_PAGE_HEAD = """# Configuration reference

Every key a run takes, with its type, default, allowed values and meaning. Set them in an experiment
file (YAML), as `key=value` on the command line (later ones win), or in `flwr run --run-config`.
Values read as YAML 1.2 numbers: `010` is ten, and `1:30` or `2024-01-01` stay text.
`fedbr-run` checks every key and type before anything starts: an unknown key (with a "did you mean"),
a value of the wrong type or outside its range, or a key of an algorithm the run does not use set to other
than its default, stops the run with exit 2 and one line. `fedbr-run --list` prints the keys with their
defaults and choices in a terminal.

This page is generated from the settings schema by `fedbr-run --write-docs`; a test fails when it is
stale, so edit the `setting(...)` declarations, not this page.
"""


def _markdown_cell(value: str) -> str:
    return value.replace("|", "\\|")


def configuration_reference() -> str:
    """docs/configuration.md: every key of the schema, grouped by owner (common keys first), as tables."""
    from .registry import how_to_enable

    lines, owner = [CONFIGURATION_PAGE_HEAD.rstrip("\n")], object()
    for key, spec in schema().items():
        if spec.owner != owner:
            owner = spec.owner
            heading = "Common keys" if owner is None else f"`{owner}` (with {how_to_enable(owner)})"
            lines += ["", f"## {heading}", "", "| key | type | default | values | meaning |", "|---|---|---|---|---|"]
        kind = "names" if spec.names else type(spec.default).__name__
        values = (
            " \\| ".join(f"`{c}`" for c in spec.choices) if spec.choices else (spec.check.message if spec.check else "")
        )
        default = to_toml({key: spec.default}).strip().split(" = ", 1)[1]
        lines.append(f"| `{key}` | {kind} | `{default}` | {values} | {_markdown_cell(spec.help)} |")
    return "\n".join(lines) + "\n"


def pyproject_table() -> str:
    """The ``[tool.flwr.app.config]`` table of pyproject.toml: every key with its default, grouped by owner."""
    lines, owner = [], object()
    for key, spec in schema().items():
        if spec.owner != owner:
            owner = spec.owner
            lines.append(f"# {owner or 'common keys'}")
        lines.append(to_toml({key: spec.default}).strip())
    return "\n".join(lines) + "\n"
