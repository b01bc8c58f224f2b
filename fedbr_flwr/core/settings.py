"""Typed, documented settings. Every run has the common keys (``config.CommonSettings``, read typed with
``config.common(cfg)``); each algorithm and each combinable component declares its own next to its code, as
a frozen ``Settings`` dataclass whose fields are made with ``setting(key, default, help, ...)``. The run
schema is the common keys plus what the registry collects from these declarations (``config.schema()``).

A key is kebab-case (the run-config key Flower passes, e.g. ``fedbr-lambda``); its default's type is
the key's type (bool, int, float or str); ``choices`` or a ``Check`` restrict its values; a ``names``
key holds a list of names, written ``a,b`` (YAML lists are joined), ``none`` for an empty list."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import cache
from typing import Any, Callable, Mapping, Sequence, TypeVar


@dataclass(frozen=True)
class Check:
    test: Callable[[Any], bool]
    message: str  # what a valid value is, e.g. "> 0"

    def __call__(self, value: Any) -> bool:
        return bool(self.test(value))


POSITIVE = Check(lambda v: v > 0, "> 0")
NON_NEGATIVE = Check(lambda v: v >= 0, ">= 0")
FRACTION = Check(lambda v: 0 < v <= 1, "in (0, 1]")
OPEN_FRACTION = Check(lambda v: 0 < v < 1, "in (0, 1)")
UNIT_INTERVAL = Check(lambda v: 0 <= v <= 1, "in [0, 1]")
BELOW_ONE = Check(lambda v: 0 <= v < 1, "in [0, 1)")


class DeclaredChoices(Sequence[str]):
    """The choices of a key declared where their code is, read each time they are asked for: so a key's
    values cannot drift from what its module offers, and the config need not import that module (and
    torch) before a value is checked."""

    def __init__(self, read: Callable[[], Sequence[str]]):
        self.read = read

    def __getitem__(self, index: Any) -> Any:
        return tuple(self.read())[index]

    def __len__(self) -> int:
        return len(self.read())


@dataclass(frozen=True)
class Key:
    default: Any
    help: str
    choices: Sequence[str] | None = None
    check: Check | None = None
    owner: str | None = None  # the algorithm or component it belongs to; None: a common key
    names: bool = False  # a list of names, "a,b"; "none" is the empty list
    placement: bool = False  # where the run's data or clients are, not what it computes: a resumed run, or a
    # sweep's finished run, may change it


def names_list(value: str) -> tuple[str, ...]:
    """A ``names`` key's value as a tuple (``none`` and the empty string are the empty tuple)."""
    items = [v.strip() for v in str(value).split(",") if v.strip()]
    return () if items in ([], ["none"]) else tuple(items)


_KEY = "fedbr-setting"


def setting(
    key: str,
    default: Any,
    help: str,
    *,
    choices: Sequence[str] | None = None,
    check: Check | None = None,
    names: bool = False,
    placement: bool = False,
) -> Any:
    """A field of a ``Settings`` dataclass, read from run-config key ``key`` ("": the field's name in kebab-case)."""
    spec = Key(default, help, choices, check, names=names, placement=placement)
    return field(default=default, metadata={_KEY: (key, spec)})


S = TypeVar("S", bound="Settings")


@dataclass(frozen=True)
class Settings:
    """Base of an algorithm's (or a component's) settings. Subclasses are frozen dataclasses of
    ``setting(...)`` fields, and may override ``check`` for checks across keys."""

    @classmethod
    @cache
    def declared(cls) -> list[tuple[str, str, Key]]:
        """(attribute, key, Key) of every field, in declaration order (read once per class); a field's key is
        the one it names, else its attribute's name in kebab-case."""
        return [(f.name, f.metadata[_KEY][0] or f.name.replace("_", "-"), f.metadata[_KEY][1]) for f in fields(cls)]

    @classmethod
    def keys(cls, owner: str | None) -> dict[str, Key]:
        return {key: replace(spec, owner=owner) for _, key, spec in cls.declared()}

    @classmethod
    def from_config(cls: type[S], cfg: Mapping[str, Any], stored: bool = False) -> S:
        """The typed settings of a validated config (``names`` keys become tuples); ``stored``: of a config read
        back from a run's files, where a key it lacks (one added since) takes its default."""

        def value(key: str, spec: Key) -> Any:
            v = cfg.get(key, spec.default) if stored else cfg[key]
            return names_list(v) if spec.names else v

        return cls(**{attr: value(key, spec) for attr, key, spec in cls.declared()})

    @classmethod
    def check(cls, cfg: Mapping[str, Any]) -> None:
        """Checks that involve several keys (also common ones); raise ConfigError with the fix."""


@dataclass(frozen=True)
class NoSettings(Settings):
    """An algorithm without keys of its own."""
