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
    "ctl": {"core", "tls", "wire", "v1", "systemd", "__init__"},
    "trainer": {"core"},
    "wire": {"core", "v1"},
    "tls": set(),
    "metrics": {"core"},
    "systemd": set(),  # the unit and its installer: files and systemctl, nothing of the daemon
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


def violations(path: str, part: str) -> list[str]:
    """What in ``path`` (a module of ``part``) breaks the contracts, one line each."""
    found = []
    for line, name in imports(path):
        if name.split(".")[0] == "mindspore" and part != "trainer":
            found.append(f"{path}:{line}: only the trainer library imports MindSpore")
        if not name.startswith("mselastic.") or name == "mselastic":
            continue
        target = name.split(".")[1]
        target = "__init__" if target == "__version__" else target
        if target != part and target not in ALLOWED[part]:
            found.append(f"{os.path.relpath(path, REPO)}:{line}: {part} may not import mselastic.{target}")
    return found


@pytest.mark.parametrize("path", modules(), ids=lambda p: os.path.relpath(p, REPO))
def test_layers_only_point_down(path: str) -> None:
    part = part_of(path)
    if part == "__init__":
        return
    assert part in ALLOWED, f"{part}: a new part of the package needs its row in ALLOWED"
    assert not violations(path, part)


def test_the_checker_sees_violations(tmp_path: os.PathLike[str]) -> None:
    """Not vacuous: an upward import (also one inside a function) and MindSpore outside the trainer."""
    path = os.path.join(str(tmp_path), "bad.py")
    with open(path, "w") as f:
        f.write("from mselastic.store import keys\n\ndef f():\n    import mindspore\n    from mselastic import metrics\n")
    found = violations(path, "core")
    assert len(found) == 3 and "core may not import mselastic.store" in found[0], found
    assert "only the trainer library imports MindSpore" in found[1] and "mselastic.metrics" in found[2], found
