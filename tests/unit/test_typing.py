"""mypy is clean on the package (settings in pyproject.toml)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.harness import REPO


def test_mypy_clean() -> None:
    r = subprocess.run([os.path.join(os.path.dirname(sys.executable), "mypy")], cwd=REPO,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
