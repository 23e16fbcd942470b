"""Admission: which slots each job holds, and which a job may be placed on (first come, first
served, in submission order). Pure: a view of the cluster in, numbers out."""

from __future__ import annotations

from mselastic.core.model import NodeRecord, Plan
from mselastic.store.views import ClusterView


def slots_held(cluster: ClusterView, inflight: dict[str, Plan]) -> dict[str, dict[str, int]]:
    """Per job, the slots it holds on each node: the members of its plan while it is not over,
    the nodes where any of its generations still starts, runs or stops (by the reports), and
    the members of a plan being committed right now (``inflight``)."""
    held: dict[str, dict[str, int]] = {}
    for view in cluster.jobs.values():
        mine: dict[str, int] = {}
        per_node = view.spec.workers_per_node if view.spec else 0
        if view.plan is not None and not view.status.state.terminal:
            for m in view.plan.members:
                mine[m.node_id] = m.local_workers
        for reps in view.reports.values():
            for node_id, rep in reps.items():
                if not rep.state.terminal:
                    member = view.plan.member(node_id) if view.plan else None
                    mine[node_id] = max(mine.get(node_id, 0), member.local_workers if member else per_node)
        plan = inflight.get(view.name)
        for m in plan.members if plan else ():
            mine[m.node_id] = max(mine.get(m.node_id, 0), m.local_workers)
        if mine:
            held[view.name] = mine
    return held


def devices_held(cluster: ClusterView, inflight: dict[str, Plan]) -> dict[str, dict[int, str]]:
    """Per node, the device ids jobs hold there, and which job: as :func:`slots_held` counts the
    slots, by the same rules, id by id (a generation still starting, running or stopping holds
    the devices its report names, whatever the newer plans say)."""
    held: dict[str, dict[int, str]] = {}

    def take(node_id: str, ids: tuple[int, ...], job: str) -> None:
        for d in ids:
            held.setdefault(node_id, {})[d] = job

    for view in cluster.jobs.values():
        if view.plan is not None and not view.status.state.terminal:
            for m in view.plan.members:
                take(m.node_id, m.devices, view.name)
        for reps in view.reports.values():
            for node_id, rep in reps.items():
                if not rep.state.terminal:
                    take(node_id, rep.devices, view.name)
        plan = inflight.get(view.name)
        for m in plan.members if plan else ():
            take(m.node_id, m.devices, view.name)
    return held


def hold(held: dict[str, dict[str, int]], job: str, plan: Plan) -> None:
    """``job``'s ``plan`` holds its members' slots from now on (it is being committed)."""
    mine = held.setdefault(job, {})
    for m in plan.members:
        mine[m.node_id] = max(mine.get(m.node_id, 0), m.local_workers)


def free_slots(job: str, nodes: list[NodeRecord], held: dict[str, dict[str, int]], queue_head: str,
               placed: bool, devices: dict[str, dict[int, str]] | None = None) -> tuple[dict[str, int], str]:
    """The slots ``job`` may be placed on, per node, and why the others are not free (for its
    status). A job not placed yet (``placed`` False) behind ``queue_head`` (the first job waiting
    for slots others hold) gets none: first come, first served. On a node with devices (``nodes``
    as a plan may use them: see core.devices.usable) a slot is a device no other job holds
    (``devices``, by id: a job on a device set aside since is not counted twice)."""
    others: dict[str, int] = {}
    holders: dict[str, list[str]] = {}
    for other, per_node in held.items():
        if other == job:
            continue
        for node_id, n in per_node.items():
            others[node_id] = others.get(node_id, 0) + n
            holders.setdefault(node_id, []).append(other)
    free = {n.node_id: max(0, n.slots - others.get(n.node_id, 0)) for n in nodes}
    for node in nodes:
        if node.devices and devices is not None:
            taken = devices.get(node.node_id, {})
            free[node.node_id] = sum(1 for d in node.devices if taken.get(d, job) == job)
    busy = "; ".join(f"node {n.node_id}: {free[n.node_id]} of {n.slots} slot(s) free, the rest held by job(s) "
                     f"{', '.join(sorted(holders[n.node_id]))}" for n in nodes[:5] if n.node_id in holders)
    if queue_head and not placed:
        return {n: 0 for n in free}, f"queued behind job {queue_head} (first come, first served)"
    return free, busy


def settled(inflight: dict[str, Plan], cluster: ClusterView, busy: set[str]) -> dict[str, Plan]:
    """The plans still being committed: one is settled once the view shows it (or shows that it
    cannot be) and its job's task (``busy``) is over; until then its slots stay held, so that no
    pass on a cache that has not seen the commit yet gives them to another job."""
    left = {}
    for job, plan in inflight.items():
        view = cluster.jobs.get(job)
        if job not in busy and (view is None or view.status.state.terminal
                                or (view.plan and view.plan.generation >= plan.generation)):
            continue
        left[job] = plan
    return left
