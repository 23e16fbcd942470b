"""Devices as the slots (issue #32), the pure parts: the ids a node lists or its tools show, and
which member of a plan gets which (the launch with them: tests/integration/test_devices.py)."""

from __future__ import annotations

import dataclasses

import pytest

from mselastic.core import devices
from mselastic.core.model import GenerationReport, MalformedRecord, Member, NodeRecord, Plan
from mselastic.core.spec import forbidden_env
from mselastic.core.states import GenerationState
from mselastic.daemon.settings import Settings, SettingsError


def test_device_ids_as_listed_and_as_the_tools_show_them() -> None:
    assert devices.parse_ids("0-7") == tuple(range(8))
    assert devices.parse_ids("6, 0-3") == (0, 1, 2, 3, 6)
    assert devices.format_ids((0, 1, 2, 3, 6)) == "0-3,6" and devices.format_ids(()) == ""
    for bad, why in (("0-", "not a device id"), ("3-1", "ends before"), ("0,0", "twice"), ("gpu0", "not a device"),
                     ("0-5000", "more than 1024")):
        with pytest.raises(ValueError, match=why):
            devices.parse_ids(bad)
    smi = ("GPU 0: NVIDIA H200 (UUID: GPU-1b2c)\nGPU 1: NVIDIA H200 (UUID: GPU-3d4e)\n"
           "  MIG 1g.18gb Device 0: (UUID: MIG-aa)\n")
    assert devices.nvidia_smi_ids(smi) == (0, 1)
    assert devices.davinci_ids(["davinci0", "davinci_manager", "davinci3", "devmm_svm", "davinci12"]) == (0, 3, 12)
    assert devices.visible_env("gpu", (2, 3)) == {"CUDA_VISIBLE_DEVICES": "2,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert devices.visible_env("ascend", (4,)) == {"ASCEND_RT_VISIBLE_DEVICES": "4"}
    assert devices.visible_env("", ()) == {} and devices.visible_env("gpu", ()) == {}


def _node(node_id: str, ids: tuple[int, ...] = (), kind: str = "gpu") -> NodeRecord:
    return NodeRecord(node_id, f"{node_id}:7070", node_id, len(ids) or 2, "v", device_kind=kind if ids else "",
                      devices=ids)


def _plan(job: str, generation: int, *members: tuple[str, int]) -> Plan:
    ms = tuple(Member(n, i, w, f"{n}:7070", n) for i, (n, w) in enumerate(members))
    return Plan(job, generation, ms, sum(w for _, w in members), ms[0].host, 29500, 0, "")


def test_two_jobs_on_one_node_get_disjoint_devices_kept_across_relaunches() -> None:
    nodes = {"n0": _node("n0", (0, 1, 2, 3)), "n1": _node("n1", (0, 1, 2, 3), "ascend"), "cpu": _node("cpu")}
    held: dict[str, dict[int, str]] = {}
    a = devices.assign(_plan("a", 1, ("n0", 2), ("n1", 2)), nodes, held)
    assert [(m.devices, m.device_kind) for m in a.members] == [((0, 1), "gpu"), ((0, 1), "ascend")]
    devices.hold(held, "a", a)
    b = devices.assign(_plan("b", 1, ("n0", 2), ("cpu", 2)), nodes, held)
    assert [(m.devices, m.device_kind) for m in b.members] == [((2, 3), "gpu"), ((), "")]
    devices.hold(held, "b", b)
    # a's relaunch keeps its devices, in their order (rank i on the same device)
    before = dataclasses.replace(a, members=(dataclasses.replace(a.members[0], devices=(1, 0)), a.members[1]))
    again = devices.assign(_plan("a", 2, ("n0", 2), ("n1", 2)), nodes, {"n0": {1: "a", 0: "a", 2: "b", 3: "b"}},
                           before)
    assert again.members[0].devices == (1, 0)
    # a third job finds no free device on n0
    with pytest.raises(devices.NoDevices, match="node n0 has 0 free device.*held by: a, b"):
        devices.assign(_plan("c", 1, ("n0", 1)), nodes, held)
    # a device gone from the node's list is not given again: the rank that had it gets a free one
    nodes["n0"] = _node("n0", (0, 2, 3))
    moved = devices.assign(_plan("a", 3, ("n0", 2)), nodes, {"n0": {3: "b"}}, before)
    assert moved.members[0].devices == (0, 2)


def test_device_ids_in_etcd_records_are_checked() -> None:
    plan = devices.assign(_plan("a", 1, ("n0", 2)), {"n0": _node("n0", (4, 5))}, {})
    assert Plan.from_json(plan.to_json()) == plan and plan.members[0].devices == (4, 5)
    node = _node("n0", (0, 1))
    assert NodeRecord.from_json(node.to_json()) == node
    assert NodeRecord.from_json('{"node_id": "x", "agent_address": "a", "host": "h", "slots": 1, "version": "v"}'
                                ).devices == ()
    for bad in ('"0-3"', "[0, 0]", "[-1]", "[true]", '["0"]'):
        with pytest.raises(MalformedRecord, match="devices"):
            NodeRecord.from_json(f'{{"node_id": "x", "agent_address": "a", "host": "h", "slots": 1, "version": "v", '
                                 f'"devices": {bad}}}')
    rep = GenerationReport("a", 1, "n0", GenerationState.RUNNING, devices=(2, 3))
    assert GenerationReport.from_json(rep.to_json()).devices == (2, 3)


def test_settings_and_specs_leave_devices_to_the_node() -> None:
    assert Settings(node_id="n0", devices="0-3", device_kind="gpu").validate().devices == "0-3"
    assert Settings(node_id="n0", devices="0-3", device_kind="gpu", slots=4).validate()
    for kw, why in ((dict(devices="0-3"), "device_kind: needed"), (dict(device_kind="gpu"), "without devices"),
                    (dict(devices="0-3", device_kind="tpu"), "must be one of gpu, ascend"),
                    (dict(devices="a-b", device_kind="gpu"), "devices: 'a-b' is not"),
                    (dict(devices="0-3", device_kind="gpu", slots=2), "slots: 2, but devices lists 4")):
        with pytest.raises(SettingsError, match=why):
            Settings(node_id="n0", **kw).validate()  # type: ignore[arg-type]
    assert forbidden_env({"CUDA_VISIBLE_DEVICES": "0-7", "ASCEND_RT_VISIBLE_DEVICES": "0", "DEVICE_ID": "1",
                          "OK": "1"}) == ["ASCEND_RT_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES", "DEVICE_ID"]


def test_a_failed_ranks_log_blames_its_device_only_in_the_vendors_words() -> None:
    for line in ("RuntimeError: CUDA error: uncorrectable ECC error encountered",
                 "CUDA_ERROR_ECC_UNCORRECTABLE", "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
                 "[ERROR] RUNTIME: The device 3 has a UCE error", "EL0004: HBM multi-bit ECC error on device 2"):
        assert devices.device_error(f"step 10 loss 0.3\n{line}\nTraceback ...\n") == line, line
    for line in ("RuntimeError: CUDA out of memory", "ValueError: shapes (3,) and (4,) not aligned",
                 "an error in the device_map config", "Traceback: educe failed"):
        assert devices.device_error(line) == "", line


def test_a_device_set_aside_is_none_of_its_nodes_slots_until_its_time_is_up() -> None:
    from mselastic.core.model import DeviceCordon
    nodes = [_node("n0", (0, 1, 2, 3)), _node("cpu")]
    cordons = {"n0": [DeviceCordon("n0", 1, "ecc", 100.0, 200.0), DeviceCordon("n0", 3, "by hand", 100.0)]}
    now = devices.usable(nodes, cordons, 150.0)
    assert (now[0].devices, now[0].slots) == ((0, 2), 2) and now[1] == nodes[1]
    later = devices.usable(nodes, cordons, 250.0)
    assert (later[0].devices, later[0].slots) == ((0, 1, 2), 3)


def test_a_device_failure_is_not_blamed_on_its_node() -> None:
    from mselastic.core.planner import Action, decide
    from mselastic.core.spec import JobSpec
    from mselastic.core.states import FailureCause, JobState
    spec = JobSpec(name="a", script="/t.py", checkpoint_dir="/c", workers_per_node=2, min_nodes=1, max_nodes=1,
                   total_steps=10, global_batch_size=4, quarantine_after_failures=1)
    plan = devices.assign(_plan("a", 1, ("n0", 2)), {"n0": _node("n0", (0, 1, 2, 3))}, {})
    for cause, blamed in ((FailureCause.DEVICE, {}), (FailureCause.RANK_EXITED, {"n0": 1})):
        rep = GenerationReport("a", 1, "n0", GenerationState.FAILED, failed_rank=1, reason="x", cause=cause)
        d = decide(spec, JobState.RUNNING, plan, {"n0": rep}, [_node("n0", (0, 2, 3))], now=10.0)
        assert d.node_failures == blamed, (cause, d)
        assert (d.action is Action.LAUNCH) == (cause is FailureCause.DEVICE), d  # (else: quarantined at once)


def test_a_nodes_devices_by_state_for_the_metrics() -> None:
    from mselastic.core.model import DeviceCordon
    nodes = [_node("n0", (0, 1, 2, 3)), _node("cpu")]
    held = {"n0": {0: "a", 1: "a", 7: "x"}}
    cordons = {"n0": [DeviceCordon("n0", 1, "ecc", 0.0), DeviceCordon("n0", 3, "old", 0.0, 5.0)]}
    assert devices.states(nodes, held, cordons, 10.0) == {"n0": {"in_use": 1, "unhealthy": 1, "free": 2}}


def test_a_device_set_aside_under_a_running_job_moves_nothing_and_is_no_lost_node() -> None:
    """A device of the node set aside while a job trains there on all of it (an operator's cordon,
    a device gone): the job's generation goes on (its node is not lost), and only its next plan
    cannot use the node (its free devices are fewer than its ranks)."""
    from mselastic.core.model import DeviceCordon, JobStatus
    from mselastic.core.planner import Action, blame_of, decide
    from mselastic.core.spec import JobSpec
    from mselastic.core.states import JobState
    from mselastic.daemon import admission
    spec = JobSpec(name="a", script="/t.py", checkpoint_dir="/c", workers_per_node=2, min_nodes=1, max_nodes=1,
                   total_steps=10, global_batch_size=4)
    raw = [_node("n0", (0, 1))]
    plan = devices.assign(_plan("a", 1, ("n0", 2)), {"n0": raw[0]}, {})
    usable = devices.usable(raw, {"n0": [DeviceCordon("n0", 1, "by hand", 0.0)]}, 10.0)
    held = {"n0": {0: "a", 1: "a"}}
    free, _ = admission.free_slots("a", usable, {"a": {"n0": 2}}, "", True, held)
    assert free == {"n0": 1}
    running = {"n0": GenerationReport("a", 1, "n0", GenerationState.RUNNING, step=3)}
    d = decide(spec, JobState.RUNNING, plan, running, raw, now=10.0, status=JobStatus(JobState.RUNNING, generation=1),
               free_slots=free)
    assert d.action is Action.NOTHING and not blame_of(d).lost_nodes, d
    # Another job on a device set aside since is not counted twice: b holds 1 (aside) and 2.
    usable4 = devices.usable([_node("n0", (0, 1, 2, 3))], {"n0": [DeviceCordon("n0", 1, "ecc", 0.0)]}, 10.0)
    free, _ = admission.free_slots("c", usable4, {"b": {"n0": 2}}, "", False, {"n0": {1: "b", 2: "b"}})
    assert free == {"n0": 2}  # (0 and 3)


def test_a_plan_is_launched_only_on_devices_the_node_has_and_no_other_job_uses() -> None:
    from mselastic.agent.devices.health import unfit
    m = devices.assign(_plan("a", 1, ("n0", 2)), {"n0": _node("n0", (0, 1, 2, 3))}, {}).members[0]
    assert unfit(m, "gpu", (0, 1, 2, 3), {}) == (False, "")
    assert unfit(m, "gpu", (0, 1, 2, 3), {"b": (1, 2)}) == (
        False, "devices 1 are still used by job b's generation here; launched once it has ended")
    assert unfit(m, "ascend", (0, 1, 2, 3), {})[0] and unfit(m, "gpu", (2, 3), {})[0]
    bare = Member("n0", 0, 2, "n0:7070", "n0")
    lasting, why = unfit(bare, "gpu", (0, 1), {})
    assert lasting and "no devices; it has gpu devices 0-1" in why
    assert unfit(m, "", (), {})[0] and unfit(bare, "", (), {}) == (False, "")


def test_the_leaders_series_of_a_node_or_job_gone_are_removed() -> None:
    """The devices by state, each job's state (1 for the current one), and whether a node is
    registered: set from the leader's view, removed once what they name is gone."""
    from mselastic import metrics
    from mselastic.core.states import JobState

    def series(gauge: object) -> dict[tuple[str, ...], float]:
        return {tuple(s.labels.values()): s.value for m in gauge.collect() for s in m.samples  # type: ignore[attr-defined]
                if next(iter(s.labels.values())).startswith("t-")}

    shown = metrics.show_cluster({"t-n0": {"in_use": 1, "free": 2, "unhealthy": 1}, "t-n1": {"free": 4}},
                                 {"t-a": JobState.RUNNING, "t-b": JobState.FAILED}, {"t-n0": True, "t-n1": False}, {})
    assert {("t-n0", "free"), ("t-n1", "free")} <= set(series(metrics.DEVICES))
    states = series(metrics.JOB_STATE)
    assert states[("t-a", "RUNNING")] == 1 and states[("t-a", "PENDING")] == 0 and states[("t-b", "FAILED")] == 1
    assert len(states) == 2 * len(JobState)
    assert series(metrics.NODE_REGISTERED) == {("t-n0",): 1, ("t-n1",): 0}
    shown = metrics.show_cluster({"t-n0": {"in_use": 2, "free": 1, "unhealthy": 1}}, {"t-a": JobState.SUCCEEDED},
                                 {"t-n0": True}, shown)
    assert not {s for s in series(metrics.DEVICES) if s[0] == "t-n1"} and ("t-n0", "in_use") in series(metrics.DEVICES)
    assert {s[0] for s in series(metrics.JOB_STATE)} == {"t-a"} and series(metrics.JOB_STATE)[("t-a", "SUCCEEDED")] == 1
    assert series(metrics.NODE_REGISTERED) == {("t-n0",): 1}
    assert metrics.show_cluster({}, {}, {}, shown) == {metrics.DEVICES: set(), metrics.JOB_STATE: set(),
                                                      metrics.NODE_REGISTERED: set()}
    assert not series(metrics.DEVICES) and not series(metrics.JOB_STATE) and not series(metrics.NODE_REGISTERED)


def test_the_planners_launch_comes_with_its_devices_assigned_or_waits_for_them() -> None:
    """#48: the decision is whole when it is made: decide() given the usable nodes and the devices
    other jobs hold returns a launch whose members carry their devices (the free ones, lowest
    first); a node short of free devices puts the launch off (NOTHING, saying why), and without
    the devices nothing is assigned (the decision as before)."""
    from mselastic.core.planner import NO_DEVICES, Action, decide
    from mselastic.core.spec import JobSpec
    from mselastic.core.states import JobState

    spec = JobSpec(name="j", script="/s.py", checkpoint_dir="/c", workers_per_node=2, min_nodes=1, max_nodes=1)
    n0 = dataclasses.replace(_node("n0", (0, 1, 2, 3)), create_revision=1)
    d = decide(spec, JobState.PENDING, None, {}, [n0], devices={"n0": n0}, devices_held={"n0": {0: "other"}})
    assert d.action is Action.LAUNCH and d.plan is not None and d.plan.members[0].devices == (1, 2)
    d = decide(spec, JobState.PENDING, None, {}, [n0], devices={"n0": n0},
               devices_held={"n0": {0: "a", 1: "a", 2: "b"}})
    assert d.action is Action.NOTHING and d.reason.startswith(NO_DEVICES) and "1 free device(s)" in d.reason, d
    d = decide(spec, JobState.PENDING, None, {}, [n0])
    assert d.action is Action.LAUNCH and d.plan is not None and d.plan.members[0].devices == ()
