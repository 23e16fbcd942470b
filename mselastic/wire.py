"""Conversions between the core records and the ``mselastic.v1`` messages, in one place."""

from __future__ import annotations

from typing import NoReturn, cast

import grpc

from mselastic.core.model import Member, Plan
from mselastic.core.kinds import RelaunchReason
from mselastic.core.states import FailureCause, GenerationState, JobState
from mselastic.v1 import elastic_pb2 as pb


def plan_to_pb(plan: Plan) -> pb.Plan:
    return pb.Plan(
        job=plan.job, generation=plan.generation, world_size=plan.world_size, master_addr=plan.master_addr,
        master_port=plan.master_port, restart_count=plan.restart_count, reason=plan.reason, planned=plan.planned,
        kind=cast(pb.RelaunchReason, pb.RelaunchReason.Value(f"RELAUNCH_REASON_{plan.kind.name}")),
        stop_previous_at_step=plan.stop_previous_at_step,
        members=[pb.Member(node_id=m.node_id, node_rank=m.node_rank, local_workers=m.local_workers,
                           agent_address=m.agent_address, host=m.host, devices=m.devices,
                           device_kind=m.device_kind, lease_ttl_s=m.lease_ttl_s) for m in plan.members])


def plan_from_pb(msg: pb.Plan) -> Plan:
    return Plan(
        job=msg.job, generation=msg.generation, world_size=msg.world_size, master_addr=msg.master_addr,
        master_port=msg.master_port, restart_count=msg.restart_count, reason=msg.reason, planned=msg.planned,
        kind=RelaunchReason[pb.RelaunchReason.Name(msg.kind).removeprefix("RELAUNCH_REASON_")]
        if msg.kind else RelaunchReason.INITIAL, stop_previous_at_step=msg.stop_previous_at_step,
        members=tuple(Member(node_id=m.node_id, node_rank=m.node_rank, local_workers=m.local_workers,
                             agent_address=m.agent_address, host=m.host, devices=tuple(m.devices),
                             device_kind=m.device_kind, lease_ttl_s=m.lease_ttl_s) for m in msg.members))


def failure_cause_to_pb(cause: FailureCause) -> pb.FailureCause:
    name = "UNSPECIFIED" if cause is FailureCause.NONE else cause.name
    return cast(pb.FailureCause, pb.FailureCause.Value(f"FAILURE_CAUSE_{name}"))


def job_state_to_pb(state: JobState) -> pb.JobState:
    return cast(pb.JobState, pb.JobState.Value(f"JOB_STATE_{state.value}"))


def generation_state_to_pb(state: GenerationState) -> pb.GenerationState:
    return cast(pb.GenerationState, pb.GenerationState.Value(f"GENERATION_STATE_{state.value}"))


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    """``context.abort`` with the type checker told that it does not return."""
    await context.abort(code, message)
    raise AssertionError("context.abort returned")
