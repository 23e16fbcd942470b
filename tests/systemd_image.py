"""The image the systemd tests boot (see :mod:`tests.systemd_container`), built once and cached
under ``build/systemd/image-<key>`` (the key hashes the package list, requirements.txt and
IMAGE_VERSION), in two stages:

1. the base: a minimal Debian made by debootstrap (80-110 s here, mostly downloads). It needs
   nothing of the project's venv (this module is standard library only), so ``make test`` runs
   it while the venv installs: ``python -m tests.systemd_image``;
2. the image: a venv at ``/opt/mselastic/.venv`` in it holding the pinned dependencies,
   installed from a wheelhouse pip downloaded on the host (pip's cache holds them once the
   project's venv is installed). A test session that will boot containers starts it in the
   background at its start, at the lowest CPU and I/O priority (``python -m tests.systemd_image
   --image``: ~70 s of pip, while the tests before the systemd ones mostly wait on their jobs);
   the first systemd test waits for it (``image()``) and builds it itself if it failed.

Both stages are safe to run from several processes at once (a lock file) and say in
``build.log`` how long they took.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import glob
import hashlib
import os
import shutil
import subprocess
import sys
import time
from typing import Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(REPO, "build", "systemd")
IMAGE_VERSION = 1
# libgomp1: MindSpore's CPU kernels need it (its own install notes); minbase does not have it.
PACKAGES = "systemd,systemd-sysv,dbus,python3,python3-venv,procps,iproute2,libgomp1"
VENV = "/opt/mselastic/.venv"
CGROUP_ROOTS = ("/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd")
CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def cannot_boot() -> str:
    """Why a container cannot be booted here ("" when it can)."""
    if os.geteuid() != 0:
        return "booting a systemd container needs root"
    for tool in ("systemd-nspawn", "debootstrap", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (make systemd-tools installs it)"
    if not all(os.path.isdir(d) for d in CGROUP_ROOTS) and not os.path.exists("/sys/fs/cgroup/cgroup.procs"):
        return "no cgroup hierarchy nspawn can use"
    if _mirror() == "":
        return "no Debian mirror in apt's sources for debootstrap"
    return ""


def _mirror() -> str:
    for path, key in (("/etc/apt/sources.list.d/debian.sources", "URIs:"), ("/etc/apt/sources.list", "deb")):
        with contextlib.suppress(OSError):
            with open(path) as f:
                for line in f:
                    parts = line.split()
                    if len(parts) > 1 and parts[0] == key:
                        return parts[1]
    return ""


def run_logged(cmd: list[str], log: str, timeout: float, **kw: object) -> None:
    """Run ``cmd`` with its output appended to ``log``; on failure raise with the log's tail."""
    with open(log, "ab") as out:
        r = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, **kw)  # type: ignore[call-overload]
    if r.returncode != 0:
        with open(log, errors="replace") as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {r.returncode}); {log}:\n{tail}")


def _top() -> str:
    with open(os.path.join(REPO, "requirements.txt"), "rb") as f:
        key = hashlib.sha256(f.read() + PACKAGES.encode() + str(IMAGE_VERSION).encode()).hexdigest()[:12]
    return os.path.join(BUILD, f"image-{key}")


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    os.makedirs(BUILD, exist_ok=True)
    with open(os.path.join(BUILD, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _stage_done(top: str, stage: str, t0: float) -> None:
    with open(os.path.join(top, stage), "w") as f:
        f.write(f"built in {time.monotonic() - t0:.0f} s\n")


def base() -> str:
    """The Debian rootfs without the venv (built on first use, then cached); returns its path."""
    top = _top()
    rootfs = os.path.join(top, "rootfs")
    with _locked():
        if any(os.path.exists(os.path.join(top, done)) for done in (".base-done", ".done")):
            return rootfs
        for old in glob.glob(os.path.join(BUILD, "image-*")):  # an older image (requirements changed), or half one
            shutil.rmtree(old, ignore_errors=True)
        os.makedirs(top)
        t0 = time.monotonic()
        # In a mount namespace of its own: the proc/sys mounts debootstrap makes in the rootfs go
        # with it, also when it is stopped half-way.
        run_logged(["unshare", "--mount", "--propagation", "private", "--", "debootstrap", "--variant=minbase",
                    f"--include={PACKAGES}", "bookworm", rootfs, _mirror()], os.path.join(top, "build.log"), 900)
        with open(os.path.join(rootfs, "etc", "hostname"), "w") as f:
            f.write("mselastic-test\n")
        _stage_done(top, ".base-done", t0)
        return rootfs


def image(pip: str) -> str:
    """The rootfs with the venv (built on first use, then cached), its wheels downloaded by ``pip``."""
    rootfs = base()
    top = os.path.dirname(rootfs)
    with _locked():
        if os.path.exists(os.path.join(top, ".done")):
            return rootfs
        log, t0 = os.path.join(top, "build.log"), time.monotonic()
        wheels = os.path.join(BUILD, "wheelhouse")
        run_logged([pip, "download", "--quiet", "--only-binary=:all:", "--dest", wheels,
                    "-r", os.path.join(REPO, "requirements.txt")], log, 900)
        shutil.copy(os.path.join(REPO, "requirements.txt"), os.path.join(wheels, "requirements.txt"))
        # The venv is made and filled inside the image (its own python3), from the wheelhouse only.
        inside = (f"mkdir -p {rootfs}/mnt/wheelhouse && mount --bind {wheels} {rootfs}/mnt/wheelhouse && "
                  f"mount -t proc proc {rootfs}/proc && mount --rbind /dev {rootfs}/dev && "
                  f"rm -rf {rootfs}{VENV} && chroot {rootfs} /usr/bin/python3 -m venv {VENV} && "
                  f"chroot {rootfs} {VENV}/bin/pip install --quiet --no-index --find-links /mnt/wheelhouse "
                  f"-r /mnt/wheelhouse/requirements.txt")
        run_logged(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", inside], log, 900,
                   env={"PATH": CLEAN_PATH, "HOME": "/root", "LANG": "C.UTF-8"})
        _stage_done(top, ".done", t0)
        return rootfs


def ready() -> bool:
    """Whether the whole image (both stages) is built."""
    return os.path.exists(os.path.join(_top(), ".done"))


def main() -> int:
    """``python -m tests.systemd_image``: build the base now (``make test`` does, beside the venv);
    with ``--image``, the whole image (its venv's wheels downloaded by this venv's pip)."""
    p = argparse.ArgumentParser(prog="python -m tests.systemd_image", description=main.__doc__)
    p.add_argument("--image", action="store_true", help="build the whole image, not only its base")
    args = p.parse_args()
    why_not = cannot_boot()
    if why_not:  # the systemd tests say so themselves (and fail in CI)
        print(f"systemd image: not built ({why_not})")
        return 0
    t0 = time.monotonic()
    if args.image:
        path = image(os.path.join(os.path.dirname(sys.executable), "pip"))
        print(f"systemd image ready in {time.monotonic() - t0:.0f} s: {path}")
        return 0
    path = base()
    print(f"systemd image base ready in {time.monotonic() - t0:.0f} s: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
