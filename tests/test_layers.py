"""The layer contracts of STYLE.md, checked on every import statement of the package (also the
ones inside functions), as import-linter would: layers only point down, elasticctl reaches the
daemon only through the wire contract, and MindSpore is imported by the trainer library alone."""

from __future__ import annotations

import ast
import os

import pytest

from tests.harness import REPO

PKG = os.path.join(REPO, "mselastic")

#: Which top-level parts of ``mselastic`` each part may import (itself always).
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "store": {"core"},
    "agent": {"core", "store", "tls", "wire", "v1", "metrics", "__init__"},
    "daemon": {"core", "store", "agent", "tls", "wire", "v1", "metrics", "__init__"},
    "ctl": {"core", "tls", "wire", "v1", "__init__"},
    "trainer": {"core"},
    "wire": {"core", "v1"},
    "tls": set(),
    "metrics": {"core"},
}


def imports(path: str) -> list[tuple[int, str]]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                                                       if node.module == "mselastic"]
    return found


def part_of(path: str) -> str:
    rel = os.path.relpath(path, PKG)
    return rel.split(os.sep)[0].removesuffix(".py")


def modules() -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(PKG) for f in files
                  if f.endswith(".py") and os.sep + "v1" not in d)


@pytest.mark.parametrize("path", modules(), ids=lambda p: os.path.relpath(p, REPO))
def test_layers_only_point_down(path: str) -> None:
    part = part_of(path)
    if part == "__init__":
        return
    assert part in ALLOWED, f"{part}: a new part of the package needs its row in ALLOWED"
    for line, name in imports(path):
        if name.split(".")[0] == "mindspore":
            assert part == "trainer", f"{path}:{line}: only the trainer library imports MindSpore"
        if not name.startswith("mselastic.") or name == "mselastic":
            continue
        target = name.split(".")[1]
        if target in ("__version__",):
            target = "__init__"
        assert target == part or target in ALLOWED[part], \
            f"{os.path.relpath(path, REPO)}:{line}: {part} may not import mselastic.{target}"


def test_the_contract_can_fail() -> None:
    """A violation is seen: the checker is not vacuous."""
    sample = os.path.join(PKG, "core", "planner.py")
    names = [n for _, n in imports(sample)]
    assert "mselastic.core.model" in names
    assert "store" not in ALLOWED["core"] and "agent" not in ALLOWED["ctl"] and "daemon" not in ALLOWED["agent"]
