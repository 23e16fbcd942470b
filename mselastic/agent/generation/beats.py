"""Heartbeat reception: a generation's datagram socket, and the check that a beat comes from a
process of that generation (the kernel names each sender: ``SCM_CREDENTIALS``).

The socket is a file in elasticd's own folder (``/run/mselastic/hb``, mode 0711: nobody else lists
it), owned by the generation's user, mode 0600: only that user's processes (and root) can send to
it, so another local user cannot flood its queue (an abstract socket, which anyone in the network
namespace reaches, only where no such folder can be had). What does arrive is checked cheaply
first (the sender's uid, from the kernel), and the caches the check keeps are bounded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from typing import Any, Callable

import psutil

from mselastic import metrics
from mselastic.core.contract import Beat

log = logging.getLogger(__name__)

#: Datagrams read per wake-up of the socket's reader; the rest wait for the next turn of the loop.
MAX_BEATS_PER_READ = 256

#: struct ucred: pid, uid, gid (SCM_CREDENTIALS).
_CREDS = struct.Struct("3i")


#: Senders remembered at most (a flood of short-lived forgers must not grow elasticd's memory).
MAX_KNOWN = 4096
#: Forging pids logged at most per generation (then only counted: FORGED_BEATS).
MAX_LOGGED_FORGERS = 16


def sender(ancillary: list[tuple[int, int, bytes]]) -> tuple[int, int]:
    """The sender's (pid, uid) the kernel attached to a datagram ((-1, -1): none)."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _CREDS.size:
            pid, uid, _ = _CREDS.unpack(data[:_CREDS.size])
            return int(pid), int(uid)
    return -1, -1


class Senders:
    """Whether a pid is a process of a generation: a descendant of what elasticd launched for it
    (msrun or the standbys: ``roots()``) or one of its ranks (``is_rank()``). Not the run id in its
    environment: that id is public (it is the socket's name, listed in /proc/net/unix), any process
    can carry it. Remembered per (pid, start time), the answer either way, so a reused pid is
    looked at again."""

    def __init__(self, roots: Callable[[], set[int]], is_rank: Callable[[int], bool], uid: int = -1,
                 cgroup: str = "") -> None:
        self._roots, self._is_rank = roots, is_rank
        #: The generation's user (-1: any): a sender of another uid (root aside) is refused at once.
        self._uid = uid
        #: The generation's cgroup ("/...gen-<run id>"; "": none): a sender is of the generation when
        #: the kernel puts it there (one read of /proc/PID/cgroup, no walk of its ancestors).
        self._cgroup = cgroup
        self._known: dict[tuple[int, float], bool] = {}

    def ours(self, pid: int, uid: int = -1) -> bool:
        if self._uid >= 0 and uid not in (self._uid, 0):
            return False
        roots = self._roots()
        if pid <= 0 or not roots:
            return False
        if self._is_rank(pid):  # a rank found among msrun's children
            return True
        try:
            proc = psutil.Process(pid)
            key = (pid, proc.create_time())
            if key not in self._known:
                if len(self._known) >= MAX_KNOWN:  # the older half goes (insertion order)
                    for old in list(self._known)[:MAX_KNOWN // 2]:
                        del self._known[old]
                self._known[key] = pid in roots or (self._in_cgroup(pid) if self._cgroup
                                                    else any(p.pid in roots for p in proc.parents()))
            return self._known[key]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            # A rank's last beat (planned_exit) is read after it exited: known senders still count.
            return any(ok and key[0] == pid for key, ok in self._known.items())


    def _in_cgroup(self, pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                return any(line.rstrip("\n").endswith(self._cgroup) for line in f)
        except OSError:
            return False


class BeatSocket:
    """The socket a generation's ranks send their beats to (``name``, abstract). Each beat from a
    process of the generation (``senders``), well formed, goes to ``on_beat(beat, sender_pid)``;
    the rest are dropped and counted."""

    def __init__(self, address: str, senders: Senders, on_beat: Callable[[Beat, int], None],
                 ctx: dict[str, Any], owner: tuple[int, int] | None = None) -> None:
        """``address``: a path (bound, mode 0600, then handed to ``owner``, (uid, gid)), or an
        abstract name."""
        self._senders, self._on_beat, self._ctx = senders, on_beat, ctx
        self._forgers: set[int] = set()  # pids whose beats were dropped (logged once each, a few)
        self._path = address if address.startswith("/") else ""
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # The kernel attaches each sender's pid/uid/gid (SCM_CREDENTIALS): a beat counts only from
        # a process of this generation.
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        if self._path:
            with contextlib.suppress(FileNotFoundError):  # (one an elasticd that died left)
                os.unlink(self._path)
            self._sock.bind(self._path)
            os.chmod(self._path, 0o600)  # (first: root may not chmod what it no longer owns)
            if owner is not None:
                os.chown(self._path, *owner)
        else:
            self._sock.bind("\0" + address)
        self._sock.setblocking(False)
        asyncio.get_running_loop().add_reader(self._sock.fileno(), self.read)

    def read(self) -> None:
        """Read the beats queued (at most ``MAX_BEATS_PER_READ``: a flood must not hold the event
        loop, lease renewals wait on it); also called to drain them before a decision."""
        if self._sock is None:
            return
        for _ in range(MAX_BEATS_PER_READ):
            try:
                data, ancillary, _, _ = self._sock.recvmsg(4096, socket.CMSG_SPACE(_CREDS.size))
            except OSError:  # (BlockingIOError: none left)
                return
            pid, uid = sender(ancillary)
            if not self._senders.ours(pid, uid):
                metrics.FORGED_BEATS.inc()
                if pid not in self._forgers and len(self._forgers) < MAX_LOGGED_FORGERS:
                    self._forgers.add(pid)
                    log.warning("heartbeat from pid %d (uid %d), not a process of this generation: dropped", pid, uid,
                                extra=self._ctx)
                continue
            try:
                beat = Beat.decode(data)
            except ValueError:
                log.warning("malformed heartbeat dropped", extra=self._ctx)
                continue
            self._on_beat(beat, pid)

    def close(self) -> None:
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
            if self._path:
                with contextlib.suppress(OSError):
                    os.unlink(self._path)
