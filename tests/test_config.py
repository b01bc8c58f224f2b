"""Config schema: validation messages, overrides, YAML files, and pyproject.toml kept equal to DEFAULTS."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from fedbr_flwr.core.config import (
    COMMON,
    CommonSettings,
    ConfigError,
    common,
    defaults,
    from_run_config,
    load_yaml,
    parse_override,
    resolved_model,
    schema,
    to_toml,
    validate,
)

DEFAULTS = defaults()
SCHEMA = schema()

ROOT = Path(__file__).resolve().parents[1]


def test_defaults_validate():
    cfg = validate({})
    assert cfg == DEFAULTS
    assert cfg is not DEFAULTS


def test_unknown_key_suggests_close_match():
    with pytest.raises(ConfigError) as err:
        validate({"num-round": 3})
    msg = str(err.value)
    assert "'num-round'" in msg
    assert "Did you mean 'num-rounds'" in msg


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"lr": "fast"}, ["'lr'", "float", "'fast'"]),
        ({"num-rounds": 2.5}, ["'num-rounds'", "int"]),
        ({"rotate": "yes"}, ["'rotate'", "bool"]),
        ({"rotate": 1}, ["'rotate'", "bool"]),
        ({"num-rounds": True}, ["'num-rounds'", "int"]),
        ({"seed": False}, ["'seed'", "int"]),
        ({"lr": True}, ["'lr'", "float"]),
        ({"dataset": 5.5}, ["'dataset'", "str", "float"]),  # a whole number is taken as text, a float is not
    ],
)
def test_wrong_types(overrides, words):
    with pytest.raises(ConfigError) as err:
        validate(overrides)
    for w in words:
        assert w in str(err.value)


def test_numeric_coercions():
    cfg = validate({"lr": 1, "num-rounds": 4.0, "momentum": 0})
    assert cfg["lr"] == 1.0 and type(cfg["lr"]) is float
    assert cfg["num-rounds"] == 4 and type(cfg["num-rounds"]) is int
    assert type(cfg["momentum"]) is float


def test_choices_enforced():
    with pytest.raises(ConfigError) as err:
        validate({"dataset": "svhn"})
    msg = str(err.value)
    assert "'svhn'" in msg
    for valid in ("mnist5k", "mnist", "cifar10", "cifar100"):
        assert valid in msg
    with pytest.raises(ConfigError, match="partition"):
        validate({"partition": "shards"})


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"alpha": 0}, "alpha"),
        ({"alpha": -1.0}, "alpha"),
        ({"fraction-fit": 1.5}, "fraction-fit"),
        ({"fraction-fit": 0}, "fraction-fit"),
        ({"test-fraction": 1.0}, "test-fraction"),
        ({"momentum": 1.0}, "momentum"),
        ({"num-rounds": 0}, "num-rounds"),
        ({"seed": -1}, "seed"),
        ({"client-gpus": 2.0}, "client-gpus"),
    ],
)
def test_checks_enforced(overrides, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        validate(overrides)


def test_boundary_values_accepted():
    cfg = validate({"fraction-fit": 1.0, "momentum": 0.0, "client-gpus": 1.0, "seed": 0, "target-acc": 1.0})
    assert cfg["fraction-fit"] == 1.0


def test_unknown_strategy_lists_valid_names():
    with pytest.raises(ConfigError) as err:
        validate({"strategy": "fedfoo"})
    assert "fedfoo" in str(err.value)
    assert "fedavg" in str(err.value)


@pytest.mark.parametrize("dataset", ["mnist", "cifar10", "cifar100"])
def test_file_datasets_default_to_the_data_folder(dataset):
    assert validate({"dataset": dataset})["data-dir"] == ""  # FEDBR_DATA_DIR or the cache folder, when read
    assert validate({"dataset": dataset, "data-dir": "/somewhere"})["data-dir"] == "/somewhere"


def test_classes_per_client_bounded_by_classes():
    with pytest.raises(ConfigError, match="classes-per-client"):
        validate({"partition": "classes", "classes-per-client": 11})
    validate({"partition": "classes", "classes-per-client": 11, "dataset": "cifar100", "data-dir": "/x"})


def test_snake_case_keys_accepted():
    cfg = validate({"num_rounds": 3, "fraction_fit": 0.5})
    assert cfg["num-rounds"] == 3 and cfg["fraction-fit"] == 0.5
    assert "num_rounds" not in cfg


def test_validate_with_base_keeps_base():
    base = validate({"num-rounds": 7})
    cfg = validate({"lr": 0.1}, base=base)
    assert cfg["num-rounds"] == 7 and cfg["lr"] == 0.1
    assert base["lr"] == DEFAULTS["lr"]


def test_from_run_config_drops_unknown_keys():
    cfg = from_run_config({"num-rounds": 3, "not-ours": 1})
    assert cfg["num-rounds"] == 3 and "not-ours" not in cfg


def test_resolved_model():
    assert resolved_model(validate({})) == "cnn"
    assert resolved_model(validate({"dataset": "cifar10", "data-dir": "/x"})) == "vgg11"
    assert resolved_model(validate({"dataset": "cifar100", "data-dir": "/x"})) == "cct"
    assert resolved_model(validate({"model": "resnet18"})) == "resnet18"


# ---------------------------------------------------------------- overrides


@pytest.mark.parametrize(
    "text, expected",
    [
        ("lr=0.01", ("lr", 0.01)),
        ("rotate=false", ("rotate", False)),
        ("dataset=mnist", ("dataset", "mnist")),
        ("num-rounds=5", ("num-rounds", 5)),
        ("output-dir=", ("output-dir", "")),
        ("data-dir=/a=b", ("data-dir", "/a=b")),
        ("data-dir=~", ("data-dir", "~")),  # the home folder, not YAML's null (which read as the default folder)
        ("data-dir=null", ("data-dir", "")),
        (" seed =3", ("seed", 3)),
        # YAML 1.2's numbers: PyYAML's 1.1 read these as octal 8, sexagesimal 90 and a date
        ("num-rounds=010", ("num-rounds", 10)),
        ("num-rounds=1:30", ("num-rounds", "1:30")),
        ("output-dir=2024-01-01", ("output-dir", "2024-01-01")),
        ("seed=0x10", ("seed", 16)),
    ],
)
def test_parse_override(text, expected):
    key, value = parse_override(text)
    assert (key, value) == expected
    assert type(value) is type(expected[1])


def test_a_tilde_on_the_command_line_is_the_home_folder_and_a_number_key_refuses_it():
    from fedbr_flwr.data.catalog import data_folder

    assert data_folder(validate(dict([parse_override("data-dir=~")]))["data-dir"]) == Path.home().resolve()
    with pytest.raises(ConfigError, match="num-rounds"):
        validate(dict([parse_override("num-rounds=~")]))


def test_parse_override_rejects_missing_equals():
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("bad")


def test_parse_override_scientific_notation():
    key, value = parse_override("lr=1e-3")
    assert validate({key: value})["lr"] == pytest.approx(1e-3)


# ---------------------------------------------------------------- YAML files


def test_load_yaml_missing(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_yaml(tmp_path / "nope.yaml")


def test_load_yaml_invalid(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("lr: [0.1\nseed: {\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_yaml(p)


@pytest.mark.parametrize(
    "text",
    ["lr: [0.1\n", "lr: 0.1\n  seed: 2\n", "lr: 'x\n", "\tlr: 0.1\n", "lr: a: b\n"],
    ids=["flow", "indent", "quote", "tab", "nested"],
)
def test_a_yaml_error_is_one_line_naming_where(tmp_path, text):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=r"not valid YAML: line \d+, column \d+: ") as err:
        load_yaml(p)
    assert "\n" not in str(err.value)


def test_a_key_given_twice_is_refused(tmp_path):
    p = tmp_path / "twice.yaml"
    p.write_text("lr: 0.1\nseed: 1\nlr: 0.2\n")
    with pytest.raises(ConfigError, match="key 'lr' appears twice \\(line 3\\)"):
        load_yaml(p)


def test_one_key_spelled_two_ways_is_refused(tmp_path):
    p = tmp_path / "twice.yaml"
    p.write_text("num_rounds: 3\nseed: 1\nnum-rounds: 5\n")  # YAML keeps both; one would silently win
    with pytest.raises(ConfigError, match="'num_rounds' and 'num-rounds' are the same config key; keep one"):
        load_yaml(p)


def test_a_text_key_takes_a_value_yaml_reads_as_a_whole_number():
    cfg = validate({"attack": "sign-flip", "attack-ids": 3, "git-commit": 1234567})  # attack-ids=3 on a command line
    assert cfg["attack-ids"] == "3" and cfg["git-commit"] == "1234567"
    with pytest.raises(ConfigError, match="'git-commit' must be str, got bool"):
        validate({"git-commit": True})


@pytest.mark.parametrize("item", ["output-dir=on", "tracking=off", "attack-ids=no"])
def test_a_text_key_yaml_read_as_a_bool_says_to_quote_it(item):
    """YAML 1.1 reads on/off/yes/no as a bool: 'must be str, got bool True' did not say why."""
    key = item.partition("=")[0]
    with pytest.raises(ConfigError, match=f"as a bool: quote the text, e.g. {key}=\"'on'\"") as caught:
        validate(dict([parse_override(item)]))
    assert "\n" not in str(caught.value)


def test_a_text_key_given_a_yaml_list_says_to_write_it_comma_separated():
    """attack-ids: [0, 3] in a file said 'must be str, got list [0, 3]' (a names key, tracking, takes a list)."""
    with pytest.raises(ConfigError, match="got list .*; write it as text, comma-separated: attack-ids: 0,3$"):
        validate({"attack": "scale", "attack-ids": [0, 3]})
    assert validate({"tracking": ["tensorboard"]})["tracking"] == "tensorboard"


def test_a_directory_or_a_device_is_not_an_experiment_file(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load_yaml(tmp_path)
    with pytest.raises(ConfigError, match="is not a regular file"):
        load_yaml("/dev/zero")


def test_load_yaml_list(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- lr: 0.1\n- seed: 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_yaml(p)


def test_load_yaml_ok_and_empty(tmp_path):
    p = tmp_path / "ok.yaml"
    p.write_text("num_rounds: 4\nrotate: false\nlr: 0.02\n")
    assert validate(load_yaml(p))["num-rounds"] == 4
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_yaml(empty) == {}


EXPERIMENTS = sorted((ROOT / "experiments").glob("*.yaml"))


@pytest.mark.skipif(not EXPERIMENTS, reason="no experiment files yet")
@pytest.mark.parametrize("path", EXPERIMENTS, ids=[p.name for p in EXPERIMENTS])
def test_experiment_files_validate(path):
    if "sweep" in load_yaml(path):  # every run of a sweep file must validate
        from fedbr_flwr.commands.sweep import plan

        jobs = plan(str(path), [], ROOT / "runs" / "never-written", None)
        assert len(jobs) >= 2 and all(set(cfg) == set(SCHEMA) for _, _, cfg in jobs)
    else:
        assert set(validate(load_yaml(path))) == set(SCHEMA)


# ---------------------------------------------------------------- pyproject and TOML


def test_pyproject_config_equals_defaults():
    with open(ROOT / "pyproject.toml", "rb") as f:
        table = tomllib.load(f)["tool"]["flwr"]["app"]["config"]
    assert list(table) == list(DEFAULTS), "run `fedbr-run --write-pyproject` after adding or moving a key"
    for key, value in DEFAULTS.items():
        assert table[key] == value, key
        assert type(table[key]) is type(value), key


def test_to_toml_round_trip():
    assert tomllib.loads(to_toml(DEFAULTS)) == DEFAULTS
    odd = dict(DEFAULTS, **{"output-dir": 'C:\\runs\\"x"', "lr": 1e-5, "seed": 12345678901})
    back = tomllib.loads(to_toml(odd))
    assert back == odd
    assert all(type(back[k]) is type(v) for k, v in odd.items())


def test_a_batch_larger_than_the_training_split_is_refused():
    assert validate({"batch-size": 4500})["batch-size"] == 4500
    with pytest.raises(ConfigError, match="'batch-size' = 1000000000 exceeds the 4500 training images of mnist5k"):
        validate({"batch-size": 10**9})
    with pytest.raises(ConfigError, match="'pseudo-size' = 60001 exceeds the 60000 training images of mnist"):
        validate({"strategy": "fedbr", "dataset": "mnist", "pseudo-size": 60001, "fedbr-contrastive": False})


@pytest.mark.parametrize("dataset", ["mnist5k", "synthetic"])
def test_the_training_split_sizes_are_the_loaded_ones(dataset):
    from fedbr_flwr.data.catalog import INFO, load_raw

    train, _ = load_raw(dataset)
    assert len(train.y) == INFO[dataset].train_size


def test_common_reads_every_common_key_typed_and_refuses_a_config_without_one():
    cfg = validate({"num-clients": 7, "lr": "0.01", "tracking": "tensorboard", "fraction-fit": 1})
    run = common(cfg)
    assert (run.num_clients, run.lr, run.tracking, run.fraction_fit) == (7, 0.01, ("tensorboard",), 1.0)
    assert {key: getattr(run, key.replace("-", "_")) for key in COMMON if key != "tracking"} == {
        key: value for key, value in cfg.items() if key in COMMON and key != "tracking"
    }
    with pytest.raises(KeyError, match="num-clients"):
        common({key: value for key, value in cfg.items() if key != "num-clients"})


def test_a_stored_config_gives_the_keys_it_lacks_their_defaults():
    """A run's manifest from before a key was added: that key reads as its default, names as a tuple."""
    old = {"num-rounds": 40, "tracking": "tensorboard,wandb"}
    run = CommonSettings.from_config(old, stored=True)
    assert (run.num_rounds, run.tracking, run.eval_every) == (
        40,
        ("tensorboard", "wandb"),
        COMMON["eval-every"].default,
    )
    assert run.backend == COMMON["backend"].default


def test_a_common_key_is_its_fields_name_in_kebab_case():
    assert [key for _, key, _ in CommonSettings.declared()] == list(COMMON)
    assert all(key == attribute.replace("_", "-") for attribute, key, _ in CommonSettings.declared())
