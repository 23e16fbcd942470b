"""A real systemd (Debian bookworm's 252) as PID 1 of a systemd-nspawn container, for testing
elasticd the way operators run it: installed from the wheel, started and stopped by systemctl,
its logs read with journalctl.

The image (a minimal Debian with a venv at ``/opt/mselastic/.venv`` holding the pinned
dependencies) is built once and cached: see :mod:`tests.systemd_image`. The project itself is
never in the image: each container installs the wheel built from the checkout (``pip install
mselastic-*.whl[trainer]`` with the wheelhouse as its only index) and runs ``elasticctl
install-unit``.

These machines' PID 1 is not systemd (no machined, no system bus, ``/run`` on disk, cgroup
v1/v2 hybrid), which shapes how a container is started:

- ``--register=no --keep-unit``: nothing asks the (absent) host systemd for anything; so no
  ``machinectl`` or ``systemctl -M``: commands run inside through ``nsenter`` into the
  container's PID 1 with a clean environment;
- nspawn runs in a private mount namespace with a tmpfs over ``/run`` (it refuses to clean its
  propagation directory on a disk file system);
- nspawn and the container live in a dedicated cgroup (``unified`` and the v1 ``name=systemd``
  hierarchy), removed depth-first at the end: a unit's host PIDs are its cgroup's
  ``cgroup.procs`` under it;
- ``--volatile=overlay``: the image stays pristine, writes go to a tmpfs and vanish.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time
from typing import Iterator

from tests import systemd_image
from tests.harness import REPO, VENV_BIN, wait_for
from tests.systemd_image import CGROUP_ROOTS, CLEAN_PATH, VENV, cannot_boot, run_logged

__all__ = ["VENV", "Container", "cannot_boot", "image", "wheel"]


def image() -> str:
    """The rootfs to boot: :func:`tests.systemd_image.image` (built on first use, then cached)."""
    return systemd_image.image(os.path.join(VENV_BIN, "pip"))


def wheel(out_dir: str) -> str:
    """The project's wheel, built from the checkout (``python -m build``)."""
    run_logged([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", out_dir, REPO],
               os.path.join(out_dir, "build.log"), 300, cwd=REPO)
    (found,) = glob.glob(os.path.join(out_dir, "mselastic-*.whl"))
    return found


class Container:
    """One booted container (``with Container(...) as c``): its own systemd, its own network
    namespace (only ``lo``, or a veth on ``bridge``), the image under a throw-away overlay."""

    _count = 0

    def __init__(self, name: str, rootfs: str, log_dir: str, binds_ro: dict[str, str] | None = None,
                 bridge: str = "", binds_rw: dict[str, str] | None = None) -> None:
        self.name, self.rootfs, self.log_dir = name, rootfs, log_dir
        self.binds_ro, self.binds_rw = binds_ro or {}, binds_rw or {}
        self.bridge = bridge
        Container._count += 1  # two containers may share a name (a module's n0 and a test's n0)
        self.cgroup = f"mselastic-test-{name}-{os.getpid()}-{Container._count}"
        self.nspawn: subprocess.Popen[bytes] | None = None
        self.init_pid = 0

    def __enter__(self) -> "Container":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def start(self) -> None:
        args = ["-D", self.rootfs, "--boot", f"--machine={self.name}", "--register=no", "--keep-unit",
                "--console=read-only", "--volatile=overlay"]
        args += [f"--network-bridge={self.bridge}"] if self.bridge else ["--private-network"]
        args += [f"--bind-ro={host}:{inside}" for host, inside in self.binds_ro.items()]
        args += [f"--bind={host}:{inside}" for host, inside in self.binds_rw.items()]  # (shared storage)
        for root in CGROUP_ROOTS:
            os.makedirs(os.path.join(root, self.cgroup), exist_ok=True)
        # Join the dedicated cgroups, hide the host's on-disk /run behind a tmpfs in a private
        # mount namespace, then become nspawn (same PID).
        script = ("".join(f"echo $$ > {root}/{self.cgroup}/cgroup.procs; " for root in CGROUP_ROOTS)
                  + "exec unshare --mount --propagation private -- sh -c "
                    "'mount -t tmpfs -o mode=755 tmpfs /run && exec systemd-nspawn \"$@\"' sh \"$@\"")
        log = open(os.path.join(self.log_dir, f"nspawn-{self.name}.log"), "ab")
        self.nspawn = subprocess.Popen(["sh", "-c", script, "sh", *args], stdin=subprocess.DEVNULL, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.init_pid = wait_for("the container's systemd", self._find_init, 20, 0.02)
        state = wait_for("the container booted", lambda: self._booted(), 60, 0.1)
        if state == "degraded":
            failed = self.run("systemctl", "--failed", "--no-pager", check=False).stdout
            raise AssertionError(f"container {self.name} booted degraded:\n{failed}")

    def _find_init(self) -> int | None:
        assert self.nspawn is not None
        if self.nspawn.poll() is not None:
            with open(os.path.join(self.log_dir, f"nspawn-{self.name}.log"), errors="replace") as f:
                raise AssertionError(f"nspawn exited {self.nspawn.returncode}:\n{f.read()[-2000:]}")
        for pid in _descendants(self.nspawn.pid):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() == "systemd":
                        return pid
        return None

    def _booted(self) -> str | None:
        state = self.run("systemctl", "is-system-running", check=False, timeout=10).stdout.strip()
        return state if state in ("running", "degraded") else None

    def run(self, *cmd: str, check: bool = True, timeout: float = 120, input: str | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """A command inside the container (all its namespaces, a clean environment)."""
        extra = [f"{k}={v}" for k, v in (env or {}).items()]
        r = subprocess.run(["nsenter", "-t", str(self.init_pid), "-a", "env", "-i", f"PATH={VENV}/bin:{CLEAN_PATH}",
                            "LANG=C.UTF-8", *extra, *cmd], capture_output=True, text=True, timeout=timeout,
                           input=input)
        if check and r.returncode != 0:
            raise AssertionError(f"in {self.name}: {' '.join(cmd)} -> exit {r.returncode}\n{r.stdout}\n{r.stderr}")
        return r

    def write(self, path: str, text: str) -> None:
        self.run("sh", "-c", f"mkdir -p \"$(dirname {path})\" && cat > {path}", input=text)

    def copy(self, src: str, path: str, mode: int = 0o644) -> None:
        """A host file copied to ``path`` inside, root's, with ``mode``."""
        with open(src) as f:
            self.run("install", "-D", "-m", f"{mode:o}", "/dev/stdin", path, input=f.read())

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.run("systemctl", "show", unit, "-p", ",".join(props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def unit_pids(self, unit: str) -> list[int]:
        """Host PIDs of every process in the unit's cgroup (and below)."""
        pids: list[int] = []
        for path in glob.glob(os.path.join(CGROUP_ROOTS[0], self.cgroup, "payload", "system.slice", unit, "**",
                                           "cgroup.procs"), recursive=True):
            with contextlib.suppress(OSError):
                with open(path) as f:
                    pids += [int(p) for p in f.read().split()]
        return pids

    def journal(self, unit: str) -> list[dict[str, str]]:
        out = self.run("journalctl", "-u", unit, "-o", "json", "--no-pager").stdout
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def stop(self) -> None:
        """Halt the container (nspawn turns SIGTERM into an orderly shutdown, which stops
        elasticd's jobs with their grace), then SIGKILL whatever is left in its cgroup and
        remove the cgroups; raise if anything could not be removed."""
        p = self.nspawn
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=60)
        kill = os.path.join(CGROUP_ROOTS[0], self.cgroup, "cgroup.kill")  # every process below, at once
        if os.path.exists(kill):
            with contextlib.suppress(OSError):
                with open(kill, "w") as f:
                    f.write("1")
        if p is not None:
            p.wait(timeout=30)
        left = []
        for root in CGROUP_ROOTS:
            top = os.path.join(root, self.cgroup)
            for _ in range(100):
                if not os.path.isdir(top):
                    break
                for d, _dirs, _files in sorted(os.walk(top), key=lambda w: -w[0].count("/")):
                    with contextlib.suppress(OSError):
                        os.rmdir(d)
                if os.path.isdir(top):
                    time.sleep(0.1)
            if os.path.isdir(top):
                left.append(top)
        if left:
            raise AssertionError(f"container {self.name}: cgroups still there after SIGKILL: {left}")


def _descendants(pid: int) -> Iterator[int]:
    todo = [pid]
    while todo:
        p = todo.pop()
        for children in glob.glob(f"/proc/{p}/task/*/children"):
            with contextlib.suppress(OSError):
                with open(children) as f:
                    for c in f.read().split():
                        yield int(c)
                        todo.append(int(c))
