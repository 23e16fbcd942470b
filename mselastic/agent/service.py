"""The Agent gRPC service: Launch, Stop, Status, called by the leader; Logs, called by elasticctl."""

from __future__ import annotations

import asyncio
import glob
import os
import re
import stat
from typing import AsyncIterator

import grpc

from mselastic.agent.node import LaunchRefused, LaunchUnfit, NodeAgent, Restarting
from mselastic.wire import abort, generation_state_to_pb, plan_from_pb
from mselastic.core import retries
from mselastic.core.model import MalformedRecord
from mselastic.core.spec import MAX_SECONDS, SpecError, is_job_name
from mselastic.store.etcd import TemporaryError
from mselastic.store.keys import BadName, check_id
from mselastic.v1 import elastic_pb2 as pb
from mselastic.v1 import elastic_pb2_grpc as pb_grpc


# How long ``logs -f`` of a generation waits for its log to appear (the leader has planned it; msrun is starting).
LOG_WAIT_S = 60.0


class AgentService(pb_grpc.AgentServicer):
    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent

    async def Launch(self, request: pb.LaunchRequest, context: grpc.aio.ServicerContext) -> pb.LaunchResponse:
        if not request.plan.job or request.plan.generation <= 0 or not request.plan.members:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "Launch needs a plan with job, generation > 0 and members")
        try:
            plan = plan_from_pb(request.plan)
        except ValueError as e:  # an enum value this build does not know (hypothesis found kind = -1)
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"Launch: the plan is not valid: {e}")
        try:
            message = await self.agent.launch(plan)
        except Restarting as e:
            await abort(context, grpc.StatusCode.UNAVAILABLE, f"{e}; ask again")
        except LaunchUnfit as e:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except LaunchRefused as e:
            return pb.LaunchResponse(accepted=False, message=str(e))
        except TemporaryError as e:
            await abort(context, grpc.StatusCode.UNAVAILABLE, f"etcd unavailable, cannot verify the plan: {e}")
        except (MalformedRecord, SpecError) as e:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"bad record in etcd: {e}")
        return pb.LaunchResponse(accepted=True, message=message)

    async def Stop(self, request: pb.StopRequest, context: grpc.aio.ServicerContext) -> pb.StopResponse:
        if not is_job_name(request.job) or not 0 <= request.grace_period_s <= MAX_SECONDS:  # NaN fails too
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"Stop needs a job's name and a grace_period_s in 0..{MAX_SECONDS:.0f}")
        try:
            left = await self.agent.stop(request.job, request.generation, request.grace_period_s,
                                         request.stop_at_step, final=request.final)
        except Restarting as e:
            await abort(context, grpc.StatusCode.UNAVAILABLE, f"{e}; ask again")
        return pb.StopResponse(leftover_pids=left)

    async def Status(self, request: pb.AgentStatusRequest, context: grpc.aio.ServicerContext) -> pb.AgentStatusResponse:
        gens = []
        for g in self.agent.status():
            gens.append(pb.LocalGeneration(
                job=g.plan.job, generation=g.plan.generation, state=generation_state_to_pb(g.state),
                failure=g.reason, steps_per_s=g.steps_per_s(), warm=g.warm, adoptions=g.adoptions,
                ranks=[pb.RankStatus(rank=r.rank, pid=r.pid, step=r.step, loss=r.loss, finished=r.finished)
                       for r in g.ranks.values()]))
        shown = {(g.job, g.generation) for g in gens}
        # A launch under way is a generation about to run here: a leader asking whether this node
        # stopped must not be told it did.
        gens += [pb.LocalGeneration(job=job, generation=generation, state=pb.GENERATION_STATE_STARTING)
                 for job, generation in sorted(set(self.agent.launching) - shown)]
        standbys = [pb.StandbyStatus(job=job, pid=s["pid"], ready=s["ready"])
                    for job, s in self.agent.standbys.describe()]
        check = request.check_etcd_s
        reachable = await self.agent.reaches_etcd(min(check, 5.0)) if check > 0 else False  # NaN: no check
        return pb.AgentStatusResponse(node_id=self.agent.cfg.node_id, generations=gens, etcd_reachable=reachable,
                                      standbys=standbys)

    async def Nudge(self, request: pb.NudgeRequest, context: grpc.aio.ServicerContext) -> pb.NudgeResponse:
        """A peer's rank of the generation got through init(): see ``Generation.peer_joined``."""
        try:
            check_id("job name", request.job)
        except BadName as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        gen = self.agent.generations.get(request.job)
        if gen is None or gen.plan.generation != request.generation or gen.state.terminal:
            return pb.NudgeResponse(running=False)
        gen.peer_joined()
        return pb.NudgeResponse(running=True)

    async def Logs(self, request: pb.LogsRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.LogChunk]:
        """Stream ``worker_<rank>.log`` of a generation that ran here; with ``follow``, until it ends."""
        if not request.job or request.rank < 0 or request.generation < 0 or request.tail_bytes < 0:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        "Logs needs a job, a rank >= 0, a generation >= 0 and tail_bytes >= 0")
        try:
            root = os.path.join(self.agent.cfg.work_dir, "logs", check_id("job name", request.job))
        except BadName as e:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        name = f"worker_{request.rank}.log"
        if request.generation:
            path = os.path.join(root, f"g{request.generation:06d}", name)
        else:
            found = sorted(glob.glob(os.path.join(root, "g*", name)))
            path = found[-1] if found else ""
        if path and request.follow and request.generation and not os.path.exists(path):
            await self._await_log(path, request.job, request.generation)
        if not path or not os.path.exists(path):
            await abort(context, grpc.StatusCode.NOT_FOUND,
                        f"no log of rank {request.rank} of job {request.job}"
                        + (f" generation {request.generation}" if request.generation else "")
                        + f" on node {self.agent.cfg.node_id}")
        generation = int(re.sub(r"\D", "", os.path.basename(os.path.dirname(path))))
        # The file is the worker user's: never through a symlink it made (elasticd reads as root),
        # never a FIFO or device that would block the event loop.
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION, f"{path} cannot be read safely: {e.strerror}")
        # Its owner must be the generation's user: the one elasticd handed the generation's folder to
        # (the folder's parent is root's: the job can neither rename nor replace it).
        st, owner = os.fstat(fd), os.lstat(os.path.dirname(path)).st_uid
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid not in {0, owner}:
            os.close(fd)  # (a hard link would show another job's file, of the same worker user, as this one's)
            await abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                        f"{path} is not the rank's log (not a regular file of the generation's user with one link)")
        with os.fdopen(fd, "rb") as f:
            if request.tail_bytes:
                f.seek(max(0, os.fstat(fd).st_size - request.tail_bytes))
            while True:
                data = f.read(1 << 16)
                if data:
                    yield pb.LogChunk(data=data, generation=generation)
                    continue
                if not request.follow or not self._running(request.job, generation):
                    return
                await asyncio.sleep(0.2)

    async def _await_log(self, path: str, job: str, generation: int) -> None:
        """Wait (up to LOG_WAIT_S) for the log of a generation that has not started here yet, or is starting."""
        async def waiting() -> bool:
            gen = self.agent.generations.get(job)
            coming = gen is None or gen.plan.generation < generation or self._running(job, generation)
            return coming and not os.path.exists(path)
        await retries.polling(LOG_WAIT_S, every_s=0.2, quietly=True)(waiting)

    def _running(self, job: str, generation: int) -> bool:
        gen = self.agent.generations.get(job)
        return gen is not None and gen.plan.generation == generation and not gen.state.terminal
