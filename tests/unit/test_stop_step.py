"""A planned stop names its step: the agent writes it where the ranks read it once signalled,
and a rank stops exactly there with no per-step collective. Pure logic and files; the end-to-end
stops (elasticctl stop, drain, scale, systemctl stop) are in test_elastic and test_systemd."""

from __future__ import annotations

import os
import socket
import stat
import time

import pytest

from mselastic.agent.generation import supervisor
from mselastic.agent.generation.supervisor import Generation
from mselastic.core import contract
from mselastic.core.contract import Beat, BeatKind
from mselastic.core.batching import batch_layout
from mselastic.trainer.context import ElasticContext
from tests.builders import local_plan, local_spec


def context(stop_file: str, interval: int = 1000) -> ElasticContext:
    layout = batch_layout(32, 2, ())
    assert layout is not None
    return ElasticContext(rank=1, world_size=2, job="j", generation=3, restart_count=0, checkpoint_dir="",
                          checkpoint_interval_steps=10, keep_checkpoints=3, total_steps=100, global_batch_size=32,
                          layout=layout, stop_check_interval_steps=interval, stop_file=stop_file)


@pytest.mark.parametrize("data, step", [(b"17\n", 17), (b"0\n", 0), (b"", None), (b"17", None), (b"-3\n", None),
                                        (b"1e3\n", None), (b"\xff\n", None), (b"12\n13\n", None)])
def test_a_stop_file_holds_one_step_or_is_not_read(data: bytes, step: int | None) -> None:
    assert contract.decode_stop_step(data) == step
    if step is not None:
        assert contract.decode_stop_step(contract.encode_stop_step(step)) == step


def test_a_rank_stops_exactly_at_the_named_step_and_reads_nothing_before_the_signal(tmp_path: os.PathLike[str]) -> None:
    stop_file = os.path.join(str(tmp_path), "g000003.stop")
    ctx = context(stop_file)
    with open(stop_file, "wb") as f:
        f.write(contract.encode_stop_step(9))
    assert not any(ctx.should_stop(s) for s in range(1, 7)) and ctx.stop_at is None  # no SIGTERM: never read
    ctx._on_sigterm(15, None)
    assert [ctx.should_stop(s) for s in range(7, 10)] == [False, False, True] and ctx.stop_at == 9


def test_a_signal_without_a_step_asks_the_agent_until_it_answers(tmp_path: os.PathLike[str]) -> None:
    stop_file = os.path.join(str(tmp_path), "g000003.stop")
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"mselastic-test-{os.getpid()}-{time.monotonic_ns()}"
    agent.bind("\0" + name)
    agent.settimeout(5)
    try:
        ctx = context(stop_file)
        ctx.heartbeat_address = name
        ctx._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        ctx._on_sigterm(15, None)
        assert not ctx.should_stop(4) and not ctx.should_stop(5)
        asked = [Beat.decode(agent.recv(4096)) for _ in range(2)]
        assert [(b.kind, b.step, b.rank) for b in asked] == [(BeatKind.STOP_REQUESTED, 4, 1),
                                                            (BeatKind.STOP_REQUESTED, 5, 1)]
        with open(stop_file, "wb") as f:  # the agent answers
            f.write(contract.encode_stop_step(8))
        assert [ctx.should_stop(s) for s in (6, 7, 8)] == [False, False, True]
        ctx._sock.close()
    finally:
        agent.close()


def test_a_rank_already_past_the_step_does_not_stop_alone_there(tmp_path: os.PathLike[str],
                                                                caplog: pytest.LogCaptureFixture) -> None:
    stop_file = os.path.join(str(tmp_path), "g000003.stop")
    with open(stop_file, "wb") as f:
        f.write(contract.encode_stop_step(5))
    ctx = context(stop_file)
    ctx._on_sigterm(15, None)
    assert not ctx.should_stop(6) and not ctx.should_stop(7)
    assert "read the stop step 5 only after step 6" in caplog.text


class Collective:
    """Stands for the ranks' allreduce: records this rank's contributions, answers a given sum."""

    def __init__(self, others: float) -> None:
        self.others = others
        self.sent: list[float] = []

    def __call__(self, values: list[float]) -> list[float]:
        self.sent.append(values[0])
        return [values[0] + self.others]


def test_at_a_backstop_step_every_rank_is_in_the_allreduce_even_at_its_named_step(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A named step on a backstop multiple: a peer that has not read the step yet is in the
    allreduce, so this rank must be there too (else it would pair with the peer's barrier)."""
    stop_file = os.path.join(str(tmp_path), "g000003.stop")
    with open(stop_file, "wb") as f:
        f.write(contract.encode_stop_step(10))
    ctx = context(stop_file, interval=5)
    allreduce = Collective(others=0.0)
    monkeypatch.setattr(ctx, "allreduce", allreduce)
    assert not ctx.should_stop(5) and allreduce.sent == [0.0]  # not signalled: counts 0
    ctx._on_sigterm(15, None)
    assert [ctx.should_stop(s) for s in (6, 7, 8, 9)] == [False] * 4 and ctx.stop_at == 10
    assert ctx.should_stop(10) and allreduce.sent == [0.0, 1.0]


def test_a_signalled_rank_counts_at_the_backstop_before_its_named_step(tmp_path: os.PathLike[str],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks told a step and ranks not told one (their node's Stop still on its way): at the
    backstop every signalled rank counts, so they all leave there together."""
    stop_file = os.path.join(str(tmp_path), "g000003.stop")
    with open(stop_file, "wb") as f:
        f.write(contract.encode_stop_step(14))
    told = context(stop_file, interval=10)
    monkeypatch.setattr(told, "allreduce", Collective(others=0.0))  # the others were not signalled yet
    told._on_sigterm(15, None)
    assert not told.should_stop(9) and told.should_stop(10)  # 10 < 14: all leave at the backstop
    untold = context(os.path.join(str(tmp_path), "none"), interval=10)
    monkeypatch.setattr(untold, "allreduce", Collective(others=1.0))  # a told peer counts 1
    assert not untold.should_stop(9) and untold.should_stop(10)


def generation(tmp: str, members: int = 1) -> Generation:
    plan = local_plan(generation=3, node_ids=tuple(f"n{i}" for i in range(members)))
    return Generation(plan, local_spec(tmp), "n0", tmp, lambda g, urgent: None)


def test_the_agent_names_a_step_ahead_of_its_ranks_and_writes_it_for_the_worker_user(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    tmp = str(tmp_path)
    gen = generation(tmp)
    assert gen.next_stop_step() == 0  # no rank has said where it is: no step can be named
    clock = [100.0]
    monkeypatch.setattr(supervisor.time, "monotonic", lambda: clock[0])
    for s in range(10, 21):  # 10 steps a second, through the agent's own beat handling
        clock[0] = 100.0 + (s - 10) * 0.1
        gen.on_beat(Beat(kind=BeatKind.STEP, rank=0, pid=1, generation=3, step=s))
        gen.on_beat(Beat(kind=BeatKind.STEP, rank=1, pid=2, generation=3, step=s - 1))
    assert gen.steps_per_s() == pytest.approx(10.0)
    assert gen.next_stop_step() == 20 + 2 + 3  # 0.25 s of steps at 10 a second
    assert contract.stop_step_ahead([20, 19], gen.steps_per_s(), 1.0) == 32  # the leader's, with its latency
    assert contract.stop_step_ahead([20, -1], 10.0, 0.5) == 0 == contract.stop_step_ahead([], 10.0, 0.5)
    os.makedirs(os.path.dirname(gen.stop_file))
    old = os.umask(0o077)  # elasticd's umask is 027: the file is made readable on purpose
    try:
        gen.plan_stop(25)
    finally:
        os.umask(old)
    assert gen.stop_file == os.path.join(tmp, "logs", "j", "g000003.stop") and gen.stop_at == 25
    with open(gen.stop_file, "rb") as f:
        assert contract.decode_stop_step(f.read()) == 25
    assert stat.S_IMODE(os.stat(gen.stop_file).st_mode) == 0o644  # readable by the worker user
    assert os.listdir(os.path.dirname(gen.stop_file)) == ["g000003.stop"]  # no temporary file left
    assert gen.launch_env.env()[contract.ENV_STOP_FILE] == gen.stop_file
    gen.plan_stop(40)  # a Stop sent again: never moves a step some ranks may have read
    with open(gen.stop_file, "rb") as f:
        assert contract.decode_stop_step(f.read()) == 25 == gen.stop_at


def test_a_step_that_cannot_be_written_is_not_named(tmp_path: os.PathLike[str]) -> None:
    tmp = str(tmp_path)
    gen = generation(tmp)
    os.makedirs(gen.stop_file)  # a folder in the way: the rename fails
    gen.ranks[0].step = gen.ranks[1].step = 4
    gen.plan_stop(6)
    assert gen.stop_at == 0 and os.listdir(os.path.dirname(gen.stop_file)) == ["g000003.stop"]


def test_a_multi_node_generation_leaves_the_step_to_the_leader(tmp_path: os.PathLike[str]) -> None:
    """A rank's own SIGTERM on one node of several: the agent cannot name a step for the other
    nodes' ranks, so it writes none (the ranks agree at their backstop)."""
    tmp = str(tmp_path)
    gen = generation(tmp, members=2)
    gen.ranks[0].step = gen.ranks[1].step = 7
    gen.on_beat(Beat(kind=BeatKind.STOP_REQUESTED, rank=1, pid=1, generation=3, step=7))
    assert gen.stop_at == 0 and not os.path.exists(gen.stop_file)


def test_boundaries_steps_apart_stop_at_the_first_at_or_past_the_named_step(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Model.train in data sink mode calls back once per sink (every 10 steps here): the named step 15
    falls inside a sink, so the ranks stop at 20, the first boundary past it; the backstop (every 25)
    is agreed at the first boundary past each multiple (30), never skipped."""
    stop_file = os.path.join(str(tmp_path), "g000003.stop")
    with open(stop_file, "wb") as f:
        f.write(contract.encode_stop_step(15))
    ctx = context(stop_file, interval=25)
    allreduce = Collective(others=0.0)
    monkeypatch.setattr(ctx, "allreduce", allreduce)
    assert not ctx.should_stop(10, 0) and allreduce.sent == []
    ctx._on_sigterm(15, None)
    assert ctx.should_stop(20, 10) and ctx.stop_at == 15 and not ctx._overshot
    fresh = context(stop_file, interval=25)
    monkeypatch.setattr(fresh, "allreduce", allreduce)
    assert not fresh.should_stop(20, 10) and allreduce.sent == []
    assert not fresh.should_stop(30, 20) and allreduce.sent == [0.0]  # 25 lies between: agreed at 30
