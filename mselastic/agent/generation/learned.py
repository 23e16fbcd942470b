"""Hang limits learned from the job itself (#47): pure rules, no clock, no ``/proc``.

With no ``hang_timeout_s`` in its spec, how long a rank may go without a heartbeat is not one
number for the whole job: the agent times what its ranks do, per section, and judges a silence
against what that section took before, on this node, in this job (every generation of it that
ran here since this elasticd started). The sections (NVIDIA's resiliency extension times
"sections" the same way; none of our anchors does it per rank and per phase in a daemon):

- ``first_step``: from a rank's resume (its ``start`` beat) to its first step: the checkpoint's
  load and the graph's compile, long and rare;
- ``step``: between two steps: the step itself, the data loader, a snapshot, and whatever else
  the script does between steps without saying so;
- ``checkpoint``: from a step at which a checkpoint is due (a multiple of the spec's
  ``checkpoint_interval_steps``) to the next: the save, or for the ranks that do not write, their
  wait in the next step's collective for the one that does;
- a named section a rank said it entered (``ElasticContext.section``: ``eval``, or any name of
  the script's); it ends at the rank's next beat.

A section's limit, once learned, is ``SAFETY`` times the longest it took so far: what the job did
once it may do again, a little slower. Until a section is learned (the steps: ``MIN_STEPS`` of
them; the others: once) the old fixed default holds, ``FALLBACK_S``, and the first step gets the
start-up timeout: a job's first compile or first save is never judged on a guess.

Silence alone says little: a data loader waiting on a network file system, an evaluation pass
the script did not mark, a peer waiting in a collective for rank 0's save all look like a hang
to a heartbeat. So the learned limit is the whole answer only where the agent sees the whole
job and nothing of it works:

- a rank *stopped* by SIGSTOP (state T) runs no code, whatever its peers do: it is hung once
  ``STOPPED_FACTOR`` typical steps have passed (at least ``STOPPED_FLOOR_S``); a debugger's stop
  (state t: gdb, strace, py-spy dump) gets half the default, as before;
- a silent rank is hung past the learned limit (at least ``IDLE_FLOOR_S``) when every rank of the
  job is on this node, each is silent past its own limit, and the generation's cgroup is *idle*:
  over ``BUSY_WINDOW_S`` its processes and threads (the ranks, their data loader workers, a
  writer thread) used less than ``BUSY_SHARE`` of a core and waited as little for a CPU or on
  I/O (``cpu.stat``, ``cpu.pressure``, ``io.pressure``): a deadlock, a collective that will
  never complete. A wait on the network or on an accelerator looks idle too: hence the floor;
- any other silence (a job that works through it, a job with ranks on other nodes, which may
  be working, a node without cgroup v2) is judged against the fixed default or the learned
  limit, whichever is longer: a healthy job is not called hung because it did something new,
  and a job whose steps take longer than the default is not called hung at every step.

What is learned holds for one world size (each rank's share of a step changes with it): a
relaunch at another starts over.

An explicit ``hang_timeout_s`` wins everywhere, as before: its value for every silence, half of
it for a stopped rank.
"""

from __future__ import annotations

import collections
import dataclasses
import statistics

#: The implicit sections (a named one is the script's or the trainer library's own).
FIRST_STEP = "first_step"
STEP = "step"
#: The step after one at which a checkpoint is due (the save, or the wait for the rank that saves).
CHECKPOINT = "checkpoint"

#: The limit before a section is learned (and for a rank that works through its silence: at least).
FALLBACK_S = 60.0
#: A learned limit is this many times the longest the section took...
SAFETY = 4.0
#: ... and never less than this for the whole job seen idle (a data loader's stall on a network file
#: system, a garbage collection, a loaded machine's scheduling).
IDLE_FLOOR_S = 30.0
#: Step intervals seen before the step's limit counts as learned.
MIN_STEPS = 20
#: A stopped rank (state T) is hung after this many typical steps...
STOPPED_FACTOR = 10.0
#: ... and never before this.
STOPPED_FLOOR_S = 1.0
#: Durations kept per section for the typical one (the longest is kept apart, for good).
WINDOW = 256
#: A section's name is cut to this many characters.
MAX_NAME = 64
#: Named sections remembered per job (a script naming a section per step must not grow elasticd).
MAX_SECTIONS = 32
#: A rank silent past its idle limit is watched this long before its work (or lack of it) counts.
BUSY_WINDOW_S = 0.5
#: ... and is working when its CPU time and its wait for a CPU grew by this share of that time.
BUSY_SHARE = 0.2


@dataclasses.dataclass
class _Seen:
    count: int = 0
    longest: float = 0.0
    recent: collections.deque[float] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=WINDOW))


@dataclasses.dataclass(frozen=True)
class Limit:
    """How long a rank in some section may stay silent: ``idle_s`` while the whole job is seen
    doing nothing, ``busy_s`` otherwise; ``why`` says where the number comes from (for the verdict)."""

    idle_s: float
    busy_s: float
    why: str


class Learned:
    """What this node saw of one job's sections (see the module's text)."""

    def __init__(self, startup_timeout_s: float = 180.0) -> None:
        self.startup_timeout_s = startup_timeout_s
        self._seen: dict[str, _Seen] = {}

    def observe(self, section: str, seconds: float) -> None:
        """A rank spent ``seconds`` in ``section`` (from the beat that began it to its next one)."""
        if seconds < 0:
            return
        seen = self._seen.get(section)
        if seen is None:
            if len(self._seen) >= MAX_SECTIONS and section not in (FIRST_STEP, STEP, CHECKPOINT):
                return
            seen = self._seen[section] = _Seen()
        seen.count += 1
        seen.longest = max(seen.longest, seconds)
        seen.recent.append(seconds)

    def learned(self, section: str) -> bool:
        seen = self._seen.get(section)
        return seen is not None and seen.count >= (MIN_STEPS if section == STEP else 1)

    def longest(self, section: str) -> float | None:
        """The longest ``section`` took so far (None: never seen)."""
        seen = self._seen.get(section)
        return seen.longest if seen is not None and seen.count else None

    def typical_step_s(self) -> float | None:
        """The median of the recent steps, once the step is learned."""
        return statistics.median(self._seen[STEP].recent) if self.learned(STEP) else None

    def limit(self, section: str) -> Limit:
        """The limit for a rank silent in ``section`` (see the module's text)."""
        seen = self._seen.get(section)
        if seen is None or not self.learned(section):
            fallback = self.startup_timeout_s if section == FIRST_STEP else FALLBACK_S
            what = "startup_timeout_s" if section == FIRST_STEP else "the default"
            return Limit(fallback, fallback, f"{section} not learned yet: {what}, {fallback:g}s")
        idle = max(IDLE_FLOOR_S, SAFETY * seen.longest)
        return Limit(idle, max(idle, FALLBACK_S),
                     f"learned: {SAFETY:g}x the longest {section} seen here, {seen.longest:.2f}s; idle at least "
                     f"{IDLE_FLOOR_S:g}s, else at least {FALLBACK_S:g}s")

    def stopped_limit(self) -> tuple[float, str]:
        """How long a rank may stay stopped (state T), and why."""
        typical = self.typical_step_s()
        if typical is None:
            return FALLBACK_S / 2, f"steps not learned yet: half the default, {FALLBACK_S / 2:g}s"
        limit = min(max(STOPPED_FLOOR_S, STOPPED_FACTOR * typical), FALLBACK_S / 2)
        return limit, f"learned: {STOPPED_FACTOR:g} typical steps ({typical:.2f}s), at least {STOPPED_FLOOR_S:g}s"

    def summary(self) -> dict[str, tuple[int, float]]:
        """Each section: (times seen, longest): for the log and ``elasticctl describe``."""
        return {name: (s.count, s.longest) for name, s in self._seen.items()}


def busy(work_s: float, over_s: float) -> bool:
    """Whether a generation worked over ``over_s`` seconds: its processes' CPU time and their waits
    for a CPU or on I/O grew by ``work_s`` in all."""
    return over_s > 0 and work_s >= BUSY_SHARE * over_s
