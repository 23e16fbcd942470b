"""The leader's writes of job statuses: each a compare-and-set on the revision the pass read and on
the leader key (a status an operator changed meanwhile is never overwritten; a deposed leader writes
nothing), and the times a status holds, read on this leader's clock."""

from __future__ import annotations

import dataclasses
import logging
import time

from mselastic.core.kinds import EventKind
from mselastic.core.model import Event, FailureRecord, JobStatus, Plan
from mselastic.core.planner import MAX_QUARANTINE_S, Decision
from mselastic.core.states import JobState
from mselastic.core.status import next_status
from mselastic.store.etcd import Store
from mselastic.store.lease import Term
from mselastic.store.views import JobView

log = logging.getLogger(__name__)


class Fenced(Exception):
    """This process no longer holds the leader key; it must stop acting as leader."""


class Statuses:
    """Job status writes for one leader, and the times it wrote in them (its clock's) this term."""

    def __init__(self, store: Store) -> None:
        self.store = store
        #: One clock per decision (see :meth:`on_my_clock`): the times this leader wrote in statuses
        #: during its term (another writer's: JobMemo.anchors).
        self._mine: set[float] = set()

    def new_term(self) -> None:
        self._mine.clear()

    def on_my_clock(self, view: JobView, now: float, anchors: dict[tuple[str, float], float]) -> JobView:
        """The job with the times its status holds on this leader's clock.

        ``waiting_since`` (min_nodes_timeout_s), ``scale_up_since`` (scale_up_settle_s) and the
        quarantine deadlines are wall-clock times written by a leader; another leader (after a
        failover, on another machine) would compare them with its own clock, and a skew between the
        two would shorten or lengthen the wait. So a time this leader did not write in its term is
        taken to start when it first sees it (``anchors``: a wait restarts, a quarantine lasts its
        whole cooldown again: at most one more wait, never a shorter one), and is written back on
        its clock with the next status write."""
        st = view.status

        def since(what: str, stamp: float) -> float:
            if not stamp or stamp in self._mine:
                return stamp
            return anchors.setdefault((what, stamp), now)

        def until(node_id: str, stamp: float) -> float:
            # Over by this clock: over (a skew can end it early by the skew, never bring it back).
            if stamp in self._mine or view.spec is None or stamp <= now:
                return stamp
            over = st.node_failures.get(node_id, 0) - view.spec.quarantine_after_failures
            cooldown = min(MAX_QUARANTINE_S, view.spec.quarantine_cooldown_s * 2 ** max(0, over))
            return anchors.setdefault((f"quarantine:{node_id}", stamp), now + cooldown)

        waiting, scale_up = since("waiting", st.waiting_since), since("scale_up", st.scale_up_since)
        quarantine = {n: until(n, t) for n, t in st.quarantined_until.items()}
        if (waiting, scale_up, quarantine) == (st.waiting_since, st.scale_up_since, st.quarantined_until):
            return view
        return dataclasses.replace(view, status=dataclasses.replace(st, waiting_since=waiting, scale_up_since=scale_up,
                                                                    quarantined_until=quarantine))

    def wrote(self, status: JobStatus) -> None:
        """Remember the times of a status this leader composed (they are on its clock)."""
        self._mine.update(t for t in (status.waiting_since, status.scale_up_since, *status.quarantined_until.values())
                          if t)

    @staticmethod
    def compose(view: JobView, state: JobState, message: str, failure: FailureRecord | None,
                plan: Plan | None = None, waiting_since: float = 0.0, decision: Decision | None = None) -> JobStatus:
        """The next status of the job as ``view`` read it (see :func:`mselastic.core.status.next_status`)."""
        return next_status(view.status, state, message, time.time(), plan=plan or view.plan, failure=failure,
                           waiting_since=waiting_since, decision=decision)

    async def set(self, term: Term, view: JobView, state: JobState, message: str,
                  failure: FailureRecord | None = None, event: Event | None = None,
                  waiting_since: float = 0.0, decision: Decision | None = None) -> bool:
        """Write the job's next status (compare-and-set); False when it changed meanwhile."""
        failure = failure if failure is not None else view.status.last_failure
        status = self.compose(view, state, message, failure, waiting_since=waiting_since, decision=decision)
        ev = event or Event(at=time.time(), kind=EventKind(state.value.lower()),
                            generation=view.plan.generation if view.plan else 0, message=message)
        if not await self.write(term, view, status, ev):
            return False
        log.info("job %s: %s", state.value, message, extra=dict(job=view.name, generation=status.generation))
        return True

    def unchanged(self, view: JobView) -> object:
        """The compare of a compare-and-set on the job's status as ``view`` read it."""
        key = self.store.keys.status(view.name).encode()
        return self.store.tx.mod(key) == (view.status_kv.mod_revision if view.status_kv else 0)

    async def write(self, term: Term, view: JobView, status: JobStatus, event: Event | None) -> bool:
        """Compare-and-set the job's status on the revision ``view`` read (and the leader key).

        True: written, and ``view`` now holds it (so that a pass's further writes chain). False:
        the status changed meanwhile (an operator's stop or restart, for instance); nothing is
        written and the next pass decides again. Raises Fenced when the leader key is not ours."""
        k, tx = self.store.keys, self.store.tx
        self.wrote(status)
        kv = await self.store.txn_get(
            [term.guard(self.store), self.unchanged(view)],
            [tx.put(k.status(view.name).encode(), status.to_json().encode()),
             *([tx.put(k.event(view.name, time.time_ns()).encode(), event.to_json().encode())] if event else [])],
            k.status(view.name))
        if kv is None:
            await self.check_leader(term)
            log.info("status changed meanwhile; the next pass decides again", extra=dict(job=view.name))
            return False
        view.status, view.status_kv = status, kv
        return True

    async def check_leader(self, term: Term) -> None:
        """Raises Fenced when the leader key is no longer this term's."""
        kv = await self.store.get(self.store.keys.leader)
        if kv is None or kv.create_revision != term.create_revision:
            raise Fenced()
