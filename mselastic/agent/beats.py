"""Heartbeat reception: a generation's abstract datagram socket, and the check that a beat comes
from a process of that generation (the kernel names each sender: ``SCM_CREDENTIALS``)."""

from __future__ import annotations

import asyncio
import logging
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


def sender_pid(ancillary: list[tuple[int, int, bytes]]) -> int:
    """The sender's pid the kernel attached to a datagram (-1: none)."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _CREDS.size:
            return int(_CREDS.unpack(data[:_CREDS.size])[0])
    return -1


class Senders:
    """Whether a pid is a process of a generation: a descendant of what elasticd launched for it
    (msrun or the standbys: ``roots()``) or one of its ranks (``is_rank()``). Not the run id in its
    environment: that id is public (it is the socket's name, listed in /proc/net/unix), any process
    can carry it. Remembered per (pid, start time), the answer either way, so a reused pid is
    looked at again."""

    def __init__(self, roots: Callable[[], set[int]], is_rank: Callable[[int], bool]) -> None:
        self._roots, self._is_rank = roots, is_rank
        self._known: dict[tuple[int, float], bool] = {}

    def ours(self, pid: int) -> bool:
        roots = self._roots()
        if pid <= 0 or not roots:
            return False
        if self._is_rank(pid):  # a rank found among msrun's children
            return True
        try:
            proc = psutil.Process(pid)
            key = (pid, proc.create_time())
            if key not in self._known:
                self._known[key] = pid in roots or any(p.pid in roots for p in proc.parents())
            return self._known[key]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            # A rank's last beat (planned_exit) is read after it exited: known senders still count.
            return any(ok and key[0] == pid for key, ok in self._known.items())


class BeatSocket:
    """The socket a generation's ranks send their beats to (``name``, abstract). Each beat from a
    process of the generation (``senders``), well formed, goes to ``on_beat(beat, sender_pid)``;
    the rest are dropped and counted."""

    def __init__(self, name: str, senders: Senders, on_beat: Callable[[Beat, int], None],
                 ctx: dict[str, Any]) -> None:
        self._senders, self._on_beat, self._ctx = senders, on_beat, ctx
        self._forgers: set[int] = set()  # pids whose beats were dropped (logged once each)
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        # The kernel attaches each sender's pid/uid/gid (SCM_CREDENTIALS): any local user can reach
        # an abstract socket, so a beat counts only from a process of this generation.
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._sock.bind("\0" + name)
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
            sender = sender_pid(ancillary)
            if not self._senders.ours(sender):
                metrics.FORGED_BEATS.inc()
                if sender not in self._forgers:
                    self._forgers.add(sender)
                    log.warning("heartbeat from pid %d, not a process of this generation: dropped", sender,
                                extra=self._ctx)
                continue
            try:
                beat = Beat.decode(data)
            except ValueError:
                log.warning("malformed heartbeat dropped", extra=self._ctx)
                continue
            self._on_beat(beat, sender)

    def close(self) -> None:
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
