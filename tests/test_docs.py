"""Docs that cannot drift: the configuration reference is the schema's, every `fedbr-*` command the
README and docs show parses with today's flags and names experiment files that exist (their settings
validated as a dry run would), and every relative link points at a file that exists."""

import re
import shlex
from pathlib import Path

import pytest
from test_adding_a_dataset import add_the_guides_dataset
from test_adding_a_model import add_the_guides_model

from fedbr_flwr.bench import command as bench
from fedbr_flwr.commands import cli, deploy, sweep
from fedbr_flwr.core.config import ConfigError, configuration_reference

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PARSERS = {
    "fedbr-run": cli.build_parser,
    "fedbr-sweep": sweep.build_parser,
    "fedbr-bench": bench.build_parser,
    "fedbr-deploy": deploy.build_parser,
}
PLACEHOLDER = re.compile(r"\.\.\.|<[^>]+>|/path/to")  # `data-dir=...`, `runs/<folder>`: the reader's own value
NAMED_PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]{2,}\b")  # prose's `fedbr-sweep FILE --time-limit DURATION`


def shell_commands(text: str) -> list[tuple[str, bool]]:
    """The fedbr-* commands of a page, each with whether it is whole: each line of its bash blocks
    (continuations joined, comments and a leading `pip install ... &&` dropped: whole), and each inline
    code span that starts with one (prose may name a part of a command: `fedbr-deploy supernode --no-worker`)."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            found.append((line.split("&&")[-1].strip(), True))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    found += [(" ".join(span.split()), False) for span in re.findall(r"`(fedbr-[a-z]+ [^`|]*)`", prose)]
    return [(c, whole) for c, whole in found if c.split(" ", 1)[0] in PARSERS]


DOCUMENTED = sorted(
    {
        (page.relative_to(ROOT).as_posix(), command, whole)
        for page in PAGES
        for command, whole in shell_commands(page.read_text())
    }
)


def flags_of(parser, argv: list[str]) -> set[str]:
    """The option strings ``parser`` knows, with those of the subcommand ``argv`` names (fedbr-deploy)."""
    import argparse

    flags = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = next((a for a in argv if a in action.choices), None)
            if sub:
                flags |= set(action.choices[sub]._option_string_actions)
    return flags


def test_the_pages_show_commands_of_every_tool():
    assert {command.split()[0] for _, command, whole in DOCUMENTED if whole} == set(PARSERS)
    assert ("README.md", "fedbr-sweep experiments/quickstart.yaml", True) in DOCUMENTED


GUIDE_EDITS = {"docs/adding-a-dataset.md": add_the_guides_dataset, "docs/adding-a-model.md": add_the_guides_model}


@pytest.mark.parametrize("page, command, whole", DOCUMENTED, ids=[f"{p}: {c[:60]}" for p, c, _ in DOCUMENTED])
def test_a_documented_command_parses_and_its_settings_are_valid(page, command, whole, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    if page in GUIDE_EDITS:  # its commands run after the guide's edit
        GUIDE_EDITS[page](monkeypatch)
    tool, *argv = shlex.split(command)
    if not whole:  # a part of a command in prose: its flags must exist
        unknown = [
            a.split("=")[0]
            for a in argv
            if a.startswith("--") and a.split("=")[0] not in flags_of(PARSERS[tool](), argv)
        ]
        assert not unknown, f"{page}: `{command}` names flags {tool} does not have: {unknown}"
    try:
        args = (
            PARSERS[tool]().parse_intermixed_args(argv) if tool != "fedbr-deploy" else PARSERS[tool]().parse_args(argv)
        )
    except SystemExit:
        if not whole:  # a part of a command
            return
        pytest.fail(f"{page}: `{command}` does not parse with {tool}'s flags today")
    if not whole and (PLACEHOLDER.search(command) or NAMED_PLACEHOLDER.search(command)):
        return  # a command in prose is checked as a whole one when it is one: it parses and has no placeholder
    files = [a for a in argv if a.endswith(".yaml") and not PLACEHOLDER.search(a)]
    missing = [f for f in files if not (ROOT / f).is_file()]
    assert not missing, f"{page}: `{command}` names experiment files that do not exist: {missing}"
    overrides = [a for a in argv if "=" in a and not a.startswith("-") and not PLACEHOLDER.search(a)]
    try:
        if tool == "fedbr-sweep":
            sweep.plan(args.file, overrides, tmp_path, args.only, args.seeds)
        elif tool == "fedbr-run" and not (args.resume or args.list or args.write_docs or args.write_pyproject):
            from fedbr_flwr.launch.plan import build_config

            build_config([*files, *overrides])
        elif tool == "fedbr-deploy" and args.command in ("local", "run") and not args.resume:
            deploy.new_run_config([*files, *overrides], args.supernodes if args.command == "local" else None)
    except ConfigError as exc:
        pytest.fail(f"{page}: `{command}` is refused: {exc}")


def test_the_configuration_reference_is_the_schemas():
    page = ROOT / "docs" / "configuration.md"
    assert page.read_text() == configuration_reference(), "docs/configuration.md is stale: run `fedbr-run --write-docs`"


def test_the_configuration_reference_lists_every_key_once():
    from fedbr_flwr.core.config import schema

    rows = re.findall(r"^\| `([a-z0-9-]+)` \|", configuration_reference(), flags=re.M)
    assert sorted(rows) == sorted(schema()) and len(rows) == len(set(rows))


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_point_at_files_that_exist(page):
    broken = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
        if not target.startswith(("http://", "https://", "mailto:")) and not (page.parent / target).exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def test_no_page_a_user_reads_points_into_the_workshop():
    for page in PAGES:
        assert "../shared" not in page.read_text(), page


# ---------------------------------------------------------------- equations beside their code

CODE_REFERENCE = re.compile(r"\[`([A-Za-z_][\w.]*)`\]\(([^)\s#]+\.py)\): `([^`]+)`")
ALGORITHM_PAGES = sorted((ROOT / "docs" / "algorithms").glob("*.md"))


def definition_source(path: Path, dotted: str) -> str | None:
    """The source of the function or class ``dotted`` ("name" or "Class.method") in ``path``; None if absent."""
    import ast

    source = path.read_text()
    scope: list = ast.parse(source).body
    node = None
    for part in dotted.split("."):
        node = next(
            (n for n in scope if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part),
            None,
        )
        if node is None:
            return None
        scope = node.body
    return ast.get_source_segment(source, node)


def quoted_code_problem(page: Path, symbol: str, target: str, fragment: str) -> str | None:
    """Why the page's "[`symbol`](target): `fragment`" does not hold (None when the fragment is in that
    definition, whitespace aside)."""
    path = (page.parent / target).resolve()
    if not path.is_file():
        return f"{target} does not exist"
    body = definition_source(path, symbol)
    if body is None:
        return f"{target} defines no {symbol}"
    if re.sub(r"\s+", "", fragment) not in re.sub(r"\s+", "", body):
        return f"{symbol} in {target} no longer contains `{fragment}`"
    return None


@pytest.mark.parametrize("page", ALGORITHM_PAGES, ids=[p.name for p in ALGORITHM_PAGES])
def test_each_equation_quotes_the_code_that_computes_it(page):
    references = CODE_REFERENCE.findall(page.read_text())
    assert len(references) >= 8, f"{page.name}: the equations table quotes too little code"
    problems = [p for ref in references if (p := quoted_code_problem(page, *ref))]
    assert not problems, f"{page.relative_to(ROOT)}: " + "; ".join(problems)


def test_a_quoted_fragment_that_drifted_is_caught():
    page = ROOT / "docs" / "algorithms" / "fedbr.md"
    target = "../../fedbr_flwr/core/losses.py"
    assert quoted_code_problem(page, "soft_cross_entropy", target, "-(target * F.log_softmax(logits, dim=1))") is None
    assert "no longer contains" in quoted_code_problem(page, "soft_cross_entropy", target, "F.softmax(logits)")
    assert "defines no" in quoted_code_problem(page, "hard_cross_entropy", target, "x")
    assert "does not exist" in quoted_code_problem(page, "f", "../../nowhere.py", "x")
