"""What runs here is kept in step with the plans committed in etcd: reports a previous elasticd
left open are closed before registering, generations kept over a lease that expired with etcd go
on only while still committed, and a generation a newer plan replaced is stopped even when the
leader's Stop cannot reach this node."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Awaitable, Collection, Protocol

from mselastic.agent.generation.supervisor import Generation
from mselastic.core.model import AGENT_RESTARTED, GenerationReport, JobStatus, MalformedRecord, Plan
from mselastic.core.spec import JobSpec
from mselastic.core.states import FailureCause, GenerationState, JobState
from mselastic.store.etcd import Store

log = logging.getLogger(__name__)

class StopGen(Protocol):
    """Stops a job's generation here (NodeAgent.stop): the pids left. ``final``: the job ended."""

    def __call__(self, job: str, generation: int, grace_s: float, stop_at: int = 0, reason: str = "",
                 final: bool = False) -> Awaitable[list[int]]: ...


async def close_stale_reports(store: Store, node_id: str, stop: asyncio.Event,
                              keep: Collection[tuple[str, int]] = ()) -> None:
    """Close what a previous elasticd of this node left open in etcd, before registering, but
    the generations this one adopted (``keep``: job, generation; see agent.generation.adopt).

    A starting elasticd runs nothing else: the workers of the one before it died with it, or
    were killed as not adoptable.
    Its reports that still say starting or running would show the node busy for ever
    (``elasticctl drain`` would wait for ever), and when it came back within a lease TTL
    the current generation would only be relaunched once the other ranks' hang timeout
    fired: they are rewritten as FAILED (a lost node), unless changed meanwhile.
    """
    def closed(rep: GenerationReport) -> GenerationReport | None:
        now = time.time()
        return None if rep.state.terminal else dataclasses.replace(
            rep, state=GenerationState.FAILED, reason=AGENT_RESTARTED, cause=FailureCause.AGENT_RESTARTED,
            detected_at=now, stopped_at=now)

    k = store.keys
    async for attempt in store.retry.reconnecting(stop):
        with attempt:
            for key in await store.keys_under(k.all_reports):
                parsed = k.parse_report_key(key)
                if parsed is None or parsed[2] != node_id or (parsed[0], parsed[1]) in keep:
                    continue
                try:
                    rep = await store.update(key, GenerationReport.from_json, closed)
                except MalformedRecord:
                    continue
                if rep is not None:
                    log.warning("closed the report of generation %d left open by the previous elasticd",
                                rep.generation, extra=dict(node=node_id, job=rep.job, generation=rep.generation))


async def keep_committed(store: Store, node_id: str, generations: dict[str, Generation], stop_gen: StopGen,
                         stop: asyncio.Event) -> None:
    """After the lease expired with workers running, or generations adopted: stop every generation
    that is no longer the plan committed for a live job (the coordinator relaunched without this
    node meanwhile: at once, or at the step a planned change names; the job ended: with its grace,
    the ranks checkpoint first); the others go on, and the coordinator adopts them."""
    k = store.keys
    async for attempt in store.retry.reconnecting(stop):
        with attempt:
            for job, gen in list(generations.items()):
                if gen.done.is_set():
                    continue
                plan_kv, status_kv = await store.get(k.plan(job)), await store.get(k.status(job))
                why, grace, at, ended = "", 0.0, 0, False
                try:
                    plan = Plan.from_json(plan_kv.value) if plan_kv is not None else None
                    if plan is None or plan != gen.plan:
                        why = "a newer generation was committed meanwhile"
                        if plan is not None and plan.planned and plan.generation == gen.plan.generation + 1:
                            # (a planned change: the ranks stop at the step the new plan names)
                            grace, at = gen.spec.stop_grace_period_s, plan.stop_previous_at_step
                    elif status_kv is not None and (st := JobStatus.from_json(status_kv.value).state) is not \
                            JobState.RUNNING:
                        # (stopped meanwhile, its Stop lost: the ranks checkpoint first, as it would
                        # have; restarting: a rank failed elsewhere, the collective is broken)
                        why, ended = f"the job is {st.value} meanwhile", st.terminal
                        grace = gen.spec.stop_grace_period_s if ended else 0.0
                except MalformedRecord as e:
                    why = f"its record is unreadable ({e})"
                ctx = dict(node=node_id, job=job, generation=gen.plan.generation)
                if why:
                    log.warning("stopping generation %d: %s", gen.plan.generation, why, extra=ctx)
                    # (Shielded: the check is cancelled when the lease is lost or elasticd stops; a
                    # graceful stop cut short would leave the generation stopping, unwatched.)
                    await asyncio.shield(stop_gen(job, gen.plan.generation, grace, at, final=ended))
                else:
                    log.info("generation %d is still the committed plan: it goes on", gen.plan.generation,
                             extra=ctx)


async def stop_superseded(store: Store, node_id: str, generations: dict[str, Generation], stop_gen: StopGen,
                          seen: set[tuple[str, int]]) -> set[tuple[str, int]]:
    """Stop each generation running here that a newer committed plan replaced, and that nobody
    stopped, as the leader's Stop would have (a planned change: at the step the plan names, with
    the job's grace period; else at once), once it was seen so on the check before too (``seen``:
    the leader's own push is on its way). Returns the generations seen replaced now."""
    k, now_seen = store.keys, set()
    for job, gen in list(generations.items()):
        if gen.done.is_set() or gen.stopping:
            continue
        kv = await store.get(k.plan(job))
        committed = Plan.from_json(kv.value) if kv is not None else None
        if committed is not None and committed.generation <= gen.plan.generation:
            continue
        key = (job, gen.plan.generation)
        now_seen.add(key)
        if key not in seen or gen.done.is_set() or gen.stopping:
            continue
        planned = committed is not None and committed.planned and committed.generation == gen.plan.generation + 1
        spec_kv = await store.get(k.spec(job)) if planned else None
        grace = JobSpec.from_json(spec_kv.value).stop_grace_period_s if spec_kv is not None else 0.0
        log.warning("generation %d was replaced (%s) and nobody stopped it here (the leader cannot reach this "
                    "node?): stopping it%s", gen.plan.generation,
                    f"by generation {committed.generation}" if committed else "the job is gone",
                    f" at step {committed.stop_previous_at_step}" if planned and committed else "",
                    extra=dict(node=node_id, job=job, generation=gen.plan.generation))
        await stop_gen(job, gen.plan.generation, grace, committed.stop_previous_at_step if planned and committed
                        else 0)
    return now_seen
