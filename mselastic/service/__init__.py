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

import os
import shutil
import subprocess
import sys
import sysconfig
from importlib import resources

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
    """The elasticd script installed beside this interpreter."""
    path = os.path.join(sysconfig.get_path("scripts"), "elasticd")
    if not os.access(path, os.X_OK):
        raise InstallError(f"no elasticd beside {sys.executable} ({path}): install mselastic with pip into this "
                           f"environment first")
    return path


def unit_text(elasticd: str) -> str:
    unit = text("elasticd.service")
    if SHIPPED_EXEC not in unit:  # a packaging mistake, caught by the tests
        raise InstallError("the shipped unit has no ExecStart line to point at elasticd")
    return unit.replace(SHIPPED_EXEC, f"ExecStart={elasticd} --config /etc/mselastic/elasticd.toml")


def install(root: str = "/", reload: bool = True) -> list[str]:
    """Write the unit, the sysusers.d entry and (when absent) the configuration under ``root``;
    on ``/`` with ``reload``, create the user and reload systemd. Returns what was done, one line each."""
    done = []
    elasticd = elasticd_path()
    for rel, body, mode, keep in ((UNIT, unit_text(elasticd), 0o644, False),
                                  (SYSUSERS, text("sysusers.conf"), 0o644, False),
                                  (CONFIG, text("elasticd.toml"), 0o640, True)):
        path = os.path.join(root, rel)
        if keep and os.path.exists(path):
            done.append(f"kept {path} (already there)")
            continue
        try:
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            tmp = f"{path}.tmp{os.getpid()}"
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w") as f:
                f.write(body)
            os.chmod(tmp, mode)  # whatever the umask
            os.replace(tmp, path)
        except OSError as e:
            raise InstallError(f"cannot write {path}: {e.strerror} (install-unit writes to /etc: run it as root)") \
                from None
        done.append(f"wrote {path}" + (f" (ExecStart={elasticd})" if rel == UNIT else ""))
    if os.path.realpath(root) == "/" and reload:
        for cmd in (["systemd-sysusers", os.path.join(root, SYSUSERS)], ["systemctl", "daemon-reload"]):
            if shutil.which(cmd[0]) is None:
                raise InstallError(f"{cmd[0]} not found: is this a systemd machine?")
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            if r.returncode != 0:
                raise InstallError(f"{' '.join(cmd)} failed: {(r.stderr or r.stdout).strip()}")
            done.append(f"ran {' '.join(cmd)}")
    return done
