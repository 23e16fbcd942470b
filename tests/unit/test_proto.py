"""The checked-in generated code matches proto/ (regenerated with the pinned grpcio-tools)."""

from __future__ import annotations

from mselastic.v1 import generate


def test_generated_code_is_fresh() -> None:
    assert generate.main(["--check"]) == 0, "run `make proto` and commit the result"
