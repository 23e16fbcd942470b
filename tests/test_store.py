"""The store against a real etcd: leases, election, fencing, and elasticd's registration."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from mselastic.core.model import Event, JobStatus
from mselastic.core.states import JobState
from mselastic.daemon.coordinator import Coordinator, CoordinatorConfig, Fenced
from mselastic.store.embedded import EmbeddedEtcd, free_port
from mselastic.store.etcd import Store
from mselastic.store.keys import Keys
from mselastic.store.lease import Election
from tests.harness import Etcd, Processes, elasticd_cmd, wait_for

TTL = 3


def test_exactly_one_leader_and_a_deposed_leader_cannot_commit(etcd_server: EmbeddedEtcd, namespace: str) -> None:
    async def scenario() -> None:
        a, b = Store(etcd_server.endpoint, Keys(namespace)), Store(etcd_server.endpoint, Keys(namespace))
        stop = asyncio.Event()
        term_a = await Election(a, "a", TTL).campaign(stop)
        assert term_a is not None
        contender = asyncio.create_task(Election(b, "b", TTL).campaign(stop))
        await asyncio.sleep(1.0)
        assert not contender.done(), "a second leader was elected while the first held the lease"

        # a's lease is gone as far as etcd is concerned (as after a long pause or partition) ...
        term_a.lease._task.cancel()  # type: ignore[union-attr]
        await a.revoke(term_a.lease.id)
        term_b = await asyncio.wait_for(contender, TTL + 1)
        assert term_b is not None and term_b.create_revision != term_a.create_revision

        # ... so a, still believing it leads, is fenced: its write is rejected, b's is accepted.
        coord_a = Coordinator(a, CoordinatorConfig("a", "x:1", TTL))
        coord_b = Coordinator(b, CoordinatorConfig("b", "x:2", TTL))
        status = JobStatus(JobState.RUNNING, 1)
        with pytest.raises(Fenced):
            await coord_a.write_status(term_a, "job", status, Event(0, "t", 1, "from a"))
        await coord_b.write_status(term_b, "job", status, Event(0, "t", 1, "from b"))
        stored = await b.get(b.keys.status("job"))
        assert stored is not None and JobStatus.from_json(stored.value) == status
        await term_b.lease.release()
        for s in (a, b):
            await s.close()

    asyncio.run(scenario())


def test_registration_disappears_within_ttl_after_sigkill(procs: Processes, etcd: Etcd, namespace: str,
                                                         tmp_path: os.PathLike[str]) -> None:
    d = procs.start("elasticd-n0", elasticd_cmd("n0", etcd.endpoint, free_port(), str(tmp_path), namespace,
                                                lease_ttl_s=TTL))
    wait_for("n0 registered", lambda: etcd.get(etcd.keys.node("n0")), 20)
    os.kill(d.pid, signal.SIGKILL)
    killed = time.monotonic()
    d.wait()
    wait_for("n0's key to expire", lambda: etcd.get(etcd.keys.node("n0")) is None, TTL + 1, poll_s=0.05)
    assert time.monotonic() - killed <= TTL + 1


def test_two_daemons_one_leader_and_failover(procs: Processes, etcd: Etcd, namespace: str,
                                             tmp_path: os.PathLike[str]) -> None:
    daemons = {n: procs.start(f"elasticd-{n}", elasticd_cmd(n, etcd.endpoint, free_port(),
                                                             os.path.join(str(tmp_path), n), namespace,
                                                             lease_ttl_s=TTL)) for n in ("n0", "n1")}
    wait_for("both registered", lambda: len(etcd.prefix(etcd.keys.nodes)) == 2, 20)
    first = wait_for("a leader", etcd.leader, 20)
    # Exactly one leads: the other stays a candidate for a while.
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        assert etcd.leader() == first
        time.sleep(0.2)
    os.kill(daemons[first].pid, signal.SIGKILL)
    killed = time.monotonic()
    other = "n1" if first == "n0" else "n0"
    wait_for(f"{other} to lead", lambda: etcd.leader() == other, TTL + 1, poll_s=0.05)
    assert time.monotonic() - killed <= TTL + 1
