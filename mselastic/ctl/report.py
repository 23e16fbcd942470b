"""``elasticctl report JOB -o timeline.png``: the run as a picture, from the job's event log.

Top: the step reached against wall time (the leader's ``progress`` events), each
generation shaded and labelled, faults marked where they were detected (red) and
planned relaunches where they were decided (orange dashed), a drop in the line where
a relaunch resumed from an earlier checkpoint. Bottom: the world size over time.
"""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")  # files only: no display needed

import matplotlib.pyplot as plt  # noqa: E402

from mselastic.core.kinds import EventKind  # noqa: E402
from mselastic.v1 import elastic_pb2 as pb  # noqa: E402

SHADES = ("#dbe9f6", "#f2f2f2")


def steps_over_time(status: pb.JobStatus, progress: list[pb.Event], end: float) -> dict[int, list[tuple[float, int]]]:
    """Per generation, (time, step) from the progress events (written every ``progress_interval_s``),
    and the step the job's status holds at ``end`` (its last event) when it is past the last one:
    the line reaches where the run ended, not the last periodic record before it."""
    by_gen: dict[int, list[tuple[float, int]]] = {}
    for e in progress:
        by_gen.setdefault(e.generation, []).append((e.at, e.step))
    if status.step > max((e.step for e in progress), default=-1) and status.generation:
        by_gen.setdefault(status.generation, []).append((end, status.step))
    return by_gen


def draw(res: pb.DescribeResponse, events: list[pb.Event], path: str) -> None:
    spec = json.loads(res.spec_json) if res.spec_json else {}
    t0 = min((e.at for e in events), default=0.0)
    progress = [e for e in events if e.kind == EventKind.PROGRESS.value]
    starts = {e.generation: e.at for e in events if e.kind in ("generation", "planned")}
    end = max((e.at for e in events), default=t0 + 1.0)
    plans = {p.generation: p for p in res.plans}

    fig, (ax, ws) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, height_ratios=(3, 1), constrained_layout=True)
    gens = sorted(starts)
    for i, g in enumerate(gens):
        lo, hi = starts[g] - t0, (starts[gens[i + 1]] if i + 1 < len(gens) else end) - t0
        for a in (ax, ws):
            a.axvspan(lo, hi, color=SHADES[i % 2], zorder=0)
        world = plans[g].world_size if g in plans else 0
        ax.text(lo, 1.0, f" g{g}\n w={world}", transform=ax.get_xaxis_transform(), va="top", fontsize=8)
    for g, pts in sorted(steps_over_time(res.status, progress, end).items()):
        ax.plot([at - t0 for at, _ in pts], [step for _, step in pts], marker=".", lw=1.5, label=f"generation {g}")
    faults = [e for e in events if e.kind == EventKind.GENERATION.value and e.detected_at]
    for n, e in enumerate(faults):
        ax.axvline(e.detected_at - t0, color="red", lw=1.2, label="fault detected" if n == 0 else None)
    planned = [e for e in events if e.kind == EventKind.PLANNED.value]
    for n, e in enumerate(planned):
        ax.axvline(e.at - t0, color="orange", ls="--", lw=1.2, label="planned relaunch" if n == 0 else None)
    total = int(spec.get("total_steps", 0))
    if total:
        ax.axhline(total, color="grey", ls=":", lw=1, label=f"total_steps={total}")
    # Headroom above total_steps (and the highest step) for the generation labels at the top.
    highest = max([total] + [e.step for e in progress] + [1])
    ax.set_ylim(bottom=0, top=highest * 1.2)
    ax.set_ylabel("step")
    ax.set_title(f"{res.status.job}: {pb.JobState.Name(res.status.state).removeprefix('JOB_STATE_')}, "
                 f"{len(plans)} generation(s), {res.status.restart_count} restart(s)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    if progress:
        xs = [e.at - t0 for e in progress] + [end - t0]
        ys = [e.world_size for e in progress] + [progress[-1].world_size]
        ws.step(xs, ys, where="post", color="tab:purple")
    ws.set_ylabel("world size")
    ws.set_xlabel("seconds since submit")
    ws.set_ylim(bottom=0, top=max([e.world_size for e in progress] + [1]) + 1)
    ws.grid(alpha=0.3)
    fig.savefig(path, dpi=100)
    plt.close(fig)
