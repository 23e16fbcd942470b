"""Devices as the slots (issue #32): a node's accelerators by id, and which member of a plan uses
which. Pure: ids in, ids out.

On a node with accelerators a slot is a device: the node registers its device kind and ids, and
the leader gives each member of a plan the ids its ranks use, never one another job holds on
that node, and the same ones again at a relaunch where they are still free (warm standbys,
started with the visible-devices variable, and the devices' caches stay valid). The agent
launches with that variable (``CUDA_VISIBLE_DEVICES``, ``ASCEND_RT_VISIBLE_DEVICES``), which
renumbers the listed devices from 0: msrun's ``DEVICE_ID`` (the local rank, 0..n-1) then lands on
the assigned device. A node without devices (CPU) keeps ``slots`` as a number.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

from mselastic.core.model import DeviceCordon, NodeRecord, Plan

#: The device kinds, and the variable that says which devices a process of that kind may see.
VISIBLE = {"gpu": "CUDA_VISIBLE_DEVICES", "ascend": "ASCEND_RT_VISIBLE_DEVICES"}
KINDS = tuple(VISIBLE)
#: The most devices one node may list (ids beyond are a typo).
MAX_DEVICES = 1024


def parse_ids(text: str) -> tuple[int, ...]:
    """``"0-7"``, ``"0,2,5"``, ``"0-3,6"`` → the ids, sorted; ValueError (saying what is wrong)
    for anything else, a repeated id, or more than :data:`MAX_DEVICES`."""
    ids: list[int] = []
    for part in text.replace(" ", "").split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise ValueError(f"{part!r} is not a device id or a range of them (\"0-7\", \"0,2,5\")")
        first, last = int(m.group(1)), int(m.group(2) or m.group(1))
        if last < first:
            raise ValueError(f"{part!r}: the range ends before it starts")
        if last - first + 1 + len(ids) > MAX_DEVICES:
            raise ValueError(f"more than {MAX_DEVICES} devices")
        ids.extend(range(first, last + 1))
    if len(set(ids)) != len(ids):
        raise ValueError(f"{text!r} names a device twice")
    return tuple(sorted(ids))


def format_ids(ids: tuple[int, ...] | list[int]) -> str:
    """The ids as :func:`parse_ids` reads them, ranges folded: (0, 1, 2, 3, 6) → "0-3,6"."""
    parts: list[str] = []
    run: list[int] = []
    for i in sorted(ids):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


def nvidia_smi_ids(listing: str) -> tuple[int, ...]:
    """The GPU indexes of ``nvidia-smi -L``'s output ("GPU 0: NVIDIA H200 (UUID: GPU-...)")."""
    return tuple(sorted(int(m.group(1)) for m in re.finditer(r"^GPU (\d+):", listing, re.MULTILINE)))


def davinci_ids(names: list[str]) -> tuple[int, ...]:
    """The NPU ids of the ``/dev`` entries named ``davinci<N>`` (``davinci_manager`` is not one)."""
    return tuple(sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"davinci(\d+)", n))))


#: Lines in a rank's log that blame its device, not the job's code (the vendors' words): NVIDIA's
#: uncorrectable ECC errors, a GPU fallen off the bus, an Xid the driver reports; Ascend's
#: uncorrectable errors (UCE) and HBM ECC faults, a device heartbeat lost.
DEVICE_ERRORS = re.compile(
    r"uncorrectable ECC error|CUDA_ERROR_ECC_UNCORRECTABLE|GPU is lost|fallen off the bus|"
    r"\bNVRM: Xid \(PCI:|(?-i:\bUCE error\b)|HBM (?:multi-bit )?ECC error|device heartbeat lost",
    re.IGNORECASE)
#: How much of a failed rank's log is looked at (its end).
LOG_TAIL_BYTES = 64 << 10


def device_error(log_tail: str) -> str:
    """The last line of a failed rank's log that blames its device ("" none), cut to 300 characters."""
    found = [line.strip() for line in log_tail.splitlines() if DEVICE_ERRORS.search(line)]
    return found[-1][:300] if found else ""


def usable(nodes: list[NodeRecord], cordons: Mapping[str, list[DeviceCordon]], now: float) -> list[NodeRecord]:
    """The nodes as a plan may use them: on a node with devices, those set aside (``cordons``, by
    node, held at ``now``) left out, and its slots their number."""
    out = []
    for n in nodes:
        aside = {c.device for c in cordons.get(n.node_id, ()) if c.held(now)}
        if n.devices and aside & set(n.devices):
            kept = tuple(d for d in n.devices if d not in aside)
            n = dataclasses.replace(n, devices=kept, slots=len(kept))
        out.append(n)
    return out


def states(nodes: list[NodeRecord], held: Mapping[str, Mapping[int, str]],
           cordons: Mapping[str, list[DeviceCordon]], now: float) -> dict[str, dict[str, int]]:
    """Per node with devices, how many are in use (``held``), free, and set aside (``cordons``)."""
    out = {}
    for n in nodes:
        if not n.devices:
            continue
        aside = {c.device for c in cordons.get(n.node_id, ()) if c.held(now)} & set(n.devices)
        used = set(held.get(n.node_id, {})) & set(n.devices) - aside
        out[n.node_id] = {"in_use": len(used), "unhealthy": len(aside), "free": len(n.devices) - len(used) - len(aside)}
    return out


#: What else a process of a kind needs for the ids to be the node's tools' own: CUDA numbers
#: devices fastest first unless told otherwise, nvidia-smi and NVML by PCI bus.
ORDER = {"gpu": {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}}


def visible_env(kind: str, ids: tuple[int, ...]) -> dict[str, str]:
    """The variables that show a process of ``kind`` only ``ids`` (renumbered from 0); {} without."""
    if kind not in VISIBLE or not ids:
        return {}
    return {VISIBLE[kind]: ",".join(map(str, ids)), **ORDER.get(kind, {})}


def hold(held: dict[str, dict[int, str]], job: str, plan: Plan) -> None:
    """``job``'s ``plan`` holds its members' devices from now on (it is being committed)."""
    for m in plan.members:
        for d in m.devices:
            held.setdefault(m.node_id, {})[d] = job


class NoDevices(ValueError):
    """A member's node has fewer free devices than its ranks (the slot accounting should have
    kept it from being planned there)."""


def assign(plan: Plan, nodes: Mapping[str, NodeRecord], held: Mapping[str, Mapping[int, str]],
           previous: Plan | None = None) -> Plan:
    """``plan`` with each member's ``devices``: on a node with devices, ``local_workers`` ids of
    it that no other job holds (``held``), those its member of ``previous`` used first (in their
    order: rank i keeps its device), then others the job holds there (a generation still stopping),
    then the lowest free ones. A member on a node without devices gets none. Raises
    :class:`NoDevices` when a node has too few free."""
    members = []
    for m in plan.members:
        node = nodes.get(m.node_id)
        if node is None or not node.devices:
            members.append(dataclasses.replace(m, devices=(), device_kind=""))
            continue
        taken = held.get(m.node_id, {})
        free = [d for d in node.devices if taken.get(d, plan.job) == plan.job]
        before = previous.member(m.node_id) if previous is not None else None
        kept = [d for d in (before.devices if before else ()) if d in free][:m.local_workers]
        kept += [d for d in free if taken.get(d) == plan.job and d not in kept][:m.local_workers - len(kept)]
        chosen = kept + [d for d in free if d not in kept][:m.local_workers - len(kept)]
        if len(chosen) < m.local_workers:
            busy = sorted({j for d, j in taken.items() if j != plan.job})
            raise NoDevices(f"node {m.node_id} has {len(free)} free device(s) of {len(node.devices)} for "
                            f"{m.local_workers} rank(s) of job {plan.job} (held by: {', '.join(busy) or 'none'})")
        members.append(dataclasses.replace(m, devices=tuple(chosen), device_kind=node.device_kind))
    return dataclasses.replace(plan, members=tuple(members))
