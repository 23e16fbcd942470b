"""elasticd as a systemd service: the unit, the sample configuration and the sysusers.d entry
ship inside the package, and :func:`install` puts them in place for the elasticd this
Python runs (``elasticctl install-unit``).

What it writes, under ``root`` (``/`` on a node):

- ``/etc/systemd/system/elasticd.service``: the unit, ExecStart pointing at the ``elasticd``
  next to this interpreter (the venv or prefix mselastic was installed into);
- ``/etc/sysusers.d/mselastic.conf``: the ``mselastic`` system user the jobs run as;
- ``/etc/mselastic/elasticd.toml``: the sample configuration, only when there is none (an
  edited configuration is never overwritten), mode 0640.

Then, on ``/`` only, ``systemd-sysusers`` creates the user and ``systemctl daemon-reload``
makes systemd read the unit. Nothing is started: ``systemctl enable --now elasticd`` is the
operator's step, once the configuration says where etcd is.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from importlib import resources

import mselastic

UNIT = "etc/systemd/system/elasticd.service"
SYSUSERS = "etc/sysusers.d/mselastic.conf"
CONFIG = "etc/mselastic/elasticd.toml"
#: The ExecStart line as shipped; install() points it at this installation's elasticd.
SHIPPED_EXEC = "ExecStart=/opt/mselastic/.venv/bin/elasticd --config /etc/mselastic/elasticd.toml"


class InstallError(Exception):
    pass


def text(name: str) -> str:
    """A shipped file: ``elasticd.service``, ``elasticd.toml`` or ``sysusers.conf``."""
    return resources.files(__name__).joinpath(name).read_text()


def elasticd_path() -> str:
    """The elasticd script installed beside this interpreter, if root alone can change it."""
    path = os.path.join(sysconfig.get_path("scripts"), "elasticd")
    if not os.access(path, os.X_OK):
        raise InstallError(f"no elasticd beside {sys.executable} ({path}): install mselastic with pip into this "
                           f"environment first")
    if any(c.isspace() for c in path) or "%" in path:
        raise InstallError(f"{path}: a path with spaces or '%' would be split or expanded by systemd; install "
                           f"mselastic elsewhere (/opt/mselastic/.venv)")
    code = {path, os.path.realpath(path), os.path.realpath(sys.executable), sysconfig.get_path("purelib"),
            sysconfig.get_path("platlib"), os.path.dirname(os.path.realpath(mselastic.__file__))}
    for what in sorted(code | {os.path.realpath(p) for p in code}):  # the path as written and where it leads
        if why := _not_roots(what):
            raise InstallError(f"{why}: the unit would run, as root, code another user can change; install "
                               f"mselastic where only root may write (/opt/mselastic/.venv)")
    return path


def _not_roots(path: str) -> str:
    """Why ``path`` or a folder above it may be changed by someone other than root ("" if not)."""
    here = os.path.abspath(path)
    while True:
        st = os.stat(here)
        if st.st_uid != 0:
            return f"{here} belongs to uid {st.st_uid}"
        if st.st_mode & 0o022 and not (os.path.isdir(here) and st.st_mode & 0o1000):
            return f"{here} is writable by its group or others (mode {st.st_mode & 0o7777:o})"
        if here == "/":
            return ""
        here = os.path.dirname(here)


def unit_text(elasticd: str) -> str:
    unit = text("elasticd.service")
    if SHIPPED_EXEC not in unit:  # a packaging mistake, caught by the tests
        raise InstallError("the shipped unit has no ExecStart line to point at elasticd")
    return unit.replace(SHIPPED_EXEC, f"ExecStart={elasticd} --config /etc/mselastic/elasticd.toml")


def _write(root: str, rel: str, body: str, mode: int) -> str:
    """Write ``root/rel`` atomically (a temporary file of its own, fsynced, renamed), never
    through a symlink that leads out of ``root``."""
    path = os.path.join(root, rel)
    folder = os.path.dirname(path)
    real_root = os.path.realpath(root)

    def inside(d: str) -> None:
        if os.path.commonpath([real_root, os.path.realpath(d)]) != real_root:
            raise InstallError(f"{d} leads out of {root} (to {os.path.realpath(d)}): refusing to write there")

    existing = folder
    while not os.path.exists(existing):  # checked before anything is made: no folder outside either
        existing = os.path.dirname(existing)
    inside(existing)
    os.makedirs(folder, mode=0o755, exist_ok=True)
    inside(folder)
    real_folder = os.path.realpath(folder)
    fd, tmp = tempfile.mkstemp(dir=real_folder, prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(body)
            f.flush()
            os.fchmod(f.fileno(), mode)  # whatever the umask
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(real_folder, os.path.basename(path)))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def install(root: str = "/", reload: bool = True) -> list[str]:
    """Write the unit, the sysusers.d entry and (when absent) the configuration under ``root``;
    on ``/`` with ``reload``, create the user and reload systemd. Returns what was done, one line each."""
    if not os.path.isdir(root):
        raise InstallError(f"--root {root}: no such directory")
    live = os.path.realpath(root) == "/" and reload
    tools = (["systemd-sysusers", os.path.join(root, SYSUSERS)], ["systemctl", "daemon-reload"]) if live else ()
    for cmd in tools:
        if shutil.which(cmd[0]) is None:
            raise InstallError(f"{cmd[0]} not found: is this a systemd machine? (--root DIR writes the files only)")
    elasticd = elasticd_path()
    done = []
    for rel, body, mode, keep in ((UNIT, unit_text(elasticd), 0o644, False),
                                  (SYSUSERS, text("sysusers.conf"), 0o644, False),
                                  (CONFIG, text("elasticd.toml"), 0o640, True)):
        if keep and os.path.lexists(os.path.join(root, rel)):
            done.append(f"kept {os.path.join(root, rel)} (already there)")
            continue
        try:
            path = _write(root, rel, body, mode)
        except OSError as e:
            raise InstallError(f"cannot write {os.path.join(root, rel)}: {e.strerror} (install-unit writes to /etc: "
                               f"run it as root)") from None
        done.append(f"wrote {path}" + (f" (ExecStart={elasticd})" if rel == UNIT else ""))
    for cmd in tools:
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            raise InstallError(f"{' '.join(cmd)} did not finish in 60 s") from None
        if r.returncode != 0:
            raise InstallError(f"{' '.join(cmd)} failed: {(r.stderr or r.stdout).strip()}")
        done.append(f"ran {' '.join(cmd)}")
    return done
