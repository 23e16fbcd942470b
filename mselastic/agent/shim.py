"""The generation's shim: a small process per generation, apart from elasticd, that holds the
fence where the generation is. elasticd keeps a deadline on disk (``<logs>/g<N>.deadline``: the
lease the workers run on, plus the outage grace, on ``CLOCK_BOOTTIME``) and moves it on with
every renewal; the shim reads it four times a second and, once it has passed, writes why
(``.fenced``) and kills the generation (its cgroup, and every process carrying its markers).
elasticd frozen (a SIGSTOP, a debugger, swap storms), its event loop stuck, or the machine
suspended: the deadline stops moving, and the generation ends itself before a leader may replace
it (``fencing.fenced_within``), with or without systemd's watchdog.

It runs half a round behind elasticd's own deadline check (``LAG``), so that a live elasticd
fences first and reports the fence as such; elasticd reads ``.fenced`` too, and a generation the
shim ended is reported self-fenced, not failed.

What the shim shares with elasticd is versioned (``RECORD_VERSION``): the generation's record
(``.shim.json``: who it is, what to kill), the deadline and the fence. A record of a version
this shim does not know is refused with one line, and the shim exits (elasticd then fences by
itself, as before there were shims).

For now the shim dies with elasticd (a parent-death signal, like msrun and the ranks): it guards
the generation while elasticd cannot, not after it is gone. Run as ``python -m
mselastic.agent.shim RECORD``; SIGTERM ends it (elasticd sends it when the generation is over).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import tempfile
import time
from typing import Any

from mselastic.agent import procs
from mselastic.agent.cgroups import Group, Layout
from mselastic.core import fencing
from mselastic.core.pdeathsig import with_parent_death

log = logging.getLogger(__name__)

RECORD_VERSION = 1
#: How often the shim reads the deadline.
POLL_S = 0.25


def lag_s(ttl_s: float) -> float:
    """How long after elasticd's own deadline the shim fences: half a round (elasticd's check runs
    every quarter second; the leader waits a round, a probe and the kill more: fencing_within)."""
    return fencing.round_s(ttl_s) / 2


@dataclasses.dataclass(frozen=True)
class Record:
    """The generation as the shim knows it. ``paths``: the files beside its log folder."""

    job: str
    generation: int
    node: str
    markers: list[str]
    ttl_s: float
    cgroup_layout: dict[str, Any] | None = None
    cgroup_rel: str = ""
    read_as: int = -1  # the worker user's uid (-1: the workers run as elasticd)
    version: int = RECORD_VERSION

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Record":
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("version") != RECORD_VERSION:
            raise ValueError(f"record version {raw.get('version') if isinstance(raw, dict) else '?'}, this shim "
                             f"reads version {RECORD_VERSION}")
        return cls(**raw)

    def group(self) -> Group | None:
        return Group(Layout(**self.cgroup_layout), self.cgroup_rel) if self.cgroup_layout else None


@dataclasses.dataclass(frozen=True)
class Paths:
    """The shim's files, beside the generation's log folder (in elasticd's folder: the worker user
    owns the log folder itself, and must not move its own deadline)."""

    base: str

    @property
    def record(self) -> str:
        return self.base + ".shim.json"

    @property
    def deadline(self) -> str:
        return self.base + ".deadline"

    @property
    def fenced(self) -> str:
        return self.base + ".fenced"

    def all(self) -> list[str]:
        return [self.record, self.deadline, self.fenced]


def write_atomically(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-" + os.path.basename(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_deadline(paths: Paths, until: float) -> None:
    write_atomically(paths.deadline, json.dumps({"version": RECORD_VERSION, "until": until}))


def read_deadline(paths: Paths) -> float:
    raw = json.loads(open(paths.deadline).read())
    if not isinstance(raw, dict) or raw.get("version") != RECORD_VERSION or not isinstance(raw.get("until"), float):
        raise ValueError(f"not a deadline of version {RECORD_VERSION}: {raw!r:.80}")
    return raw["until"]


def fence_reason(paths: Paths) -> str | None:
    """Why the shim fenced the generation (None: it has not)."""
    try:
        raw = json.loads(open(paths.fenced).read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return f"fenced by its shim (the record is unreadable: {e})"
    return str(raw.get("reason", "fenced by its shim")) if isinstance(raw, dict) else "fenced by its shim"


class Handle:
    """elasticd's side of one generation's shim: start it, move its deadline on, stop it."""

    def __init__(self, base: str, ctx: dict[str, Any]) -> None:
        self.paths, self._ctx = Paths(base), ctx
        self.proc: asyncio.subprocess.Process | None = None
        self._until, self._gone = 0.0, False

    async def start(self, record: Record, until: float) -> None:
        """Write the record and the deadline, and start the shim (it need not be up before the
        launch: it finds the generation's processes by their cgroup and markers when it fences)."""
        for path in self.paths.all():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        write_atomically(self.paths.record, record.to_json())
        write_deadline(self.paths, until)
        self._until = until
        self.proc = await asyncio.create_subprocess_exec(
            *with_parent_death([sys.executable, "-m", "mselastic.agent.shim", self.paths.record]),
            stdin=asyncio.subprocess.DEVNULL, start_new_session=True)

    def extend(self, until: float) -> None:
        """Move the deadline on (written when it changed; nothing before the shim is started)."""
        if self.proc is not None and until != self._until:
            write_deadline(self.paths, until)
            self._until = until

    def fenced(self) -> str | None:
        """Why the shim fenced the generation (None: it has not). A shim gone without a fence is
        logged once: elasticd alone fences the generation from then on."""
        proc = self.proc
        if proc is None:
            return None
        why = fence_reason(self.paths)
        if why is None and proc.returncode is not None and not self._gone:
            self._gone = True
            log.error("the generation's shim (pid %d) exited with %s; elasticd alone fences the generation",
                      proc.pid, proc.returncode, extra=self._ctx)
        return why

    def end(self) -> None:
        """The generation is over: the shim is asked to end (SIGTERM; asyncio reaps it)."""
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
        for path in (self.paths.record, self.paths.deadline):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def kill(record: Record) -> list[int]:
    """SIGKILL to the generation (its cgroup, and every process carrying its markers), until none is
    left or ``fencing.KILL_S`` has passed; the pids left."""
    group, markers = record.group(), set(record.markers)
    deadline = time.monotonic() + fencing.KILL_S
    while True:
        if group is not None:
            group.kill()
        left = procs.marked(markers)
        procs.signal_groups(left, signal.SIGKILL)
        pids = sorted((group.pids() if group is not None else set()) | {p.pid for p in left if procs.running(p)})
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.02)


def watch(record: Record, paths: Paths, ctx: dict[str, Any]) -> int:
    """Fence the generation once its deadline has passed; 0 once asked to end (SIGTERM)."""
    lag, until, seen = lag_s(record.ttl_s), 0.0, -1
    while True:
        try:
            mtime = os.stat(paths.deadline).st_mtime_ns
            if mtime != seen:
                until, seen = read_deadline(paths), mtime
        except FileNotFoundError:
            pass  # (removed as the generation ends) the last one read stands
        except (OSError, ValueError) as e:  # never extended by what cannot be read
            log.error("deadline unreadable (%s); the last one read stands", e, extra=ctx)
        over = fencing.clock() - until
        if until and over >= lag:
            why = (f"{fencing.Rule.OUTAGE_TOO_LONG.value}: elasticd did not move the deadline on; "
                   f"{over:.1f}s past it (its shim fenced the generation)")
            log.error("self-fencing: %s", why, extra=ctx)
            write_atomically(paths.fenced, json.dumps({"version": RECORD_VERSION, "reason": f"self-fenced: {why}",
                                                       "at": fencing.clock()}))
            left = kill(record)
            if left:
                log.error("processes left after the fence: %s", left, extra=ctx)
                return 1
            return 0
        time.sleep(POLL_S)


def main(argv: list[str]) -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s job=%(job)s gen=%(generation)s node=%(node)s "
                               "rank=-: %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if len(argv) != 1:
        print("usage: python -m mselastic.agent.shim RECORD (elasticd starts it)", file=sys.stderr)
        return 2
    ctx = dict(job="-", generation="-", node="-")
    try:
        record = Record.from_json(open(argv[0]).read())
    except (OSError, ValueError, TypeError) as e:
        log.error("shim not started: the generation's record %s cannot be used (%s); elasticd alone fences it",
                  argv[0], e, extra=ctx)
        return 2
    ctx = dict(job=record.job, generation=str(record.generation), node=record.node)
    if record.read_as > 0:
        procs.read_as(record.read_as)
    return watch(record, Paths(argv[0].removesuffix(".shim.json")), ctx)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
