"""Who the workers run as, and what they inherit.

elasticd runs as root (it must signal and reap every process of a generation, and bind
the ports it is given); the jobs it starts run the scripts operators submit, so they run
as an unprivileged user: ``worker_user`` (default: the ``mselastic`` system user; elasticd
refuses to start without one, and refuses ``nobody``, which other daemons share). Running them
as root takes ``worker_user = "root"``, written out. An elasticd that is not root starts its
workers as itself.

The workers' environment is built, not inherited: the daemon's variables on an
allowlist (locale, time zone, PATH, proxies, MindSpore's, glog's and Ascend's own settings,
PYTHONPATH / LD_LIBRARY_PATH, which only an admin can have set there, and the names the
admin adds with ``pass_env``), then the job's
``env``, then the daemon's ``MSELASTIC_*``. A job's ``env`` may not set loader or
interpreter variables (``LD_*``, ``PYTHON*``, ``PATH``, ...: each can run code of its
choosing inside every worker) unless the admin allows that name (``allow_env``).
"""

from __future__ import annotations

import dataclasses
import grp
import os
import pwd
import shutil
import subprocess
import sys

#: Daemon variables a worker inherits (besides ``LC_*``, ``MS_*``, ``GLOG_*``).
INHERITED = frozenset({"PATH", "LANG", "LANGUAGE", "TZ", "TERM", "TMPDIR", "PYTHONPATH", "LD_LIBRARY_PATH",
                       "http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY",
                       "OMP_NUM_THREADS"})
INHERITED_PREFIXES = ("LC_", "MS_", "GLOG_", "ASCEND_", "HCCL_")
def inherited_env(environ: dict[str, str] | os._Environ[str], extra: frozenset[str] = frozenset()) -> dict[str, str]:
    """The daemon's variables a worker gets; ``extra`` (the admin's ``pass_env``): more names, or
    prefixes written ``NAME*``."""
    names = INHERITED | {e for e in extra if not e.endswith("*")}
    prefixes = INHERITED_PREFIXES + tuple(e[:-1] for e in extra if e.endswith("*"))
    return {k: v for k, v in environ.items() if k in names or k.startswith(prefixes)}


@dataclasses.dataclass(frozen=True)
class WorkerUser:
    name: str
    uid: int
    gid: int
    #: Other groups it is in (the socket's group may not be one of them).
    groups: frozenset[int] = frozenset()
    #: A user of the passwd database (its groups are its own: setpriv --init-groups); False for a
    #: job's uid of ``job_uids`` (no entry: ``groups`` are all it gets).
    passwd: bool = True

    @property
    def is_root(self) -> bool:
        return self.uid == 0

    def setpriv_args(self) -> list[str]:
        """setpriv's options that make a process this user, with its groups."""
        groups = ["--init-groups"] if self.passwd else \
            [f"--groups={','.join(map(str, sorted(self.groups)))}"] if self.groups else ["--clear-groups"]
        return [f"--reuid={self.uid}", f"--regid={self.gid}", *groups]

    def for_job(self, uid: int) -> "WorkerUser":
        """The user a job of ``job_uids`` runs as: ``uid``, its group the same number, no other
        (a group shared by the jobs would let each read what another made group-readable)."""
        return WorkerUser(str(uid), uid, uid, frozenset(), passwd=False)

    @property
    def switch(self) -> bool:
        """Whether starting a worker changes the user (elasticd is root and the worker user is not
        elasticd's own)."""
        return self.uid != os.geteuid()


class UserError(ValueError):
    pass


def resolve(name: str) -> WorkerUser:
    """The worker user elasticd starts jobs as, by the ``worker_user`` setting ("" = the default)."""
    me = pwd.getpwuid(os.geteuid())
    if os.geteuid() != 0:
        if name and name != me.pw_name:
            raise UserError(f"elasticd runs as {me.pw_name}, which cannot start workers as {name}; run elasticd "
                            f"as root, or leave worker_user empty (the workers then run as {me.pw_name})")
        return _user(me)
    if not name:
        try:
            return _user(pwd.getpwnam("mselastic"))
        except KeyError:
            raise UserError("there is no user mselastic on this node (the default worker user): create it "
                            "(elasticctl install-unit does; or useradd --system --no-create-home mselastic), or name "
                            "another worker_user") from None
    try:
        user = _user(pwd.getpwnam(name))
    except KeyError:
        raise UserError(f"there is no user {name!r} on this node; create it (useradd --system {name}) or name "
                        f"another") from None
    if user.name == "nobody" or user.uid == 65534:
        raise UserError(f"{name} is shared by other daemons (NFS's anonymous user, ...): jobs running as it could "
                        f"reach their files and processes, and they the jobs'; create a user for the workers "
                        f"(useradd --system --no-create-home mselastic) and leave worker_user empty")
    return user


def setpriv(user: WorkerUser) -> list[str]:
    """The command prefix that runs what follows as ``user`` (its groups too)."""
    return [shutil.which("setpriv") or "setpriv", *user.setpriv_args(), "--"]


def _probe(user: WorkerUser, cmd: list[str]) -> tuple[subprocess.CompletedProcess[str], str]:
    """``cmd`` run as ``user`` (elasticd's own identity when it does not switch), and why it
    failed: the last line it wrote ("" when it exited 0)."""
    r = subprocess.run([*setpriv(user), *cmd] if user.switch else cmd, capture_output=True, text=True, timeout=60,
                       env=inherited_env(os.environ), cwd="/")
    lines = (r.stderr or r.stdout).strip().splitlines() if r.returncode else [""]
    return r, lines[-1] if lines else f"exit {r.returncode}"


def cannot_run_python(user: WorkerUser) -> str:
    """Why ``user`` cannot run this installation's Python ("" when it can): msrun and the workers
    are this venv's interpreter, and a Python under a private home (a pyenv in /root) is out of
    another user's reach."""
    if not user.switch:
        return ""
    r, why = _probe(user, [sys.executable, "-c", "import sys, mselastic.trainer; print(sys.base_prefix)"])
    if r.returncode != 0:
        return f"user {user.name} cannot run {sys.executable}: {why}"
    if r.stdout.strip() != sys.base_prefix:
        # It started, but could not reach its own installation and fell back to another Python's.
        return (f"user {user.name} cannot reach this Python's installation {sys.base_prefix} (it ran with "
                f"{r.stdout.strip() or '?'}'s library instead)")
    return ""


def batch_prefix() -> list[str]:
    """What starts a command under the SCHED_BATCH policy (util-linux's chrt), for the jobs'
    processes (elasticd's ``batch_scheduling``; why: docs/journal/2026-12.md, "... SCHED_BATCH")."""
    chrt = shutil.which("chrt")
    if chrt is None:
        raise RuntimeError("chrt (util-linux) not found: install util-linux, or set batch_scheduling = false")
    return [chrt, "--batch", "0"]


def cannot_start_batch(user: WorkerUser) -> str:
    """Why ``user``'s processes cannot be started under SCHED_BATCH ("" when they can): chrt missing,
    or the kernel refusing it (elasticd under SCHED_IDLE without CAP_SYS_NICE and RLIMIT_NICE, a
    seccomp filter), which would otherwise fail every launch with only msrun's log saying why."""
    try:
        r, why = _probe(user, [*batch_prefix(), "true"])
    except RuntimeError as e:
        return str(e)
    return f"{user.name}'s processes cannot run under SCHED_BATCH: {why}" if r.returncode else ""


def _user(pw: pwd.struct_passwd) -> WorkerUser:
    groups = frozenset(g.gr_gid for g in grp.getgrall() if pw.pw_name in g.gr_mem)
    return WorkerUser(pw.pw_name, pw.pw_uid, pw.pw_gid, groups)


def users_in(uids: range) -> tuple[int, str] | None:
    """(id, "user NAME" or "group NAME") of the first user or group whose id is in ``uids`` (each
    id asked for: a directory service, SSSD or LDAP, need not list its users); None when none is."""
    for i in uids:
        for kind, lookup in (("user", lambda n: pwd.getpwuid(n).pw_name), ("group", lambda n: grp.getgrgid(n).gr_name)):
            try:
                return i, f"{kind} {lookup(i)}"
            except KeyError:
                continue
    return None
