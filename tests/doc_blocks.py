"""The docs' runnable blocks: a fenced block after ``<!-- readme-run: NAME -->`` is run as
written by a test (the README's and getting started's by ``test_readme``, the operations
guide's three nodes by ``test_systemd``), so what an operator copies is what was tested."""

from __future__ import annotations

import os
import re
import shlex

from tests.harness import REPO

RUN = re.compile(r"<!-- readme-run: (.+?) -->\s*```\w*\n(.*?)```", re.S)


def blocks(page: str) -> dict[str, str]:
    """``page``'s runnable blocks (a path from the repository's root), by name, in order."""
    with open(os.path.join(REPO, page)) as f:
        return dict(RUN.findall(f.read()))


def as_script(blocks: list[str]) -> str:
    """One bash script of the blocks' lines (a line continued with a backslash is one): each
    echoed, then run; a line whose comment says "refused" must exit 1, any other 0 (else the
    script stops with the line); `... &` starts in the background, as typed."""
    out = ['cd "$WS"']
    for block in blocks:
        for raw in re.sub(r"\\\n\s*", "", block).splitlines():  # (a line continued with \ is one)
            cmd, comment = (re.split(r"\s+#\s", raw, maxsplit=1) + [""])[:2]
            cmd = cmd.strip()
            if not cmd or cmd.startswith("#"):
                continue
            q = shlex.quote(cmd)
            if cmd.endswith("&"):
                out.append(f"echo + {q}; {cmd}")
            elif comment.startswith("refused"):
                out.append(f"echo + {q}; {cmd}; rc=$?; [ $rc = 1 ] || {{ echo README: exit $rc, not 1: {q}; exit 90; }}")
            else:
                out.append(f"echo + {q}; {cmd} || {{ rc=$?; echo README: exit $rc: {q}; exit 91; }}")
    return "\n".join(out) + "\n"
