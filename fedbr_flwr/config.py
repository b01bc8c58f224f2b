"""Run configuration: one schema, validated the same way by the CLI and the Flower apps.

Keys are kebab-case, as in Flower's ``[tool.flwr.app.config]``. ``pyproject.toml`` repeats the
defaults (Flower rejects run-config keys it does not know); a test keeps the two equal.
YAML experiment files may use ``snake_case`` too.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message says how."""


@dataclass(frozen=True)
class Key:
    default: Any
    help: str
    choices: tuple | None = None
    check: Callable[[Any], bool] | None = None
    check_msg: str = ""
    owners: tuple[str, ...] | None = None  # strategies the key belongs to; None: every strategy


def _positive(v) -> bool:
    return v > 0


def _non_negative(v) -> bool:
    return v >= 0


def _fraction(v) -> bool:
    return 0 < v <= 1


def _open_fraction(v) -> bool:
    return 0 < v < 1


FEDBR = ("fedbr",)
MIXUP_USERS = ("fedbr", "mixup")
DISTRANS = ("distrans",)
# "fedbr+<name>": the key also belongs to FedBR when combined with <name> (fedbr-with=<name>; paper Table 3)
COMBINABLE = ("fedcm", "feddecorr", "fedntd")


SCHEMA: dict[str, Key] = {
    # what runs
    "strategy": Key("fedavg", "algorithm name (see `fedbr-run --list`)"),
    "seed": Key(0, "seed for partition, sampling, init and batches", check=_non_negative, check_msg=">= 0"),
    "num-rounds": Key(20, "communication rounds", check=_positive, check_msg="> 0"),
    "output-dir": Key("", "where the run files go; empty: runs/<strategy>-<dataset>-<time> under the server's cwd"),
    "git-commit": Key("", "code version recorded in the manifest (the CLI fills it in)"),
    # data
    "dataset": Key("mnist5k", "dataset; synthetic: random CIFAR-size images and labels, for benchmarks",
                   choices=("mnist5k", "mnist", "cifar10", "cifar100", "synthetic")),
    "data-dir": Key("", "folder holding torchvision's MNIST/ or CIFAR files (not needed for mnist5k)"),
    "num-clients": Key(0, "number of clients; 0 = one per SuperNode (Flower's simulation default is 2, "
                          "fedbr-run then starts 10)", check=_non_negative, check_msg=">= 0"),
    "partition": Key("fedbr", "label split", choices=("fedbr", "dirichlet", "iid", "classes")),
    "alpha": Key(0.1, "Dirichlet concentration of the fedbr/dirichlet splits", check=_positive, check_msg="> 0"),
    "classes-per-client": Key(2, "classes per client of the 'classes' (pFedHN) split", check=_positive,
                              check_msg="> 0"),
    "rotate": Key(True, "domain shift: RotatedMNIST (client i at 15*i deg) / RotatedCIFAR10 angle prior"),
    "test-fraction": Key(0.2, "share of each client's data held out as its local test set",
                         check=_open_fraction, check_msg="in (0, 1)"),
    # model and local training
    "model": Key("auto", "backbone", choices=("auto", "cnn", "vgg11", "cct", "resnet18")),
    "local-steps": Key(10, "local SGD steps per round (batches drawn with replacement)", check=_positive,
                       check_msg="> 0"),
    "batch-size": Key(32, "local batch size", check=_positive, check_msg="> 0"),
    "lr": Key(0.05, "client SGD learning rate", check=_positive, check_msg="> 0"),
    "momentum": Key(0.0, "client SGD momentum", check=lambda v: 0 <= v < 1, check_msg="in [0, 1)"),
    "weight-decay": Key(0.0, "client SGD weight decay", check=_non_negative, check_msg=">= 0"),
    "device": Key("auto", "client training device; auto = cuda when available", choices=("auto", "cpu", "cuda")),
    "precision": Key("fp32", "local steps in fp32, or under bf16 autocast (weights and optimiser stay fp32)",
                     choices=("fp32", "bf16")),
    "compile": Key(False, "torch.compile the backbone's feature extractor on the clients (the first round "
                          "pays the compilation)"),
    # server
    "fraction-fit": Key(1.0, "share of clients sampled per round", check=_fraction, check_msg="in (0, 1]"),
    "weighting": Key("uniform", "averaging weights", choices=("uniform", "samples")),
    "eval-every": Key(2, "evaluate the global model every E rounds (and at the last)", check=_positive,
                      check_msg="> 0"),
    "global-test": Key(True, "also evaluate the global model on the dataset's test split (server side)"),
    "target-acc": Key(0.5, "threshold for 'rounds to reach' in the summary", check=_fraction,
                      check_msg="in (0, 1]"),
    # simulation resources (used by the CLI; recorded in the manifest)
    "client-cpus": Key(1, "CPU cores per simulated client (also its torch threads)", check=_positive,
                       check_msg="> 0"),
    "client-gpus": Key(0.0, "GPU share per simulated client; the CLI picks one when CUDA is present",
                       check=lambda v: 0 <= v <= 1, check_msg="in [0, 1]"),
    # faults and checkpoints
    "min-fit-clients": Key(1, "fewest valid client updates that may change the global model; a round with fewer "
                              "keeps it unchanged (recorded in rounds.jsonl)", check=_positive, check_msg="> 0"),
    "round-timeout": Key(0.0, "seconds the server waits for a round's answers; clients still busy then count as "
                              "failed (0: wait for every client)", check=_non_negative, check_msg=">= 0"),
    "checkpoint-every": Key(5, "save the server's whole state to checkpoint.npz every N rounds and at the last "
                               "(0: never)", check=_non_negative, check_msg=">= 0"),
    "resume": Key(False, "continue the run in output-dir from its checkpoint (`fedbr-run --resume DIR` sets it)"),
    # FedBR (SPEC section 1); the defaults are the authors'
    "fedbr-lambda": Key(1.0, "weight of component 1, the balancing loss on pseudo-data", check=_non_negative,
                        check_msg=">= 0", owners=FEDBR),
    "fedbr-mu": Key(0.5, "weight of component 2, the contrastive loss L_con", check=_non_negative,
                    check_msg=">= 0", owners=FEDBR),
    "fedbr-tau1-scale": Key(2.0, "positive-pair similarity scale: s1 = tau1 * cos (multiplied form)",
                            check=_non_negative, check_msg=">= 0", owners=FEDBR),
    "fedbr-tau2-scale": Key(2.0, "negative-pair similarity scale: s2 = tau2 * cos; 0 drops the negative pair's "
                                 "dependence", check=_non_negative, check_msg=">= 0", owners=FEDBR),
    "fedbr-proj-hidden": Key(0, "projection head hidden width; 0 = 2 x feature size", check=_non_negative,
                             check_msg=">= 0", owners=FEDBR),
    "fedbr-proj-out": Key(0, "projection head output width; 0 = feature size", check=_non_negative,
                          check_msg=">= 0", owners=FEDBR),
    "fedbr-balance": Key(True, "component 1 (classifier balancing on pseudo-data)", owners=FEDBR),
    "fedbr-contrastive": Key(True, "component 2 (min-max contrastive step with the projection head)",
                             owners=FEDBR),
    "fedbr-max-step": Key(True, "component 2's max step on the projection head (false: min step only)",
                          owners=FEDBR),
    "fedbr-balance-loss": Key("soft-ce", "component 1's loss: per-sample soft cross-entropy (FedBR) or "
                                         "cross-entropy of the mean softmax output (FedAug's AugMean)",
                              choices=("soft-ce", "mean-output"), owners=FEDBR),
    "fedbr-with": Key("none", "combine FedBR with another method's local term (paper Table 3; Mixup: mixup=true)",
                      choices=("none", *COMBINABLE), owners=FEDBR),
    "mixup": Key(False, "FedBR on the Mixup backbone: Mixup on the local batch (soft labels); strategy=mixup is "
                        "FedAvg + Mixup", owners=FEDBR),
    "mixup-alpha": Key(0.2, "Mixup's Beta(a, a) parameter", check=_positive, check_msg="> 0",
                       owners=MIXUP_USERS),
    "pseudo-data": Key("rsm", "FedBR pseudo-data: rsm (means of M samples of one client) or mixture (means of "
                              "a public proxy dataset mixed with K local samples each step)",
                       choices=("rsm", "mixture"), owners=FEDBR),
    "pseudo-size": Key(0, "pseudo-samples B; 0 = batch-size (component 2 pairs them with the local batch)",
                       check=_non_negative, check_msg=">= 0", owners=FEDBR),
    "pseudo-m": Key(10, "local (RSM) or proxy (mixture) samples averaged into one pseudo-sample",
                    check=_positive, check_msg="> 0", owners=FEDBR),
    "mixture-k": Key(1, "local samples mixed into each pseudo-sample per step (mixture)", check=_non_negative,
                     check_msg=">= 0", owners=FEDBR),
    "proxy-dataset": Key("auto", "public dataset for mixture pseudo-data, read from data-dir; auto: cifar100 "
                                 "for cifar10, cifar10 for cifar100, mnist5k for MNIST",
                         choices=("auto", "mnist5k", "mnist", "cifar10", "cifar100", "synthetic"), owners=FEDBR),
    "pseudo-refresh": Key("once", "send the pseudo-data once (at round 1) or rebuild it every round",
                          choices=("once", "every-round"), owners=FEDBR),
    # DisTrans (SPEC section 3); the defaults are the paper's (model lr: the common 'lr')
    "distrans-alpha": Key(0.3, "blend weight of the offset in the two input channels", check=_open_fraction,
                          check_msg="in (0, 1)", owners=DISTRANS),
    "distrans-offset-lr": Key(1e-3, "client SGD learning rate of the offset t", check=_positive,
                              check_msg="> 0", owners=DISTRANS),
    "distrans-update": Key("simultaneous", "model and offset from one backward pass per batch (authors' code), "
                                           "or alternating: offset step, then model step (paper)",
                           choices=("simultaneous", "alternating"), owners=DISTRANS),
    "distrans-agg": Key("auto", "server offset aggregation: none (offsets stay with their clients), avg (the "
                                "mean to all), nn (aggregation network), auto (none if DH >= threshold, else nn)",
                        choices=("auto", "none", "avg", "nn"), owners=DISTRANS),
    "distrans-dh-threshold": Key(0.5, "auto picks none at DH >= this, nn below", check=_fraction,
                                 check_msg="in (0, 1]", owners=DISTRANS),
    "distrans-nn-lr": Key(1e-2, "SGD learning rate of the server's offset aggregation network", check=_positive,
                          check_msg="> 0", owners=DISTRANS),
    "distrans-nn-steps": Key(10, "full-batch regression steps of the aggregation network per round",
                             check=_positive, check_msg="> 0", owners=DISTRANS),
    # baselines (SPEC section 4); defaults: the middle of the paper's grids, never tuned per method
    "fedprox-mu": Key(0.01, "FedProx: weight mu of the proximal term mu/2 ||w - w_round_start||^2",
                      check=_non_negative, check_msg=">= 0", owners=("fedprox",)),
    "moon-mu": Key(1.0, "MOON: weight of the model-contrastive loss", check=_non_negative, check_msg=">= 0",
                   owners=("moon",)),
    "moon-tau": Key(0.5, "MOON: temperature of the model-contrastive loss", check=_positive, check_msg="> 0",
                    owners=("moon",)),
    "moon-proj-hidden": Key(256, "MOON: width of the projection layers added to the feature extractor",
                            check=_positive, check_msg="> 0", owners=("moon",)),
    "moon-proj-out": Key(128, "MOON: output width of the projection layers (the representation)",
                         check=_positive, check_msg="> 0", owners=("moon",)),
    "fedmix-lambda": Key(0.1, "FedMix: mixing weight lambda (0: plain cross-entropy)",
                         check=lambda v: 0 <= v < 1, check_msg="in [0, 1)", owners=("fedmix",)),
    "fedmix-m": Key(10, "FedMix: local samples averaged into one mean sample; each client shares n_i // M",
                    check=_positive, check_msg="> 0", owners=("fedmix",)),
    "vhl-size": Key(2000, "VHL: virtual samples, spread evenly over the classes", check=_positive,
                    check_msg="> 0", owners=("vhl",)),
    "vhl-weight": Key(1.0, "VHL: weight of the cross-entropy on virtual data (labels shifted past the real ones)",
                      check=_non_negative, check_msg=">= 0", owners=("vhl",)),
    "vhl-align-weight": Key(1.0, "VHL: weight of the feature alignment (supervised contrastive) loss",
                            check=_non_negative, check_msg=">= 0", owners=("vhl",)),
    "vhl-tau": Key(0.07, "VHL: temperature of the feature alignment loss", check=_positive, check_msg="> 0",
                   owners=("vhl",)),
    "feddecorr-weight": Key(0.1, "FedDecorr: weight of the decorrelation loss", check=_non_negative,
                            check_msg=">= 0", owners=("feddecorr", "fedbr+feddecorr")),
    "fedntd-beta": Key(1.0, "FedNTD: weight of the not-true distillation loss", check=_non_negative,
                       check_msg=">= 0", owners=("fedntd", "fedbr+fedntd")),
    "fedntd-tau": Key(1.0, "FedNTD: distillation temperature", check=_positive, check_msg="> 0",
                      owners=("fedntd", "fedbr+fedntd")),
    "fedcm-alpha": Key(0.1, "FedCM: client step direction alpha g + (1 - alpha) Delta_global",
                       check=_fraction, check_msg="in (0, 1]", owners=("fedcm", "fedbr+fedcm")),
    "groupdro-eta": Key(0.01, "GroupDRO: server weight step p_i <- p_i exp(eta loss_i)", check=_non_negative,
                        check_msg=">= 0", owners=("groupdro",)),
    "dann-weight": Key(0.1, "DANN: weight of the domain (client id) discriminator loss, reversed for the "
                            "features", check=_non_negative, check_msg=">= 0", owners=("dann",)),
    "dann-hidden": Key(256, "DANN: width of the 3-layer discriminator", check=_positive, check_msg="> 0",
                       owners=("dann",)),
}

DEFAULTS: dict[str, Any] = {k: v.default for k, v in SCHEMA.items()}


def _type_name(v: Any) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str"}[type(v)]


def _coerce(key: str, value: Any) -> Any:
    default = SCHEMA[key].default
    if isinstance(value, str) and isinstance(default, (int, float)) and not isinstance(default, bool):
        value = _yaml_number(value)  # YAML 1.1 reads 1e-3 (no dot) as a string
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
    elif isinstance(default, float):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(default, int):
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif isinstance(value, str):
        return value
    raise ConfigError(
        f"config key '{key}' must be {_type_name(default)}, got {type(value).__name__} {value!r}"
    )


def _yaml_number(text: str) -> Any:
    try:
        return float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        return text


def normalise_key(key: str) -> str:
    return str(key).strip().replace("_", "-")


def validate(overrides: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Return a complete config: ``base`` (default: DEFAULTS) updated with checked ``overrides``."""
    cfg = dict(DEFAULTS if base is None else base)
    for raw_key, value in overrides.items():
        key = normalise_key(raw_key)
        if key not in SCHEMA:
            close = difflib.get_close_matches(key, SCHEMA, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown config key '{raw_key}'.{hint} Valid keys: {', '.join(SCHEMA)}")
        cfg[key] = _coerce(key, value)
    for key, spec in SCHEMA.items():
        v = cfg[key]
        if spec.choices is not None and v not in spec.choices:
            raise ConfigError(f"config key '{key}' = {v!r} is not one of: {', '.join(spec.choices)}")
        if spec.check is not None and not spec.check(v):
            raise ConfigError(f"config key '{key}' = {v!r} must be {spec.check_msg}")
    _check_consistency(cfg)
    _check_ownership(cfg, overrides)
    return cfg


def active_methods(cfg: Mapping[str, Any]) -> set[str]:
    """The names whose keys apply: the strategy, and ``fedbr+<name>`` for a FedBR combination."""
    names = {cfg["strategy"]}
    if cfg["strategy"] == "fedbr" and cfg["fedbr-with"] != "none":
        names.add(f"fedbr+{cfg['fedbr-with']}")
    return names


def _check_ownership(cfg: Mapping[str, Any], overrides: Mapping[str, Any]) -> None:
    """A key set to a non-default value for a strategy that ignores it is a mistake worth stopping for."""
    active = active_methods(cfg)
    for raw_key in overrides:
        key = normalise_key(raw_key)
        owners = SCHEMA[key].owners
        if owners is not None and not active & set(owners) and cfg[key] != SCHEMA[key].default:
            valid = sorted(k for k, spec in SCHEMA.items() if spec.owners and active & set(spec.owners))
            name = " + ".join(sorted(active))
            raise ConfigError(
                f"config key '{raw_key}' belongs to strategy {', '.join(owners)}, not to '{name}'. "
                f"Keys of '{name}': {', '.join(valid) or 'none beyond the common ones'}"
            )


def _check_consistency(cfg: Mapping[str, Any]) -> None:
    from .registry import strategy_names  # late import: the registry imports the algorithm packages

    if cfg["strategy"] not in strategy_names():
        close = difflib.get_close_matches(cfg["strategy"], strategy_names(), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise ConfigError(f"unknown strategy '{cfg['strategy']}'.{hint} Valid: {', '.join(strategy_names())}")
    if cfg["dataset"] in ("mnist", "cifar10", "cifar100") and not cfg["data-dir"]:
        raise ConfigError(
            f"dataset '{cfg['dataset']}' needs 'data-dir' (a folder holding torchvision's files); "
            "the embedded 'mnist5k' needs none"
        )
    num_classes = 100 if cfg["dataset"] == "cifar100" else 10
    if cfg["partition"] == "classes" and cfg["classes-per-client"] > num_classes:
        raise ConfigError(
            f"'classes-per-client' = {cfg['classes-per-client']} exceeds the {num_classes} classes of "
            f"{cfg['dataset']}"
        )
    check_sampling(cfg)
    if cfg["strategy"] == "fedbr":
        _check_fedbr(cfg)


def sampled_per_round(fraction_fit: float, num_clients: int) -> int:
    return min(num_clients, max(1, int(round(fraction_fit * num_clients))))


def check_sampling(cfg: Mapping[str, Any]) -> None:
    """min-fit-clients must be reachable (checked once num-clients is known)."""
    if not cfg["num-clients"]:
        return
    sampled = sampled_per_round(cfg["fraction-fit"], cfg["num-clients"])
    if cfg["min-fit-clients"] > sampled:
        raise ConfigError(f"min-fit-clients = {cfg['min-fit-clients']} but only {sampled} of the {cfg['num-clients']} "
                          f"clients are sampled per round (fraction-fit = {cfg['fraction-fit']}): lower "
                          "min-fit-clients or raise fraction-fit")


def _check_fedbr(cfg: Mapping[str, Any]) -> None:
    if not cfg["fedbr-balance"] and not cfg["fedbr-contrastive"]:
        raise ConfigError("fedbr-balance and fedbr-contrastive are both false: that is FedAvg "
                          "(use strategy=fedavg, with mixup=true for the Mixup backbone)")
    if not cfg["fedbr-contrastive"] and not cfg["fedbr-max-step"]:
        raise ConfigError("fedbr-max-step = false only applies with fedbr-contrastive = true")
    if cfg["fedbr-contrastive"] and cfg["pseudo-size"] not in (0, cfg["batch-size"]):
        raise ConfigError(f"pseudo-size = {cfg['pseudo-size']} but batch-size = {cfg['batch-size']}: component 2 "
                          "pairs pseudo-samples with local samples one to one, so they must be equal "
                          "(pseudo-size = 0 follows batch-size)")
    if cfg["pseudo-data"] == "mixture" and proxy_dataset(cfg) in ("mnist", "cifar10", "cifar100") \
            and not cfg["data-dir"]:
        raise ConfigError(f"pseudo-data = mixture reads the proxy dataset '{proxy_dataset(cfg)}' from data-dir, "
                          "which is empty: set data-dir or proxy-dataset=mnist5k")


def proxy_dataset(cfg: Mapping[str, Any]) -> str:
    if cfg["proxy-dataset"] != "auto":
        return cfg["proxy-dataset"]
    return {"cifar10": "cifar100", "cifar100": "cifar10", "synthetic": "synthetic"}.get(cfg["dataset"], "mnist5k")


def pseudo_size(cfg: Mapping[str, Any]) -> int:
    return cfg["pseudo-size"] or cfg["batch-size"]


def from_run_config(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """Config inside the Flower apps: the run config Flower hands over, checked again."""
    return validate({k: v for k, v in run_config.items() if normalise_key(k) in SCHEMA})


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"experiment file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, got {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as YAML (``lr=0.01``, ``rotate=false``, ``dataset=mnist``)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if value is None:
        value = ""
    return key.strip(), value


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
    return {"mnist5k": "cnn", "mnist": "cnn", "cifar10": "vgg11", "cifar100": "cct", "synthetic": "vgg11"}[cfg["dataset"]]
