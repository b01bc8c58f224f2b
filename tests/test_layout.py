"""The seams of the code base, checked: one algorithm in its client and strategy files, the server
never importing client code, algorithm files free of Flower, one npz codec, named seed streams, a thin
strategy base, a light ClientApp, a bench wing nothing else imports, the layers (one folder each, no circle,
no upward import) and common keys read typed."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = [p for folder in ("fedbr_flwr", "clients", "strategies", "pseudodata") for p in (ROOT / folder).rglob("*.py")]


def imports(path: Path) -> set[str]:
    """Every module a file imports (absolute names; relative ones resolved against its package)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def calls(path: Path) -> set[str]:
    """Dotted names of everything a file calls (``np.savez``, ``seeds.rng``, ...)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            names.add(ast.unparse(node.func))
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "strategies").glob("*.py")), ids=lambda p: p.name)
def test_no_strategy_imports_client_code(path):
    assert not [m for m in imports(path) if m == "clients" or m.startswith("clients.")]


@pytest.mark.parametrize(
    "path", sorted([*(ROOT / "clients").glob("*.py"), *(ROOT / "strategies").glob("*.py")]), ids=lambda p: p.name
)
def test_algorithm_files_import_no_flower_module(path):
    """A strategy is a Flower Strategy only through strategies.base's base class (fedbr_flwr.app.strategy)."""
    assert not [m for m in imports(path) if m == "flwr" or m.startswith("flwr.")]


@pytest.mark.parametrize(
    "path", sorted([*(ROOT / "clients").glob("*.py"), *(ROOT / "strategies").glob("*.py")]), ids=lambda p: p.name
)
def test_algorithms_see_named_arrays_never_flower_lists(path):
    assert not calls(path) & {"parameters_to_ndarrays", "ndarrays_to_parameters", "flatten", "unflatten"}


def test_one_npz_codec_and_named_seed_streams():
    for path in PRODUCT:
        used = calls(path)
        if path.name != "codec.py":
            assert not used & {"np.savez", "np.savez_compressed", "np.load"}, path
        if path.name != "seeds.py":
            assert not used & {"hash_seed", "seeds.hash_seed"}, path
            text = path.read_text()
            assert "default_rng([" not in text and "step_seed" not in text, path


def test_no_class_of_the_strategy_base_is_over_120_statements():
    """Counted in statements, not lines, so that the formatter's line breaks do not move the bound."""
    server_sides = [*(ROOT / "fedbr_flwr" / "server").glob("*.py"), *(ROOT / "fedbr_flwr" / "app").glob("*.py")]
    for path in [ROOT / "strategies" / "base.py", *server_sides]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                statements = sum(  # a bare annotation declares a type, it runs nothing
                    isinstance(n, ast.stmt) and not (isinstance(n, ast.AnnAssign) and n.value is None)
                    for n in ast.walk(node)
                )
                assert statements <= 120, f"{path.name}: {node.name} has {statements} statements"


def run_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def test_the_client_app_imports_no_launch_module_and_no_torch():
    """A deployment's per-message ClientApp process only forwards to the node's worker: it stays light."""
    code = "import sys, fedbr_flwr.app.client_app; print(sorted(m for m in sys.modules if m.startswith(HEAVY)))"
    code = code.replace("HEAVY", repr(("fedbr_flwr.launch", "torch")))
    assert run_python(code).strip() == "[]"


USER_FACING = (
    "README.md",
    "pyproject.toml",
    "docs",
    "experiments",
    "fedbr_flwr",
    "clients",
    "strategies",
    "pseudodata",
)


def test_nothing_a_user_runs_or_reads_points_outside_the_repository():
    """Users clone the repository alone: no README, doc, experiment file or code names the workshop beside it."""
    files = [
        p
        for name in USER_FACING
        for p in ([ROOT / name] if (ROOT / name).is_file() else sorted((ROOT / name).rglob("*")))
        if p.is_file() and p.suffix in (".md", ".toml", ".yaml", ".yml", ".py", ".sh")
    ]
    assert len(files) > 50
    offenders = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in files
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "../shared" in line
    ]
    assert not offenders, offenders


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """Module -> the product modules it imports (at its top, inside functions, or for type checking only; an
    import of ``package.name`` that is no module counts as one of ``package``)."""
    modules = {module_name(p): p for p in PRODUCT}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports(path):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected groups of more than one module (each holds an import circle)."""
    order, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(frozenset(group))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return found


def test_the_import_graph_has_no_circle():
    """Type-only imports count: the registry names no class it registers (the typed lookups sit beside their
    base classes), so the modules it serves stay above it."""
    assert not circles(import_graph()), [sorted(g) for g in circles(import_graph())]


def test_the_circle_finder_finds_a_circle_and_none_in_a_chain():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_nothing_outside_the_bench_wing_imports_it():
    graph = import_graph()
    outside = {m: sorted(t for t in ts if t.startswith("fedbr_flwr.bench")) for m, ts in graph.items()}
    assert not {m: ts for m, ts in outside.items() if ts and not m.startswith("fedbr_flwr.bench")}


# The layers, lowest first, and the packages that hold each; a module imports only from its own layer or lower
# ones (docs/architecture.md). An algorithm's server side is a Flower Strategy (the design card's "custom Flower
# Strategy classes"), so strategies/ sits with the Flower adapter; its hooks still see only named arrays and
# dicts (test_algorithms_see_named_arrays_never_flower_lists), and nothing in the layer below imports it.
LAYERS = {
    "algorithms and shared machinery": (
        "clients",
        "pseudodata",
        "fedbr_flwr.core",
        "fedbr_flwr.data",
        "fedbr_flwr.runfiles",
        "fedbr_flwr.server",
    ),
    "Flower adapter": ("fedbr_flwr.app", "strategies"),
    "launch": ("fedbr_flwr.launch",),
    "commands": ("fedbr_flwr.commands", "fedbr_flwr.bench"),
}


def layer_of(module: str) -> int:
    if module == "fedbr_flwr":
        return 0
    for layer, packages in enumerate(LAYERS.values()):
        if module in packages or module.startswith(tuple(p + "." for p in packages)):
            return layer
    raise AssertionError(f"{module} is in no layer's package (docs/architecture.md)")


def test_every_module_of_the_package_sits_in_a_layer_package_of_at_most_a_dozen_modules():
    graph = import_graph()
    for module in graph:
        layer_of(module)
    top = ROOT / "fedbr_flwr"
    assert sorted(p.name for p in top.glob("*.py")) == ["__init__.py"]
    sizes = {d.name: len([p for p in d.glob("*.py") if p.name != "__init__.py"]) for d in top.iterdir() if d.is_dir()}
    assert all(0 < size <= 12 for name, size in sizes.items() if name != "__pycache__"), sizes


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(m, t) for m, ts in graph.items() for t in ts if layer_of(t) > layer_of(m)}


def test_no_module_imports_from_a_layer_above_its_own():
    graph = import_graph()
    assert {layer_of(m) for m in graph} == set(range(len(LAYERS)))  # every layer has modules
    assert not upward_imports(graph), sorted(upward_imports(graph))


def test_the_layer_rule_finds_an_upward_import():
    assert upward_imports(
        {"fedbr_flwr.launch.x": {"fedbr_flwr.commands.cli"}, "fedbr_flwr.commands.cli": {"fedbr_flwr.core.model"}}
    ) == {("fedbr_flwr.launch.x", "fedbr_flwr.commands.cli")}
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("fedbr_flwr.stray")


def untyped_common_reads(text: str, keys) -> int:
    """Reads of a common key by its string (cfg["lr"], self.cfg.get("lr"), settings["lr"]) from a config-named
    mapping. ``common(cfg).lr`` reads it typed; a config read back from a run's files,
    ``CommonSettings.from_config(cfg, stored=True).lr``."""
    alternatives = "|".join(re.escape(k) for k in sorted(keys, key=len, reverse=True))
    key = rf"""["'](?:{alternatives})["']"""
    mapping = r"(?<![\w.])[\w.]*(?:cfg|config|settings)"
    read = rf"{mapping}(?:\[\s*{key}\s*\](?!\s*=[^=])|\.get\(\s*{key})"
    return len(re.findall(read, text))


def test_common_keys_are_read_typed_outside_the_config_and_the_plan():
    from fedbr_flwr.core.config import COMMON

    exempt = {ROOT / "fedbr_flwr" / "core" / "config.py", ROOT / "fedbr_flwr" / "launch" / "plan.py"}
    counts = {p.name: n for p in PRODUCT if p not in exempt and (n := untyped_common_reads(p.read_text(), COMMON))}
    assert not counts, counts


def test_the_read_counter_counts_reads_not_writes_or_typed_reads():
    text = 'a = cfg["lr"]; b = self.cfg.get("seed", 0); cfg["lr"] = 1; c = common(cfg).lr; d = params["lr"]'
    assert untyped_common_reads(text, {"lr", "seed"}) == 2
    assert untyped_common_reads('run_config["lr"]; settings.get("lr")', {"lr"}) == 2
