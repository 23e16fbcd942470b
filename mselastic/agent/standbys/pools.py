"""The standbys this node keeps for the jobs running here, one pool per job (see
:mod:`mselastic.agent.standbys.forkserver` for what a standby is): filled once a generation trains, taken by
the next relaunch of the same launch, stopped when the job no longer runs here."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from typing import Any, Awaitable, Callable

from mselastic.agent.standbys.forkserver import READY_TIMEOUT_S, ForkServer, Spawner, Standby
from mselastic.core.waits import within

#: What stops whatever is left in a fork server's cgroup once it has ended (by its marker).
Releaser = Callable[[str], Awaitable[None]]

log = logging.getLogger(__name__)

#: A job's standbys are stopped this long after its last generation here ended (at once when it
#: succeeded): a relaunch comes within seconds, a job that went elsewhere or ended does not need them.
STANDBY_KEEP_S = 60.0
#: A pool whose fork server exited this many times (the OOM killer, a job whose import crashes it)
#: starts no more: its relaunches start cold.
MAX_FORK_SERVERS = 3

#: Fork servers whose pool closed while standbys they forked still ran as ranks (see
#: StandbyPool.close), and pools being closed.
_retiring_servers: set[asyncio.Task[None]] = set()


class StandbyPool:
    """The standbys this node keeps for one job and launch key, forked by the pool's fork server."""

    def __init__(self, job: str, node_id: str, key: str, spawn: Spawner, release: Releaser | None = None) -> None:
        self.job, self.node_id, self.key = job, node_id, key
        self._spawn, self._release = spawn, release  # (start a fork server; stop what it left)
        self.server: ForkServer | None = None
        self._servers_started = 0
        self.standbys: list[Standby] = []
        self._filling: asyncio.Task[None] | None = None
        self._closed = False
        #: Why filling stopped for good ("" while it may go on): a fork server that cannot start
        #: (the worker user cannot import MindSpore, ...) is not started again and again.
        self.broken = ""
        self._ctx = dict(job=job, node=node_id)

    def ready(self) -> list[Standby]:
        return [s for s in self.standbys if s.ready_at and s.alive]

    def fill(self, size: int) -> None:
        """Have ``size`` standbys alive (in the background): the fork server started first if it is
        not running (it imports MindSpore), then one fork per missing standby."""
        if self._closed or self.broken or (self._filling is not None and not self._filling.done()):
            return
        self._filling = asyncio.create_task(self._fill(size), name=f"standbys-{self.job}")

    async def _fill(self, size: int) -> None:
        dead = [s for s in self.standbys if not s.alive]
        self.standbys = [s for s in self.standbys if s.alive]
        await asyncio.gather(*(s.kill() for s in dead))  # (reaped already: no signal is sent)
        if size <= len(self.standbys):
            return
        server = await self._server()
        while server is not None and server.alive and len(self.standbys) < size and not self.broken:
            if not await self._start_one(server, size):
                break

    async def _server(self) -> ForkServer | None:
        """The running fork server, started (and waited for) if need be; None when it cannot start."""
        if self.server is not None and self.server.alive:
            return self.server
        if self.server is not None:  # it died (the OOM killer): its standbys with it; a new one
            old, self.server = self.server, None
            log.warning("fork server pid %d exited with code %s; starting another", old.pid, old.proc.returncode,
                        extra=self._ctx)
            self._retire(old)
        if self._servers_started >= MAX_FORK_SERVERS:
            self._break(f"the standby fork server was started {self._servers_started} times and exited each time")
            return None
        self._servers_started += 1
        started = time.monotonic()
        try:
            marker = self._marker()
            server = self.server = await ForkServer.start(
                self._spawn, marker, functools.partial(self._release, marker) if self._release else None)
        except (OSError, RuntimeError) as e:
            self._break(f"a standby could not be started: {e}")
            return None
        if await server.await_ready(READY_TIMEOUT_S):
            log.info("standby fork server pid %d ready in %.1fs", server.pid, time.monotonic() - started,
                     extra=self._ctx)
            return server
        try:  # its output ended: it exited (or is exiting); else it timed out
            code: int | None = await within(server.proc.wait(), 2.0)
        except asyncio.TimeoutError:
            code = None
        self.server = None
        await server.close()
        if not self._closed:
            self._break(f"standby pid {server.pid} exited with code {code} before it was ready" if code is not None
                        else f"standby pid {server.pid} was not ready within {READY_TIMEOUT_S:.0f}s")
        return None

    def _marker(self) -> str:
        return f"standby.{self.job}.{self.node_id}.{uuid.uuid4().hex[:8]}"

    async def _start_one(self, server: ForkServer, size: int) -> bool:
        """Fork one standby; False when this fill should stop (the next one tries again)."""
        started = time.monotonic()
        try:
            standby = await Standby.start(server.fork, self._marker())
        except (OSError, RuntimeError) as e:
            # (A server that died: the next fill starts another. A fork refused, for want of
            # memory or processes: the next fill tries again.)
            log.warning("a standby could not be forked: %s", e, extra=self._ctx)
            return False
        self.standbys.append(standby)
        if await standby.await_ready():
            log.info("standby pid %d forked and ready in %.3fs (%s)", standby.pid, time.monotonic() - started,
                     f"{len(self.ready())} of {size}" if standby in self.standbys else "taken by a relaunch already",
                     extra=self._ctx)
            return True
        if standby.taken:  # a generation's now: it reports what became of it (and was maybe stopped)
            return True
        try:
            code: int | None = await within(standby.proc.wait(), 2.0)
        except asyncio.TimeoutError:
            code = None
        if standby in self.standbys:
            self.standbys.remove(standby)
        await standby.kill()
        if not self._closed and server.alive:
            self._break(f"standby pid {standby.pid} exited with code {code} before it was ready" if code is not None
                        else f"standby pid {standby.pid} was not ready within {READY_TIMEOUT_S:.0f}s")
        return False

    def _retire(self, server: ForkServer) -> None:
        """Stop ``server`` once no standby it forked runs (a taken one is a rank now, and dies with it)."""
        task = asyncio.create_task(server.close_after(server.running()), name=f"fork-server-retire-{server.pid}")
        _retiring_servers.add(task)
        task.add_done_callback(_retiring_servers.discard)

    def _break(self, why: str) -> None:
        if not self.broken:
            self.broken = why
            log.warning("%s; relaunches of this job start cold here", why, extra=self._ctx)

    def take(self, count: int) -> list[Standby]:
        """``count`` live standbys, removed from the pool, the ready ones first; [] when it has
        fewer. One still importing is taken too (a relaunch soon after the last, before the
        replacements are ready): the handover waits for it, and it is further on than msrun's
        processes would be, which import MindSpore one after the other (msrun itself, then each
        rank). (The dead are left for the next fill to reap and replace.)"""
        alive = sorted((s for s in self.standbys if s.alive and (s.ready_at or not self.broken)),
                       key=lambda s: not s.ready_at)  # (a broken pool's importing ones may not get there)
        if len(alive) < count:
            return []
        taken = alive[:count]
        for standby in taken:
            standby.taken = True
        self.standbys = [s for s in self.standbys if s not in taken]
        return taken

    async def close(self, spare: ForkServer | None = None) -> None:
        """Stop every standby (and any filling), and the fork server once no standby it forked runs:
        one a generation took dies with it (its death signal), so that waits in the background for
        such a rank to end, as its generation ends it. ``spare``: a server left to run on (its
        ranks' generation was left to its shim: :meth:`WarmPools.leave`)."""
        self._closed = True
        if self._filling is not None:
            self._filling.cancel()
            await asyncio.gather(self._filling, return_exceptions=True)
        standbys, self.standbys = self.standbys, []
        await asyncio.gather(*(s.kill() for s in standbys))
        server, self.server = self.server, None
        if server is None or server is spare:
            return
        if not server.running():
            await server.close()
            return
        self._retire(server)

    def describe(self) -> list[dict[str, Any]]:
        return [dict(pid=s.pid, ready=bool(s.ready_at) and s.alive) for s in self.standbys]


class WarmPools:
    """Every job's :class:`StandbyPool` on this node, by job."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.pools: dict[str, StandbyPool] = {}
        self._retiring: dict[str, asyncio.Task[None]] = {}

    def take(self, job: str, key: str, count: int) -> list[Standby]:
        """Standbys for ``count`` processes of a generation of ``job`` started with launch ``key``,
        when the job's pool has them alive (ready, or still importing: the handover waits for
        those) and was started for the same launch; else none (cold)."""
        pool = self.pools.get(job)
        if pool is None or pool.key != key:
            return []
        return pool.take(count)

    def keep(self, job: str, key: str, count: int, spawn: Spawner, release: Releaser | None = None) -> None:
        """Once a generation trains here: ``count`` standbys for its next relaunch, started one
        after the other (a pool of another launch key is replaced)."""
        pool = self.pools.get(job)
        if pool is not None and pool.key != key:
            task = asyncio.create_task(pool.close(), name=f"standbys-close-{job}")
            _retiring_servers.add(task)  # (held until done: a task nobody holds may be collected)
            task.add_done_callback(_retiring_servers.discard)
            pool = None
        if pool is None:
            pool = self.pools[job] = StandbyPool(job, self.node_id, key, spawn, release)
        pool.fill(count)

    def retire(self, job: str, succeeded: bool, running: Callable[[], bool]) -> None:
        """A generation of ``job`` ended here: its standbys go at once if it succeeded, else after
        STANDBY_KEEP_S unless ``running()`` (another generation of the job runs here by then)."""
        if job not in self.pools:
            return
        pending = self._retiring.pop(job, None)
        if pending is not None:
            pending.cancel()
        delay_s = 0.0 if succeeded else STANDBY_KEEP_S

        async def retire() -> None:
            await asyncio.sleep(delay_s)
            if self._retiring.get(job) is task:
                del self._retiring[job]
            if running():
                return
            pool = self.pools.pop(job, None)
            if pool is not None:
                await pool.close()

        task = self._retiring[job] = asyncio.create_task(retire(), name=f"standbys-retire-{job}")

    def describe(self) -> list[tuple[str, dict[str, Any]]]:
        """(job, standby) for every standby, by job."""
        return [(job, s) for job, pool in sorted(self.pools.items()) for s in pool.describe()]

    async def leave(self, job: str, server: ForkServer) -> None:
        """elasticd restarts and left a generation of ``job`` to its shim whose ranks ``server``
        forked: the job's idle standbys are stopped, the server left to run on (it exits once those
        ranks have, see ForkServer.leave); the next elasticd starts a pool of its own."""
        pending = self._retiring.pop(job, None)
        if pending is not None:
            pending.cancel()
        pool = self.pools.pop(job, None)
        if pool is not None:
            await pool.close(spare=server)
        await server.leave()

    async def close(self) -> None:
        """Stop every standby (elasticd is shutting down)."""
        for task in self._retiring.values():
            task.cancel()
        pools, self.pools = list(self.pools.values()), {}
        await asyncio.gather(*(p.close() for p in pools))
