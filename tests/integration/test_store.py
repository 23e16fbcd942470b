"""The store against a real etcd: leases, election, fencing, and elasticd's registration."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

import pytest

from mselastic.core.kinds import EventKind
from mselastic.core.model import Event, JobStatus, MalformedRecord, NodeRecord
from mselastic.core.spec import JobSpec
from mselastic.core.states import JobState
from mselastic.daemon.coordinator import Coordinator, CoordinatorConfig
from mselastic.daemon.statuses import Fenced
from mselastic.store.embedded import EmbeddedEtcd, free_port
from mselastic.store.etcd import Store
from mselastic.store.keys import Keys
from mselastic.store.informer import Informer
from mselastic.store.lease import Election
from mselastic.store.views import ClusterView, JobView, read_cluster
from tests.harness import Etcd, Processes, elasticd_cmd, holds_for, wait_for

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
            await coord_a.write_status(term_a, JobView("job"), status, Event(0, "t", 1, "from a"))
        view = JobView("job")
        assert await coord_b.write_status(term_b, view, status, Event(0, "t", 1, "from b"))
        stored = await b.get(b.keys.status("job"))
        assert stored is not None and JobStatus.from_json(stored.value) == status
        assert view.status_kv is not None and view.status_kv.mod_revision == stored.mod_revision

        # Compare-and-set on the status: a write decided on an older read is refused, not applied.
        stopped = JobStatus(JobState.STOPPED, 1, message="stopped by operator")
        assert await coord_b.write_status(term_b, view, stopped, None)
        stale = JobView("job", status=status, status_kv=stored)
        assert not await coord_b.write_status(term_b, stale, JobStatus(JobState.RUNNING, 2), None)
        again = await b.get(b.keys.status("job"))
        assert again is not None and JobStatus.from_json(again.value) == stopped
        await term_b.lease.release()
        for s in (a, b):
            await s.close()

    asyncio.run(scenario())


def test_a_cordon_written_by_a_deposed_leader_is_refused(etcd_server: EmbeddedEtcd, namespace: str) -> None:
    """#48: cordon and uncordon go through the leader's guard like every shared write (they were a
    bare put after a separate leadership check: check-then-act). A leader deposed after its check
    (its lease gone, another elected) writes no cordon and deletes none; the new leader does."""
    from mselastic.core.model import CordonRecord

    async def scenario() -> None:
        a, b = Store(etcd_server.endpoint, Keys(namespace)), Store(etcd_server.endpoint, Keys(namespace))
        stop = asyncio.Event()
        term_a = await Election(a, "a", TTL).campaign(stop)
        assert term_a is not None
        key = a.keys.cordon("n1")
        record = CordonRecord("n1", False, time.time(), "maintenance").to_json()
        assert await term_a.put(a, key, record)  # (leading: written)
        contender = asyncio.create_task(Election(b, "b", TTL).campaign(stop))
        term_a.lease._task.cancel()  # type: ignore[union-attr]
        await a.revoke(term_a.lease.id)
        term_b = await asyncio.wait_for(contender, TTL + 1)
        assert term_b is not None
        assert not await term_a.delete(a, key)  # deposed: the uncordon is refused ...
        assert (await b.get(key)) is not None
        await b.delete(key)
        assert not await term_a.put(a, key, record)  # ... and so is a cordon
        assert (await b.get(key)) is None
        assert await term_b.put(b, key, record) and (await b.get(key)) is not None
        await term_b.lease.release()
        for s in (a, b):
            await s.close()

    asyncio.run(scenario())


def test_a_restart_request_racing_a_note_written_from_an_older_read_is_kept(etcd_server: EmbeddedEtcd,
                                                                             namespace: str) -> None:
    """The write the Control service makes for `elasticctl restart` and a note the coordinator
    decided before it: the note's compare-and-set fails, the request stays (it used to be
    overwritten by the note's status, built from the older read)."""
    async def scenario() -> None:
        store = Store(etcd_server.endpoint, Keys(namespace))
        stop = asyncio.Event()
        term = await Election(store, "a", TTL).campaign(stop)
        assert term is not None
        coord = Coordinator(store, CoordinatorConfig("a", "x:1", TTL))
        await store.put(store.keys.spec("job"), JobSpec(name="job", script="/s.py", checkpoint_dir="/c").to_json())
        assert await coord.write_status(term, JobView("job"), JobStatus(JobState.RUNNING, 1), None)
        older = (await read_cluster(store)).jobs["job"]  # the pass that will write a note read this
        operator = (await read_cluster(store)).jobs["job"]
        assert await coord.write_status(term, operator, dataclasses.replace(operator.status, restart_requested=1),
                                        Event(0, EventKind.RESTART, 1, "restart requested by operator"))
        note = dataclasses.replace(older.status, note="scale-up pending")
        assert not await coord.write_status(term, older, note, None)
        stored = (await read_cluster(store)).jobs["job"].status
        assert stored.restart_requested == 1 and stored.note == ""
        await term.lease.release()
        await store.close()

    asyncio.run(scenario())


def test_a_compare_and_set_update_writes_only_what_it_read_and_under_its_guard(etcd_server: EmbeddedEtcd,
                                                                             namespace: str) -> None:
    """Store.update, the one read-change-write every fenced write of a single record goes through:
    it writes the change; writes nothing when the record is absent, left as it is, written by
    someone else between the read and the write, or when the guard (a leader's term) fails; a
    malformed record is raised, not overwritten."""
    async def scenario() -> None:
        store = Store(etcd_server.endpoint, Keys(namespace))
        key = store.keys.status("job")
        running = JobStatus(JobState.RUNNING, 1)

        def noted(st: JobStatus) -> JobStatus:
            return dataclasses.replace(st, note="n")

        assert await store.update(key, JobStatus.from_json, noted) is None  # absent
        await store.put(key, running.to_json())
        assert (await store.update(key, JobStatus.from_json, noted)).note == "n"  # type: ignore[union-attr]
        assert await store.update(key, JobStatus.from_json, lambda st: None) is None  # left as it is

        def another_writer_meanwhile(st: JobStatus) -> JobStatus:
            """Between update's read and its write, another client (its own connection) writes the key."""
            async def put() -> None:
                other = Store(etcd_server.endpoint, Keys(namespace))
                await other.put(key, dataclasses.replace(running, note="other").to_json())
                await other.close()

            writer = threading.Thread(target=lambda: asyncio.run(put()))
            writer.start()
            writer.join(30)
            return dataclasses.replace(st, note="late")

        assert await store.update(key, JobStatus.from_json, another_writer_meanwhile) is None
        assert JobStatus.from_json((await store.get(key)).value).note == "other"  # type: ignore[union-attr]
        stop = asyncio.Event()
        term = await Election(store, "a", TTL).campaign(stop)
        assert term is not None
        guard = [term.guard(store)]
        assert (await store.update(key, JobStatus.from_json, noted, guard)) is not None
        await term.lease.release()  # deposed: its guard fails, nothing is written
        assert await store.update(key, JobStatus.from_json, lambda st: dataclasses.replace(st, note="deposed"),
                                  guard) is None
        assert JobStatus.from_json((await store.get(key)).value).note == "n"  # type: ignore[union-attr]
        await store.put(key, "{not json")
        with pytest.raises(MalformedRecord):
            await store.update(key, JobStatus.from_json, noted)
        assert (await store.get(key)).value == b"{not json"  # type: ignore[union-attr]
        await store.close()

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


def test_a_second_elasticd_with_a_taken_node_id_refuses_and_leaves_the_first_alone(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str]) -> None:
    tmp, port = str(tmp_path), free_port()
    procs.start("elasticd-n0", elasticd_cmd("n0", etcd.endpoint, port, os.path.join(tmp, "a"), namespace,
                                            lease_ttl_s=TTL))
    wait_for("n0 registered and leading", lambda: etcd.get(etcd.keys.node("n0")) and etcd.leader() == "n0", 20)

    def registration() -> tuple[bytes, int] | None:
        async def fn(s: Store) -> tuple[bytes, int] | None:
            kv = await s.get(etcd.keys.node("n0"))
            return (kv.value, kv.lease) if kv else None
        return etcd._run(fn)  # type: ignore[no-any-return]
    before = registration()
    dup = procs.start("elasticd-dup", elasticd_cmd("n0", etcd.endpoint, free_port(), os.path.join(tmp, "b"),
                                                   namespace, lease_ttl_s=TTL))
    assert dup.wait(timeout=30) == 2
    with open(os.path.join(procs.log_dir, "elasticd-dup.log")) as f:
        out = f.read()
    assert f"elasticd: node id n0 is already registered by a running elasticd at 127.0.0.1:{port}" in out, out
    assert "Traceback" not in out and "registered; ready" not in out, out
    # The first one keeps its registration (same lease, renewed) and the lead.
    holds_for("n0's registration untouched", lambda: registration() == before and etcd.leader() == "n0", 2 * TTL)
    assert procs.started[0].poll() is None


def test_a_second_elasticd_on_the_same_work_dir_refuses_in_one_line(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str]) -> None:
    """#45: a successor adopts what an earlier elasticd of its work_dir left (its generations, its
    lease), so two at once on one work_dir must not be: the second refuses, exit 2, and the first
    keeps its registration."""
    work = os.path.join(str(tmp_path), "a")
    procs.start("elasticd-n0", elasticd_cmd("n0", etcd.endpoint, free_port(), work, namespace, lease_ttl_s=TTL))
    wait_for("n0 registered", lambda: etcd.get(etcd.keys.node("n0")), 20)
    dup = procs.start("elasticd-dup", elasticd_cmd("n1", etcd.endpoint, free_port(), work, namespace, lease_ttl_s=TTL))
    assert dup.wait(timeout=30) == 2
    with open(os.path.join(procs.log_dir, "elasticd-dup.log")) as f:
        lines = [line for line in f.read().splitlines() if line.startswith("elasticd: ")]
    assert lines == [f"elasticd: work_dir: {work} is in use by another elasticd on this machine; give this one another "
                     f"work_dir (or stop that one first)"], lines
    assert procs.started[0].poll() is None and etcd.get(etcd.keys.node("n1")) is None


def test_a_node_whose_registration_vanished_registers_again(procs: Processes, etcd: Etcd, namespace: str,
                                                            tmp_path: os.PathLike[str]) -> None:
    procs.start("elasticd-n0", elasticd_cmd("n0", etcd.endpoint, free_port(), str(tmp_path), namespace,
                                            lease_ttl_s=TTL))
    wait_for("n0 registered", lambda: etcd.get(etcd.keys.node("n0")), 20)
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "etcdctl"), f"--endpoints={etcd.endpoint}", "del",
                    etcd.keys.node("n0")], check=True, capture_output=True, timeout=20)
    assert etcd.get(etcd.keys.node("n0")) is None
    wait_for("n0 registered again", lambda: etcd.get(etcd.keys.node("n0")), 2 * TTL + 2, 0.1)
    with open(os.path.join(procs.log_dir, "elasticd-n0.log")) as f:
        assert "had disappeared; registered again" in f.read()


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


def test_informer_lists_follows_the_watch_and_lists_again_when_it_breaks(tmp_path: os.PathLike[str]) -> None:
    """The coordinator's cache against a real etcd: what a pass would read, without reading etcd."""
    server = EmbeddedEtcd(os.path.join(str(tmp_path), "etcd")).start()

    async def scenario() -> None:
        store = Store(server.endpoint, Keys("/inf"))
        k = store.keys
        spec = JobSpec(name="j", script="/s.py", checkpoint_dir="/c")
        node = NodeRecord(node_id="n0", agent_address="a:1", host="h", slots=2, version="t")
        await store.put(k.node("n0"), node.to_json())
        await store.put(k.spec("j"), spec.to_json())
        await store.put(k.status("j"), JobStatus(JobState.PENDING).to_json())
        changed = asyncio.Event()
        informer = Informer(store, on_change=changed.set)
        stop = asyncio.Event()
        task = asyncio.create_task(informer.run(stop))
        await asyncio.wait_for(informer.synced.wait(), 10)
        view = informer.view()
        assert [n.node_id for n in view.nodes] == ["n0"] and view.jobs["j"].status.state is JobState.PENDING

        async def until(what: str, check: Callable[[ClusterView], bool]) -> ClusterView:
            for _ in range(100):
                v = informer.view()
                if check(v):
                    return v
                changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), 0.1)
            raise AssertionError(f"the cache never showed {what}")

        await store.put(k.status("j"), JobStatus(JobState.STOPPED, message="x").to_json())
        kv = await store.get(k.status("j"))
        v = await until("the new status", lambda v: v.jobs["j"].status.state is JobState.STOPPED)
        assert v.jobs["j"].status_kv is not None and kv is not None
        assert v.jobs["j"].status_kv.mod_revision == kv.mod_revision  # what a compare-and-set needs
        await store.delete(k.node("n0"))
        await until("the node gone", lambda v: not v.nodes)
        await store.put(k.event("j", 1), "{}")  # not cached: events are not a pass's business
        assert informer.lists == 1

        server.stop()  # the watch breaks; once etcd is back the cache is listed again
        server.start()
        await store.put(k.node("n1"), dataclasses.replace(node, node_id="n1").to_json())
        await until("the node registered after the restart", lambda v: [n.node_id for n in v.nodes] == ["n1"])
        assert informer.lists >= 2
        stop.set()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.close()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_etcd_over_tls_with_authentication_end_to_end_and_a_plaintext_client_refused(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str]) -> None:
    """A real etcd serving TLS only (--client-cert-auth) with auth enabled: elasticd reaches it
    with a client certificate whose CN is its etcd user (etcd_cacert, etcd_cert, etcd_key), leads,
    and a job submitted through it is written; a plaintext client, and a certificate of a user etcd
    does not know, are refused. Prints what TLS costs a read against the plaintext etcd."""
    from mselastic.store.etcd import EtcdAuth, PermanentError, RetryPolicy, TemporaryError
    from mselastic.tls import issue, make_ca
    from tests.harness import VENV_BIN, elasticctl, lenet_spec, local_socket

    tmp = str(tmp_path)
    pki = os.path.join(tmp, "pki")
    ca, _ = make_ca(pki)
    for name, role in (("etcd", "node"), ("root", "admin"), ("mselastic", "node"), ("stranger", "node")):
        issue(pki, name, role, ("127.0.0.1",))

    def files(name: str) -> EtcdAuth:
        return EtcdAuth(ca, os.path.join(pki, f"{name}.pem"), os.path.join(pki, f"{name}-key.pem"))

    server = EmbeddedEtcd(os.path.join(tmp, "etcd"), tls=(files("etcd").cert, files("etcd").key, ca)).start()
    try:
        root = files("root")
        etcdctl = [os.path.join(VENV_BIN, "etcdctl"), f"--endpoints=https://{server.endpoint}", "--cacert", ca,
                   "--cert", root.cert, "--key", root.key]
        for args in (["user", "add", "root", "--no-password"], ["user", "add", "mselastic", "--no-password"],
                     ["role", "add", "mselastic"],
                     ["role", "grant-permission", "mselastic", "readwrite", namespace + "/", "--prefix=true"],
                     ["user", "grant-role", "mselastic", "mselastic"], ["auth", "enable"]):
            r = subprocess.run(etcdctl + args, capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, (args, r.stderr)

        async def read(auth: EtcdAuth, endpoint: str = server.endpoint, n: int = 1) -> float:
            store = Store(endpoint, Keys(namespace), retry=RetryPolicy(attempts=1, budget_s=3.0), auth=auth)
            try:
                started = time.perf_counter()
                for _ in range(n):
                    await store.get(store.keys.leader)
                return (time.perf_counter() - started) / n
            finally:
                await store.close()

        with pytest.raises(TemporaryError):
            asyncio.run(read(EtcdAuth()))  # plaintext against TLS: no connection
        with pytest.raises(PermanentError, match="(?i)permission denied|user name not found|invalid"):
            asyncio.run(read(files("stranger")))  # signed by the CA, but no such etcd user
        port, work = free_port(), os.path.join(tmp, "work")
        me = files("mselastic")
        procs.start("elasticd-n0", elasticd_cmd("n0", server.endpoint, port, work, namespace, slots=0)
                    + ["--etcd-cacert", ca, "--etcd-cert", me.cert, "--etcd-key", me.key])

        async def get(key: str) -> bytes | None:
            store = Store(server.endpoint, Keys(namespace), auth=me)
            try:
                kv = await store.get(key)
                return kv.value if kv else None
            finally:
                await store.close()

        keys = Keys(namespace)
        wait_for("n0 leading over TLS", lambda: asyncio.run(get(keys.leader)), 30, 0.3)
        spec = lenet_spec(os.path.join(tmp, "job.toml"), "lenet", tmp, os.path.join(tmp, "ckpt"), 5)
        r = elasticctl("submit", spec, endpoint="unix:" + local_socket(work))
        assert r.returncode == 0, r.stderr
        status = asyncio.run(get(keys.status("lenet")))
        assert status is not None and JobStatus.from_json(status).state is JobState.PENDING  # no slots: it waits
        plain_s, tls_s = asyncio.run(read(EtcdAuth(), etcd.endpoint, 200)), asyncio.run(read(me, n=200))
        print(f"etcd read: plaintext {plain_s * 1e3:.2f} ms, TLS + client certificate + auth {tls_s * 1e3:.2f} ms "
              f"({tls_s / plain_s:.2f}x)")
    finally:
        procs.stop_all()
        server.stop()
