"""The shape rules the code keeps, read from the source with `ast`: each flag of the gateway's
own commands (`serve`, `worker`) written in exactly one module and none in Rust; no class
name defined in two modules; at most one module named `registry.py`; no function over 120
lines. Each rule exists because breaking it cost a maintainer a search through the tree
(docs/architecture.md, "Package map")."""

from __future__ import annotations

import argparse
import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

from sessiongate.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "sessiongate"
# Other commands, whose own flags may share a name with the gateway's (`--host`, `--port`,
# `--tokenizer` of the mock engine, the load driver, the demo, the plugins listing).
OTHER_COMMANDS = ("mock_engine", "loadgen", "demo", "session_routing/cli.py")
MAX_FUNCTION_LINES = 120


def gateway_flags() -> set[str]:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    flags: set[str] = set()
    for name in ("serve", "worker"):
        for action in commands.choices[name]._actions:
            flags.update(s for s in action.option_strings if s.startswith("--"))
    return flags - {"--help"}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def is_other_command(path: Path) -> bool:
    relative = path.relative_to(PACKAGE).as_posix()
    return any(relative.startswith(prefix) for prefix in OTHER_COMMANDS)


def string_literals(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def test_each_flag_is_written_in_exactly_one_module() -> None:
    flags = gateway_flags()
    where: dict[str, list[str]] = defaultdict(list)
    for path in modules():
        if is_other_command(path):
            continue
        for literal in string_literals(path) & flags:
            where[literal].append(path.relative_to(PACKAGE).as_posix())
    missing = sorted(flag for flag in flags if flag not in where)
    assert not missing, f"flags declared nowhere as a literal: {missing}"
    several = {flag: found for flag, found in where.items() if len(found) > 1}
    assert not several, f"flags written in several modules: {several}"


def test_no_flag_is_written_in_rust() -> None:
    flags = gateway_flags()
    pattern = re.compile(r'"(--[a-z0-9][a-z0-9-]*)')
    found = {
        f"{path.relative_to(ROOT)}: {match}"
        for path in (ROOT / "rust").rglob("*.rs")
        for match in pattern.findall(path.read_text(encoding="utf-8"))
        if match in flags
    }
    assert not found, sorted(found)


def test_no_class_name_is_defined_in_two_modules() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for path in modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                where[node.name].append(path.relative_to(PACKAGE).as_posix())
    twice = {name: found for name, found in where.items() if len(found) > 1}
    assert not twice, twice


def test_at_most_one_module_is_named_registry() -> None:
    found = [p.relative_to(PACKAGE).as_posix() for p in modules() if p.name == "registry.py"]
    assert len(found) <= 1, found


@pytest.mark.parametrize("root", ["python/sessiongate"])
def test_no_function_is_over_120_lines(root: str) -> None:
    long: list[str] = []
    for path in sorted((ROOT / root).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines})")
    assert not long, long


def test_every_package_has_its_tests_folder() -> None:
    """tests/<package>/ mirrors python/sessiongate/<package>/ (docs/development.md, "Test")."""
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    missing = sorted(
        name for name in packages if not any((ROOT / "tests" / name).glob("test_*.py"))
    )
    assert not missing, missing
