"""``elasticctl watch JOB``: a live view redrawn in place (rich) on a terminal, one line per
change otherwise (a pipe, a log file, CI)."""

from __future__ import annotations

import time
from typing import Any, Callable

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.progress_bar import ProgressBar
from rich.table import Table

from mselastic.ctl import render
from mselastic.v1 import elastic_pb2 as pb

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class Rate:
    """Samples per second from successive (time, step) readings, over the last few seconds."""

    def __init__(self, window_s: float = 5.0) -> None:
        self.window_s = window_s
        self.points: list[tuple[float, int]] = []

    def add(self, t: float, step: int, global_batch: int) -> float:
        if self.points and step < self.points[-1][1]:
            self.points.clear()  # a relaunch resumed from an earlier checkpoint
        self.points.append((t, step))
        self.points = [p for p in self.points if t - p[0] <= self.window_s] or self.points[-1:]
        (t0, s0), (t1, s1) = self.points[0], self.points[-1]
        return (s1 - s0) * global_batch / (t1 - t0) if t1 > t0 else 0.0


def view(j: pb.JobStatus, samples_s: float) -> Group:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    t.add_row("job", f"{j.job}  [{render.state(j.state)}]")
    t.add_row("generation", f"{j.generation}  (restarts {j.restart_count})")
    t.add_row("world size", f"{j.world_size}  on {', '.join(m.node_id for m in j.members) or '-'}")
    step = max(j.step, 0)
    t.add_row("step", f"{step}/{j.total_steps}  ({100.0 * step / max(j.total_steps, 1):.1f}%)")
    t.add_row("samples/s", f"{samples_s:.1f}")
    t.add_row("loss", f"{j.loss:.4f}" if j.step > 0 else "-")
    for line in render.job_details(j):
        key, _, value = line.strip().partition(": ")
        t.add_row(key, escape(value))  # (a job's text: "[...]" in it is not rich's markup)
    return Group(t, ProgressBar(total=max(j.total_steps, 1), completed=step, width=60))


def line(j: pb.JobStatus, samples_s: float) -> str:
    step = max(j.step, 0)
    return (f"{time.strftime('%H:%M:%S')} {j.job} {render.state(j.state)} gen={j.generation} world={j.world_size} "
            f"step={step}/{j.total_steps} ({100.0 * step / max(j.total_steps, 1):.0f}%) "
            f"samples/s={samples_s:.1f} loss={f'{j.loss:.4f}' if j.step > 0 else '-'}"
            + (f" note: {render.printable(j.note)}" if j.note else ""))


def watch(fetch: Callable[[], pb.StatusResponse], job: str, interval_s: float, out: Any, until: str = "",
          until_step: int = 0) -> pb.JobStatus:
    """Poll ``fetch`` until the job ends, is in state ``until`` or has reached ``until_step``;
    returns it as last seen."""
    def over(j: pb.JobStatus) -> bool:
        return render.state(j.state) in (*TERMINAL, until) or 0 < until_step <= j.step

    rate = Rate()
    console = Console(file=out)
    tty = console.is_terminal

    def poll() -> tuple[pb.JobStatus, float]:
        j = fetch().jobs[0]
        return j, rate.add(time.monotonic(), max(j.step, 0), j.global_batch_size)

    j, samples_s = poll()
    if tty:
        with Live(view(j, samples_s), console=console, refresh_per_second=4, transient=False) as live:
            while not over(j):
                time.sleep(interval_s)
                j, samples_s = poll()
                live.update(view(j, samples_s))
        return j
    last = ""
    while True:
        text = line(j, samples_s)
        key = text.split(" ", 1)[1].split(" samples/s")[0] + j.note
        if key != last:
            print(text, file=out, flush=True)
            last = key
        if over(j):
            return j
        time.sleep(interval_s)
        j, samples_s = poll()

