"""Algorithms and components found by name; the neutral place through which both sides reach what
they share (an algorithm's model and settings), so that no strategy imports a client module.

A new algorithm is a file in ``clients/`` whose client side is registered with ``@register_client``
and, when its server does more than FedAvg's, a file in ``strategies/`` registered with
``@register_strategy`` under the same name; plus an experiment file. A local piece other algorithms
can carry (FedBR's combinations, paper Table 3) is registered with ``@register_component`` (and its
server part with ``@register_server_component``); ``register_variant`` names a host algorithm plus
components as an algorithm of its own (``strategy=fedcm`` is FedAvg + the fedcm component). An algorithm
whose client or strategy subclasses another's gets that one's other side and settings (``lineage``).
Every module of ``clients`` and ``strategies`` is imported the first time a name is looked up."""

from __future__ import annotations

import importlib
import pkgutil
import threading
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from .errors import ConfigError
from .settings import Key, NoSettings, Settings

T = TypeVar("T")
DEFAULT = "fedavg"


@dataclass(frozen=True)
class Variant:
    base: str
    components: tuple[str, ...]
    summary: str


# The registry names no algorithm class, not even in annotations, so that it stays below the code it registers;
# the typed lookups sit beside their base classes: algorithm.client_class and component_class,
# strategies.base.strategy_class, server.components.server_component_class.
CLIENTS: dict[str, Any] = {}
STRATEGIES: dict[str, Any] = {}
VARIANTS: dict[str, Variant] = {}
COMPONENTS: dict[str, Any] = {}
SERVER_COMPONENTS: dict[str, Any] = {}
PACKAGES = ("clients", "strategies")
_loaded = False
_loading = threading.RLock()


def _register(table: dict[str, Any], name: str) -> Callable[[T], T]:
    def decorator(cls: T) -> T:
        if name in table and table[name] is not cls:
            raise ConfigError(f"'{name}' is registered twice: {table[name]} and {cls}")
        table[name] = cls
        cls.name = name  # type: ignore[attr-defined]  # every registered class has a name
        return cls

    return decorator


def register_client(name: str) -> Callable[[T], T]:
    """The client side of algorithm ``name`` (a ``fedbr_flwr.core.algorithm.ClientAlgorithm``)."""
    return _register(CLIENTS, name)


def register_strategy(name: str) -> Callable[[T], T]:
    """The server side of algorithm ``name`` (a ``strategies.base.FederatedStrategy``)."""
    return _register(STRATEGIES, name)


def register_component(name: str) -> Callable[[T], T]:
    """A local piece other algorithms' steps can carry (a ``fedbr_flwr.core.algorithm.LocalComponent``)."""
    return _register(COMPONENTS, name)


def register_server_component(name: str) -> Callable[[T], T]:
    """The server part of component ``name`` (a ``fedbr_flwr.server.components.ServerComponent``)."""
    return _register(SERVER_COMPONENTS, name)


def register_variant(name: str, base: str, components: tuple[str, ...], summary: str) -> None:
    """``strategy=name`` runs algorithm ``base`` (both sides) with ``components`` added."""
    if name in VARIANTS and VARIANTS[name] != Variant(base, components, summary):
        raise ConfigError(f"'{name}' is registered twice as a variant")
    VARIANTS[name] = Variant(base, tuple(components), summary)


def load_all() -> None:
    """Import every module of ``clients`` and ``strategies`` so that their registrations run."""
    global _loaded
    with _loading:  # another thread (the simulation process's warm-up) may be importing them: wait for it
        if _loaded:
            return
        _loaded = True  # first: a module being imported may look something up (in this thread)
        for package_name in PACKAGES:
            package = importlib.import_module(package_name)
            for mod in pkgutil.iter_modules(package.__path__):
                importlib.import_module(f"{package_name}.{mod.name}")


def algorithm_names() -> list[str]:
    load_all()
    return sorted(set(CLIENTS) | set(STRATEGIES) | set(VARIANTS))


def parent_of(name: str) -> str | None:
    """The algorithm ``name`` builds on: a variant's base, else the registered algorithm whose client or
    strategy class its own subclasses (a server-only FedAvgM's strategy subclassing FedAvg's)."""
    if name in VARIANTS:
        return VARIANTS[name].base
    for table in (CLIENTS, STRATEGIES):
        for ancestor in getattr(table.get(name), "__mro__", ())[1:]:
            registered = vars(ancestor).get("name")
            if registered is not None and table.get(registered) is ancestor:
                return registered
    return None


def lineage(name: str) -> list[str]:
    """``name``, then what it builds on, and so on: a side or settings an algorithm does not declare come from
    the first of these that does."""
    names = [name]
    while (parent := parent_of(names[-1])) is not None and parent not in names:
        names.append(parent)
    return names


def _first_in_lineage(table: dict[str, Any], name: str) -> Any:
    return next((table[n] for n in lineage(name) if n in table), table[DEFAULT])


def lookup_client(name: str) -> Any:
    """The client class of algorithm ``name``: its own, else that of what it builds on (``lineage``), else
    FedAvg's (a server-only algorithm)."""
    load_all()
    return _first_in_lineage(CLIENTS, name)


def lookup_strategy(name: str) -> Any:
    load_all()
    return _first_in_lineage(STRATEGIES, name)


def lookup_component(name: str) -> Any:
    load_all()
    return COMPONENTS[name]


def lookup_server_component(name: str) -> Any:
    load_all()
    return SERVER_COMPONENTS.get(name)


def settings_of(owner: str) -> type[Settings]:
    """The Settings class of a component, or of an algorithm: declared by its client or its strategy, else by
    the first algorithm of its lineage that declares one (a subclass of FedBR's client reads FedBR's keys)."""
    load_all()
    if owner in COMPONENTS:
        return COMPONENTS[owner].Settings
    for name in lineage(owner):
        declared = {getattr(table.get(name), "Settings", NoSettings) for table in (CLIENTS, STRATEGIES)} - {NoSettings}
        if len(declared) > 1:
            raise ConfigError(f"'{name}' declares settings in both its client and its strategy: keep one declaration")
        if declared:
            return declared.pop()
    return NoSettings


def owned_keys() -> dict[str, Key]:
    """Every algorithm's and component's keys, tagged with their owner, in name order. A key an algorithm
    inherits from its lineage (the same Settings, or a subclass of them) stays its ancestor's."""
    load_all()
    owners = sorted(set(CLIENTS) | set(STRATEGIES) | set(COMPONENTS))
    lineages = {owner: lineage(owner) for owner in owners}
    owner_of: dict[str, str] = {}
    for owner in sorted(owners, key=lambda o: len(lineages[o])):  # ancestors first
        for key in settings_of(owner).keys(owner):
            if owner_of.setdefault(key, owner) not in lineages[owner]:
                raise ConfigError(f"config key '{key}' is declared by both {owner_of[key]} and {owner}: rename one")
    return {
        key: spec for owner in owners for key, spec in settings_of(owner).keys(owner).items() if owner_of[key] == owner
    }


def how_to_enable(owner: str) -> str:
    """How a run gets ``owner``'s keys: 'strategy=fedprox, or strategy=fedbr fedbr-with=fedprox'."""
    load_all()
    ways = [f"strategy={owner}"] if owner in algorithm_names() else []
    ways += [
        f"strategy={name} {key}={owner}"
        for name, cls in sorted(CLIENTS.items())
        if owner in COMPONENTS and (key := getattr(cls, "component_key", None))
    ]
    ways += [f"strategy={name}" for name in algorithm_names() if owner in lineage(name)[1:]]
    return ", or ".join(ways) or "no strategy"
