"""elasticctl output: every command's result as a table, JSON or YAML (``-o``).

JSON and YAML are the protobuf messages as dictionaries (field names as in
``proto/mselastic/v1/elastic.proto``); tables are for people.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Callable

import yaml
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from mselastic.v1 import elastic_pb2 as pb

FORMATS = ("table", "json", "yaml")


def as_dict(msg: Message | dict[str, Any]) -> dict[str, Any]:
    if isinstance(msg, dict):
        return msg
    return _numbers(msg.DESCRIPTOR, json_format.MessageToDict(msg, preserving_proto_field_name=True,
                                                              always_print_fields_with_no_presence=True))


_INT64 = {FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
          FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64}


def _numbers(desc: Descriptor, d: dict[str, Any]) -> dict[str, Any]:
    """proto3's JSON mapping writes 64-bit integers as strings (for JavaScript); ours are numbers:
    the machine interface is read by jq and scripts, and generations and steps fit a double."""
    for f in desc.fields:
        if f.name not in d:
            continue
        if f.type in _INT64:
            d[f.name] = [int(v) for v in d[f.name]] if f.is_repeated else int(d[f.name])
        elif f.type == FieldDescriptor.TYPE_MESSAGE and not f.message_type.GetOptions().map_entry:
            d[f.name] = ([_numbers(f.message_type, v) for v in d[f.name]] if f.is_repeated
                         else _numbers(f.message_type, d[f.name]))
    return d


#: Control characters other than a newline and a tab: in a job's text (a rank's note, its
#: failure, its log) they would drive the operator's terminal (escape sequences, a carriage
#: return that hides what came before).
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
CONTROL_BYTES = re.compile(b"[\x00-\x08\x0b-\x1f\x7f]")


def printable(text: str) -> str:
    """``text`` with its control characters shown as escapes (``\\x1b``), not acted on."""
    return CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def printable_bytes(data: bytes) -> bytes:
    return CONTROL_BYTES.sub(lambda m: b"\\x%02x" % m.group()[0], data)


def emit(out: Any, fmt: str, data: Message | dict[str, Any], table: Callable[[], str]) -> None:
    """JSON and YAML escape what they carry; a table is made printable."""
    if fmt == "json":
        print(json.dumps(as_dict(data), indent=2), file=out)
    elif fmt == "yaml":
        print(yaml.safe_dump(as_dict(data), sort_keys=False).rstrip(), file=out)
    else:
        print(printable(table()), file=out)


def state(v: int) -> str:
    return pb.JobState.Name(v).removeprefix("JOB_STATE_")


def clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 100) % 100:02d}" if t else "-"


def grid(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def node_state(n: pb.NodeInfo) -> str:
    return "Draining" if n.draining else "Cordoned" if n.cordoned else "Ready"


def nodes_table(res: pb.StatusResponse) -> str:
    if not res.nodes:
        return "No nodes registered."
    table = grid(["NODE", "ADDRESS", "SLOTS", "STATUS", "LEADER", "JOBS", "VERSION"],
                 [[n.node_id, n.agent_address, f"{n.used_slots}/{n.slots}", node_state(n), "*" if n.leader else "",
                   ",".join(j + (" (adopted)" if j in n.adopted_jobs else "") for j in n.running_jobs) or "-",
                   n.version] for n in res.nodes])
    devices = [[n.node_id, d.id, n.device_kind, d.job or "-", d.rank if d.job else "-", device_health(d)]
               for n in res.nodes for d in n.devices]
    if devices:
        table += "\n\n" + grid(["NODE", "DEVICE", "KIND", "JOB", "RANK", "HEALTH"], devices)
    return table


def device_health(d: pb.DeviceInfo) -> str:
    """"healthy", or why it is set aside, since and until when (its reason is a job's log line: made
    safe for the terminal)."""
    if not d.unhealthy:
        return "healthy"
    since = time.strftime("%H:%M:%S", time.localtime(d.unhealthy_since))
    until = time.strftime("%H:%M:%S", time.localtime(d.unhealthy_until)) if d.unhealthy_until else "uncordoned"
    return f"unhealthy since {since} until {until}: {printable(d.unhealthy)[:120]}"


def jobs_table(jobs: list[pb.JobStatus]) -> str:
    if not jobs:
        return "No jobs."
    return grid(["JOB", "STATE", "GEN", "WORLD", "STEP", "LOSS", "RESTARTS", "NODES"],
                [[j.job, state(j.state), j.generation, j.world_size, f"{max(j.step, 0)}/{j.total_steps}",
                  f"{j.loss:.4f}" if j.step > 0 else "-", j.restart_count,
                  ",".join(m.node_id for m in j.members) or "-"] for j in jobs])


def job_details(j: pb.JobStatus) -> list[str]:
    lines = []
    if j.message:
        lines.append(f"  message: {printable(j.message)}")
    if j.note:
        lines.append(f"  note: {printable(j.note)}")
    for q in j.quarantined:
        lines.append(f"  quarantined: {q.node_id} ({q.failures} failures), "
                     f"{max(0.0, q.until - time.time()):.0f}s of cooldown left")
    if j.HasField("last_failure"):
        f = j.last_failure
        if f.recover_s:
            rec = f", recovered in {f.recover_s:.2f}s"
        elif state(j.state) in ("RUNNING", "RESTARTING", "PENDING"):
            rec = ", recovery pending"
        else:
            rec = ""  # over: nothing to recover any more
        who = f"rank {f.rank} on {f.node_id}" if f.rank >= 0 else f.node_id
        lines.append(f"  last failure: generation {f.generation}, {who}: {f.reason}; detected {clock(f.detected_at)}"
                     f"{rec}")
    return lines


def status_table(res: pb.StatusResponse) -> str:
    def node(n: pb.NodeInfo) -> str:
        return f"{n.node_id}({n.slots}{', draining' if n.draining else ', cordoned' if n.cordoned else ''})"

    lines = [f"LEADER  {res.leader or '(none)'}", f"NODES   {', '.join(node(n) for n in res.nodes) or '(none)'}"]
    if res.etcd:
        lines.append("ETCD    " + ", ".join(f"{m.version} at {m.endpoint}" + (f" (WARNING: {m.warning})" if m.warning
                                                                                else "") for m in res.etcd))
    if not res.jobs:
        return "\n".join(lines + ["JOBS    (none)"])
    lines.append(jobs_table(list(res.jobs)))
    for j in res.jobs:
        details = job_details(j)
        if details:
            lines += [f"{j.job}:"] + details
    return "\n".join(lines)


def describe_table(res: pb.DescribeResponse, events: list[pb.Event]) -> str:
    j = res.status
    spec = json.loads(res.spec_json) if res.spec_json else {}
    lines = [f"Job:          {j.job}", f"State:        {state(j.state)}",
             f"Generation:   {j.generation} (restarts {j.restart_count})",
             f"World size:   {j.world_size} (nodes {j.min_nodes}..{j.max_nodes}, global batch {j.global_batch_size})",
             f"Step:         {max(j.step, 0)}/{j.total_steps}" + (f", loss {j.loss:.4f}" if j.step > 0 else ""),
             f"Script:       {spec.get('script', '-')} {' '.join(spec.get('args', []))}",
             f"Checkpoints:  {spec.get('checkpoint_dir', '-')} every {spec.get('checkpoint_interval_steps', '-')} "
             f"steps, keep {spec.get('keep_checkpoints', '-')}"]
    lines += job_details(j)
    if j.members:
        lines += ["Members:"] + ["  " + row for row in grid(
            ["NODE", "NODE_RANK", "RANKS", "ADDRESS"],
            [[m.node_id, m.node_rank, _ranks(j, m), m.agent_address] for m in j.members]).splitlines()]
    if res.plans:
        lines += ["Generations:"] + ["  " + row for row in grid(
            ["GEN", "WORLD", "PORT", "PLANNED", "NODES", "REASON"],
            [[p.generation, p.world_size, p.master_port, "yes" if p.planned else "", ",".join(m.node_id for m in p.members),
              p.reason] for p in res.plans]).splitlines()]
    shown = [e for e in events if e.kind not in ("progress", "note")][-10:]
    if shown:
        lines += ["Recent events:"] + ["  " + row for row in events_table(shown).splitlines()]
    return "\n".join(lines)


def _ranks(j: pb.JobStatus, m: pb.Member) -> str:
    first = sum(x.local_workers for x in j.members[: list(j.members).index(m)])
    return f"{first}..{first + m.local_workers - 1}" if m.local_workers > 1 else str(first)


def events_table(events: list[pb.Event]) -> str:
    if not events:
        return "No events."
    rows = []
    for e in events:
        detail = e.message
        if e.detected_at:
            # (the node's clock: not subtracted from the leader's ``at``, which another machine keeps)
            detail += f" [detected {clock(e.detected_at)} on the node]"
        rows.append([clock(e.at), e.generation or "-", e.kind, detail])
    return grid(["TIME", "GEN", "KIND", "WHAT"], rows)


#: MindSpore's own log lines below ERROR ("[WARNING] ME(7756:1400...,MainProcess):2026-...", "[INFO]
#: DISTRIBUTED(...)"): most of a rank's log, and some read like failures that are not ("Topology
#: build timed out., retry(1/360)"). ``elasticctl logs`` leaves them out unless ``--all``.
MINDSPORE_CHATTER = re.compile(rb"^\[(?:WARNING|INFO|DEBUG)\] [A-Z_]+\(\d+[:,]")


class LogLines:
    """A rank's log as it streams in, whole lines only, MindSpore's chatter left out unless
    ``everything``; for a ``terminal``, its control characters shown, not acted on."""

    def __init__(self, everything: bool = False, terminal: bool = False) -> None:
        self.everything, self.terminal, self._rest = everything, terminal, b""

    def feed(self, data: bytes) -> bytes:
        if self.everything:
            return self._shown(data)
        *whole, self._rest = (self._rest + data).split(b"\n")
        return self._shown(b"".join(line + b"\n" for line in whole if not MINDSPORE_CHATTER.match(line)))

    def end(self) -> bytes:
        rest, self._rest = self._rest, b""
        return b"" if self.everything or MINDSPORE_CHATTER.match(rest) else self._shown(rest)

    def _shown(self, data: bytes) -> bytes:
        return printable_bytes(data) if self.terminal else data
