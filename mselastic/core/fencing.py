"""The fencing rule, both sides of it: when a node may keep its workers without etcd, and when a
leader may replace a member it cannot hear from. Pure functions of what was observed.

The invariant they keep together: *at no moment do two generations of a job both have live
workers.* A generation is replaced only by a leader, through etcd; so the danger is a member the
leader cannot hear from that keeps training while the leader relaunches without it.

What each side assumes: no synchronised clocks. Every time here is a duration measured on one
process's own monotonic clock (:func:`clock`), and clocks run at rates within ``DRIFT`` of each other. A
lease that etcd granted or renewed at a request sent at ``t`` (the member's clock) cannot have
expired in etcd before ``t + ttl`` in real time, so the member counts on it only until
``t + ttl * (1 - DRIFT)``.

The rule (the proof is in docs/DESIGN.md, "Fencing: one rule for both sides"):

- **Member** (:func:`node_verdict`, asked every ``ttl/3`` while etcd does not answer it):
  stops its workers once its lease has been gone for ``outage_grace_s``, whatever else it sees;
  before that, trains on while etcd answers it or its own lease holds; past that, only while every peer it knows answered in
  this round that etcd is unreachable for it too, and for at most ``outage_grace_s`` past the
  lease (a whole-cluster etcd outage). It stops its workers at once when a peer reaches etcd
  (this node alone is cut off) or when no peer answers. Only the first clause is needed for
  the invariant; the others stop a cut-off member early.
- **Leader** (:func:`replace_verdict`): a member of a running generation that does not answer
  it is replaced only when it is known to have stopped: its agent says it runs none of the
  generation, or its registration has been gone for :func:`fenced_within` on the leader's
  clock. Nothing else counts: not a refused connection (a firewall's REJECT looks the same),
  not what other nodes say.
  A member that still renews its lease is never replaced while it does not answer: it trains
  on, or fences itself, and reports either in etcd.

Whatever a member saw, it has stopped training ``outage_grace_s`` after its lease, plus one
round; the leader waits that long (with the drift) after it sees the lease gone, which it can
only see after the lease is gone. So the two generations never overlap, for every pattern of
reachability (``tests/unit/test_fencing.py`` enumerates them, with
partitions that change, flap and heal, and agents that pause).
"""

from __future__ import annotations

import dataclasses
import enum
import time

#: Bound on how much faster or slower one machine's monotonic clock runs than another's (real
#: crystals are within 1e-4; a VM migration or a suspended clock is a partition of its own kind).
DRIFT = 0.01
#: A whole-cluster etcd outage is ridden out for this many lease TTLs past the lease (the member
#: then stops its workers: a longer outage costs a relaunch from the checkpoint, never a job run
#: twice). The leader waits as long before it replaces a member it cannot reach.
OUTAGE_GRACE_TTLS = 3
#: A member's workers are dead this long after it decides to fence (SIGKILL to its process
#: groups, then the wait for them; measured in tens of milliseconds).
KILL_S = 1.0


def clock() -> float:
    """The clock every fencing time is read on: CLOCK_BOOTTIME, monotonic and counting the time
    the machine was suspended (CLOCK_MONOTONIC stops then: a node that wakes from a suspend must
    see its lease long gone, and a leader must count the time it slept)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def probe_s(ttl_s: float) -> float:
    """How long one question to another node about a lease may take (a peer asked whether it
    reaches etcd, an unregistered member asked what it runs): well within the TTL."""
    return min(1.0, ttl_s / 6)


def round_s(ttl_s: float) -> float:
    """How often a member without etcd asks its peers again (and the longest its verdict stands)."""
    return ttl_s / 3


def outage_grace_s(ttl_s: float) -> float:
    return OUTAGE_GRACE_TTLS * ttl_s


def watchdog_s(ttl_s: float) -> float:
    """The systemd watchdog timeout elasticd asks for (``WATCHDOG_USEC``): a hung elasticd (its
    event loop stopped, a SIGSTOP) cannot fence its workers, so systemd must kill it, and its
    workers with it, before a leader may replace them: well within :func:`fenced_within` of the
    moment its lease is seen gone."""
    return fenced_within(ttl_s) / 2


def fenced_within(ttl_s: float) -> float:
    """How long after a leader first sees a member's registration gone that member has stopped
    its workers, whatever it saw: its grace past the lease, the round that notices, the probe it
    waits on, the kill, with the clocks' drift on top."""
    return (outage_grace_s(ttl_s) + round_s(ttl_s) + probe_s(ttl_s) + KILL_S) * (1 + DRIFT) / (1 - DRIFT)


class Rule(enum.Enum):
    """Which rule decided (logged, and shown in the job's events)."""

    ETCD_ANSWERS = "etcd answers this node"
    CUT_OFF = "etcd is reachable from a peer but not from here"
    ISOLATED = "no peer answers"
    LEASE_HOLDS = "the lease still holds"
    PEER_SILENT = "the lease ran out and a peer does not answer"
    OUTAGE_TOO_LONG = "its lease ran out longer ago than a node may train without one"
    OUTAGE = "etcd is unreachable from every peer too"
    # The leader's side.
    SAYS_STOPPED = "its agent says it runs none of the generation"
    SAYS_RUNNING = "its agent says it still runs the generation"
    RENEWS = "it still renews its lease"
    FENCE_DEADLINE = "its lease has been gone longer than it may train without etcd"
    BEFORE_DEADLINE = "its lease is gone, but it may still be training"


@dataclasses.dataclass(frozen=True)
class Verdict:
    #: Member: stop the workers now. Leader: the member may be replaced now.
    act: bool
    rule: Rule
    detail: str = ""
    #: Leader, while waiting: when (its clock) the member may be replaced at the latest.
    until: float = 0.0

    @property
    def reason(self) -> str:
        return f"{self.rule.value}{': ' + self.detail if self.detail else ''}"


@dataclasses.dataclass(frozen=True)
class NodeObservation:
    """What a member knows in one round without etcd (its own monotonic clock)."""

    now: float
    ttl_s: float
    #: Its lease holds until then: the last renewal's request time + ttl * (1 - DRIFT).
    lease_until: float
    #: A read of etcd of its own, in this round, went through.
    etcd_ok: bool
    #: Every peer it knows, and what it answered in this round: True (reaches etcd), False
    #: (does not), None (no answer).
    peers: dict[str, bool | None]


def node_verdict(o: NodeObservation) -> Verdict:
    """Whether a member that etcd does not answer stops its workers now (``act``).

    The deadline comes first: past it no evidence keeps the workers, not even etcd answering a
    read (a node that reads etcd but cannot register again, an agent that was paused or
    suspended for longer than the grace: the leader may already have replaced it)."""
    over = o.now - o.lease_until
    if over >= outage_grace_s(o.ttl_s):
        return Verdict(True, Rule.OUTAGE_TOO_LONG, f"{over:.1f}s past the lease")
    if o.etcd_ok:
        return Verdict(False, Rule.ETCD_ANSWERS)
    reaching = sorted(p for p, a in o.peers.items() if a)
    if reaching:
        return Verdict(True, Rule.CUT_OFF, "reachable from " + ", ".join(reaching))
    silent = sorted(p for p, a in o.peers.items() if a is None)
    if o.peers and len(silent) == len(o.peers):
        return Verdict(True, Rule.ISOLATED, ", ".join(silent))
    if o.now < o.lease_until:
        return Verdict(False, Rule.LEASE_HOLDS, f"{o.lease_until - o.now:.1f}s more")
    if silent:
        return Verdict(True, Rule.PEER_SILENT, ", ".join(silent) + " may lead with etcd")
    answered = sorted(o.peers)
    return Verdict(False, Rule.OUTAGE, f"{', '.join(answered) or 'no other node'}; training goes on for "
                                       f"{outage_grace_s(o.ttl_s) - over:.1f}s more at most")


@dataclasses.dataclass(frozen=True)
class MemberEvidence:
    """What a leader knows of a member of a running generation that it cannot count on: its
    registration is gone, or its connection dropped (the leader's monotonic clock)."""

    now: float
    ttl_s: float
    #: Its registration is in etcd (its lease holds).
    registered: bool
    #: When this leader first saw it unregistered (None: it is registered).
    gone_since: float | None
    #: The generations it runs, as its agent last answered (None: no answer lately).
    running: frozenset[tuple[str, int]] | None
    #: The generations of the plans it is a member of.
    wanted: frozenset[tuple[str, int]]


def replace_verdict(e: MemberEvidence) -> Verdict:
    """Whether a leader may commit a generation without this member (``act``), or hold its jobs.

    Its agent's answer decides first (it counts a launch under way as running). Else only its
    deadline: a member that still renews its lease is never replaced, and one whose
    registration is gone only once it has been gone for :func:`fenced_within`. A refused
    connection is not evidence: a firewall's REJECT in front of a live member looks the same,
    and a member whose peers' answers or its own reads of etcd kept it training (an etcd slow
    for one read, a registration that fails while reads go through) may not have fenced."""
    if e.running is not None:
        if not (e.wanted & e.running):
            return Verdict(True, Rule.SAYS_STOPPED)
        return Verdict(False, Rule.SAYS_RUNNING, ", ".join(f"{j} generation {g}" for j, g in sorted(e.wanted & e.running)))
    if e.registered or e.gone_since is None:
        return Verdict(False, Rule.RENEWS, "it trains on or fences itself, and says so in etcd")
    until = e.gone_since + fenced_within(e.ttl_s)
    if e.now >= until:
        return Verdict(True, Rule.FENCE_DEADLINE, f"gone {e.now - e.gone_since:.1f}s")
    return Verdict(False, Rule.BEFORE_DEADLINE, f"{until - e.now:.1f}s to wait", until)
