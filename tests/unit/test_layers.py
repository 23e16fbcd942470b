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
    "monitoring": set(),  # alert rules and a scrape configuration: files only
}


#: Inside ``agent``, by concern, from the top down: the node (agent/*.py: registration, the
#: service, reports) over one generation, which uses devices and warm standbys, which all stand on
#: containment. Which concerns each may import (itself always; "" is the node's own modules).
AGENT_ALLOWED: dict[str, set[str]] = {
    "": {"generation", "devices", "standbys", "containment"},
    "generation": {"devices", "standbys", "containment"},
    "devices": {"containment"},
    "standbys": {"containment"},
    "containment": set(),
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


def concern_of(path: str) -> str:
    """The agent's concern a module of it is in ("" a module of the node's own)."""
    rel = os.path.relpath(path, os.path.join(PKG, "agent")).split(os.sep)
    return rel[0] if len(rel) > 1 else ""


def agent_target(name: str) -> str | None:
    """The agent's concern ``name`` (an imported module, dotted) is in; None: not the agent's."""
    parts = name.split(".")
    if parts[:2] != ["mselastic", "agent"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in AGENT_ALLOWED else ""


def modules() -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(PKG) for f in files
                  if f.endswith(".py") and os.sep + "v1" not in d)


def violations(path: str, part: str, where: str = "") -> list[str]:
    """What in ``path`` (a module of ``part``, at ``where`` in the package if not there) breaks the
    contracts, one line each."""
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
        if part == "agent" and (concern := agent_target(name)) is not None:
            mine = concern_of(where or path)
            if concern != mine and concern not in AGENT_ALLOWED[mine]:
                found.append(f"{os.path.relpath(path, REPO)}:{line}: agent/{mine or '*.py'} may not import "
                             f"agent/{concern or '*.py'} ({name})")
    return found


@pytest.mark.parametrize("path", modules(), ids=lambda p: os.path.relpath(p, REPO))
def test_layers_only_point_down(path: str) -> None:
    part = part_of(path)
    if part == "__init__":
        return
    assert part in ALLOWED, f"{part}: a new part of the package needs its row in ALLOWED"
    if part == "agent":
        assert concern_of(path) in AGENT_ALLOWED, f"{path}: a new concern of the agent needs its row in AGENT_ALLOWED"
    assert not violations(path, part)


def test_the_checker_sees_violations(tmp_path: os.PathLike[str]) -> None:
    """Not vacuous: an upward import (also one inside a function) and MindSpore outside the trainer."""
    path = os.path.join(str(tmp_path), "bad.py")
    with open(path, "w") as f:
        f.write("from mselastic.store import keys\n\ndef f():\n    import mindspore\n    from mselastic import metrics\n")
    found = violations(path, "core")
    assert len(found) == 3 and "core may not import mselastic.store" in found[0], found
    assert "only the trainer library imports MindSpore" in found[1] and "mselastic.metrics" in found[2], found


def test_the_checker_sees_the_agents_concerns_point_up(tmp_path: os.PathLike[str]) -> None:
    """Not vacuous inside the agent: containment importing the generation, or the node's own module."""
    path = os.path.join(str(tmp_path), "bad.py")
    with open(path, "w") as f:
        f.write("from mselastic.agent.generation import shim\nfrom mselastic.agent.node import NodeAgent\n"
                "from mselastic.agent.containment import procs\n")
    found = violations(path, "agent", where=os.path.join(PKG, "agent", "containment", "bad.py"))
    assert len(found) == 2 and "agent/containment may not import agent/generation" in found[0], found
    assert "may not import agent/*.py (mselastic.agent.node)" in found[1], found
