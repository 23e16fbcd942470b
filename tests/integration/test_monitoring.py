"""The alert rules shipped in mselastic/monitoring/, checked and exercised by Prometheus's own
promtool (Debian's `prometheus` package, which `make test` installs): the rules and the scrape
configuration are valid, each alert fires on the series it is for and not on a healthy
cluster's (mselastic.rules.test.yml), and every metric a rule reads is one elasticd serves."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from tests.harness import REPO

MONITORING = os.path.join(REPO, "mselastic", "monitoring")
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None and not os.environ.get("CI"),
                                reason="promtool missing (make test installs Debian's prometheus package)")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL, "promtool is not installed: make test installs it (Debian's prometheus package)"
    return subprocess.run([PROMTOOL, *args], cwd=MONITORING, capture_output=True, text=True, timeout=60)


def test_the_rules_and_the_scrape_configuration_are_valid() -> None:
    r = promtool("check", "rules", "mselastic.rules.yml")
    assert r.returncode == 0 and "SUCCESS: 8 rules found" in r.stdout, r.stdout + r.stderr
    r = promtool("check", "config", "prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_each_alert_fires_on_its_series_and_not_on_a_healthy_clusters() -> None:
    r = promtool("test", "rules", "mselastic.rules.test.yml")
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
    with open(os.path.join(MONITORING, "mselastic.rules.yml")) as f:
        alerts = set(re.findall(r"- alert: (\w+)", f.read()))
    with open(os.path.join(MONITORING, "mselastic.rules.test.yml")) as f:
        tested = set(re.findall(r"alertname: (\w+)", f.read()))
    assert alerts == tested, alerts ^ tested


def test_every_metric_a_rule_reads_is_one_elasticd_serves() -> None:
    from prometheus_client import REGISTRY

    from mselastic import metrics  # noqa: F401  (registers them)

    served = {s.name for m in REGISTRY.collect() for s in m.samples} | {
        name for name in REGISTRY._names_to_collectors}
    with open(os.path.join(MONITORING, "mselastic.rules.yml")) as f:
        read = set(re.findall(r"\b(mselastic_\w+)", f.read()))
    assert read and read <= served, read - served
