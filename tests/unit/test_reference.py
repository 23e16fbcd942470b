"""docs/reference/ is what the code says: the settings (Settings and its doc comments), the
commands (elasticd's and elasticctl's --help) and the metrics (the registry). A change to any of
them without `make reference` fails here, naming the pages."""

from __future__ import annotations

import os
import re

from scripts import reference
from tests.harness import REPO


def test_the_reference_pages_are_generated_from_the_code_as_it_is() -> None:
    pages = reference.render()
    assert set(pages) == {"settings.md", "commands.md", "metrics.md"}
    assert not reference.stale(pages), f"docs/reference: {reference.stale(pages)} differ from the code: run `make reference`"


def test_every_setting_command_and_metric_is_in_its_page() -> None:
    """The pages are whole: every key with its default, every elasticctl command, every metric."""
    import dataclasses

    from mselastic import metrics
    from mselastic.ctl.main import COMMANDS
    from mselastic.daemon.settings import Settings

    pages = reference.render()
    for f in dataclasses.fields(Settings):
        assert re.search(rf"^\| `{f.name}` \| \w+ \| `{re.escape(reference._toml(getattr(Settings(), f.name)))}` \| \S",
                         pages["settings.md"], re.M), f.name
    for command in COMMANDS:
        assert f"\n### elasticctl {command}\n" in pages["commands.md"], command
    for m in vars(metrics).values():
        if hasattr(m, "_labelnames") and hasattr(m, "describe"):
            assert f"`{m._name}" in pages["metrics.md"], m._name


def test_a_field_shares_the_comment_of_the_one_above_it_when_it_has_none() -> None:
    from mselastic.daemon.settings import Settings

    docs = reference.field_docs(Settings)
    assert docs["tls_key"] == docs["tls_cert"] and docs["tls_cert"].startswith("TLS for the gRPC port")
    assert docs["master_port_span"] == docs["master_port_start"]
    assert all(docs.values()), [k for k, v in docs.items() if not v]


def test_the_docs_link_only_to_files_and_headings_that_exist() -> None:
    """Every relative link of README.md and docs/*.md (and docs/reference/) names a file of the
    repository, and an anchor one of that page's headings (GitHub's rule: lowercase, spaces to
    '-', punctuation dropped)."""
    def anchors(path: str) -> set[str]:
        with open(path) as f:
            text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
        return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.+)$", text, re.M)}

    pages = [os.path.join(REPO, "README.md")] + [
        os.path.join(d, f) for d in (os.path.join(REPO, "docs"), os.path.join(REPO, "docs", "reference"))
        for f in sorted(os.listdir(d)) if f.endswith(".md")]
    broken = []
    for page in pages:
        with open(page) as f:
            text = re.sub(r"```.*?```", "", f.read(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(full) or (anchor and full.endswith(".md") and anchor not in anchors(full)):
                broken.append(f"{os.path.relpath(page, REPO)}: {target}")
    assert not broken, broken
