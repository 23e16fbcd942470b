"""The msrun supervisor's guards that need no MindSpore: a busy master port fails fast."""

from __future__ import annotations

import asyncio
import os
import socket

from mselastic.agent.supervisor import Generation
from mselastic.core.model import Member, Plan
from mselastic.core.spec import JobSpec
from mselastic.core.states import GenerationState


def test_busy_master_port_fails_the_generation_without_starting_msrun(tmp_path: os.PathLike[str]) -> None:
    tmp = str(tmp_path)
    with socket.socket() as holder:  # stands for a live scheduler of another job on this port
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        plan = Plan(job="j", generation=4, members=(Member("n0", 0, 2, "127.0.0.1:1", "127.0.0.1"),),
                    worker_num=2, master_addr="127.0.0.1", master_port=port, restart_count=0, reason="t")
        spec = JobSpec(name="j", script=os.path.join(tmp, "train.py"), checkpoint_dir=os.path.join(tmp, "c"),
                       workers_per_node=2)
        changes: list[GenerationState] = []

        async def run() -> Generation:
            gen = Generation(plan, spec, "n0", tmp, lambda g, urgent: changes.append(g.state))
            await gen.start()
            await asyncio.wait_for(gen.done.wait(), 5)
            return gen

        gen = asyncio.run(run())
    assert gen.state is GenerationState.FAILED and changes[-1] is GenerationState.FAILED
    assert f"master port {port} is in use" in gen.reason
    assert gen._msrun is None  # msrun was never started
    assert gen.report().stopped_at > 0
