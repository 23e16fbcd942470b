"""What a launch checks before anything starts (the script, the checkpoint and log folders, msrun,
the job's env, the master port), so that msrun does not fail on it later, or never say why."""

from __future__ import annotations

import os
import socket
import subprocess

from mselastic.agent.containment.users import WorkerUser, setpriv
from mselastic.core.spec import JobSpec, forbidden_env
from mselastic.core.states import FailureCause


def port_free(port: int) -> bool:
    """Whether TCP ``port`` can be bound here (a socket in TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT does not count
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


class LaunchError(Exception):
    """A generation cannot start here; ``cause`` says whether the spec or the node is at fault."""

    def __init__(self, cause: FailureCause, message: str) -> None:
        super().__init__(message)
        self.cause = cause


def preflight(spec: JobSpec, log_dir: str, msrun: str, user: WorkerUser | None = None,
              allow_env: frozenset[str] = frozenset(), join: list[str] | None = None) -> None:
    """What msrun would otherwise fail on later, or never report: checked before anything starts.

    The script and the checkpoint directory come from the spec (the same on every node, on shared
    storage): not usable here means not usable at all, so the job fails with the path and the
    error. The log directory and msrun belong to the node. ``join``: the prefix that puts the
    worker user's probes in the job's cgroup (:func:`mselastic.agent.containment.cgroups.join_prefix`): they
    run as the job's user, and another process of it could take them over."""
    def os_error(e: OSError) -> str:
        return e.strerror or str(e)

    refused = forbidden_env(dict(spec.env), allow_env)
    if refused:
        raise LaunchError(FailureCause.LAUNCH_SPEC, f"env sets {', '.join(refused)}: loader and interpreter variables "
                                                    f"run code in every worker; an admin may allow them (allow_env)")
    if not os.path.isfile(spec.script):
        why = "is a directory" if os.path.isdir(spec.script) else "does not exist"
        raise LaunchError(FailureCause.LAUNCH_SPEC, f"script {spec.script} {why}")
    if not os.access(spec.script, os.R_OK):
        raise LaunchError(FailureCause.LAUNCH_SPEC, f"script {spec.script} is not readable")
    if user is not None and user.switch:
        # Made by the worker user itself, as its own: root creating (and handing over) a path a
        # spec names would let a job choose where it may write (a venv's site-packages...). Then
        # asked of that user whether it may write there (a read-only mount, an ACL, ProtectSystem
        # without ReadWritePaths: the mode bits do not tell).
        as_worker = [*(join or []), *setpriv(user)]
        made = subprocess.run([*as_worker, "mkdir", "-p", "--", spec.checkpoint_dir],
                              capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
        if made.returncode != 0:
            why = (made.stderr.strip().splitlines() or ["mkdir failed"])[-1].split(": ")[-1]
            raise LaunchError(FailureCause.LAUNCH_SPEC, f"checkpoint_dir {spec.checkpoint_dir} cannot be created by "
                                                        f"the worker user {user.name}: {why}")
        probe = subprocess.run([*as_worker, "sh", "-c", 'test -w "$1" && test -x "$1"', "sh", spec.checkpoint_dir],
                               capture_output=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
        if probe.returncode != 0:
            raise LaunchError(FailureCause.LAUNCH_SPEC, f"checkpoint_dir {spec.checkpoint_dir} is not writable by the "
                                                        f"worker user {user.name} (uid {user.uid})")
    else:
        try:
            os.makedirs(spec.checkpoint_dir, exist_ok=True)
        except OSError as e:
            raise LaunchError(FailureCause.LAUNCH_SPEC,
                              f"checkpoint_dir {spec.checkpoint_dir} cannot be created: {os_error(e)}") from None
        if not os.access(spec.checkpoint_dir, os.W_OK | os.X_OK):
            raise LaunchError(FailureCause.LAUNCH_SPEC, f"checkpoint_dir {spec.checkpoint_dir} is not writable")
    try:
        os.makedirs(log_dir, exist_ok=True)
        # msrun's own log, made by root before the folder is handed over (its fd is inherited).
        os.close(os.open(os.path.join(log_dir, "msrun.log"),
                         os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o640))
        if user is not None and user.switch:
            os.chown(log_dir, user.uid, user.gid)  # msrun and the workers write their logs there
            parent = os.path.dirname(log_dir)
            for d in (parent, os.path.dirname(parent), os.path.dirname(os.path.dirname(parent))):
                os.chmod(d, os.stat(d).st_mode | 0o001)  # the worker user may pass (not list): work_dir/logs/<job>
    except OSError as e:
        raise LaunchError(FailureCause.LAUNCH_NODE, f"log directory {log_dir} cannot be created: {os_error(e)}") \
            from None
    if not os.access(msrun, os.X_OK):
        raise LaunchError(FailureCause.LAUNCH_NODE, f"msrun not found at {msrun}")
