"""The pure parts of mselastic.agent.containment.cgroups: which hierarchies a node has, a job's limits, the
prefix that puts a process in its cgroup (the cgroups themselves: tests/integration/test_containment.py)."""

from __future__ import annotations

import subprocess

import pytest

from mselastic.agent.containment import cgroups
from mselastic.core.spec import JobSpec, SpecError
from mselastic.daemon.settings import Settings, SettingsError

HYBRID = """\
25 24 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
27 25 0:24 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
28 25 0:25 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
29 25 0:26 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
"""
PURE_V2 = "30 24 0:27 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate\n"


def test_the_hierarchies_of_a_hybrid_and_a_pure_v2_node() -> None:
    v2, v1 = cgroups.mounts(HYBRID)
    assert v2 == "/sys/fs/cgroup/unified"
    assert v1["memory"] == "/sys/fs/cgroup/memory" and v1["pids"] == "/sys/fs/cgroup/pids"
    assert v1["cpuacct"] == "/sys/fs/cgroup/cpu,cpuacct"
    assert cgroups.mounts(PURE_V2) == ("/sys/fs/cgroup", {})


def test_a_process_cgroup_per_hierarchy() -> None:
    mine = cgroups.own("9:name=systemd:/\n4:memory:/process_api/abc\n2:cpu,cpuacct:/x\n0::/system.slice/e.service\n")
    assert mine[""] == "/system.slice/e.service" and mine["memory"] == "/process_api/abc" and mine["cpuacct"] == "/x"


def test_a_jobs_limits_are_its_specs_never_above_the_nodes() -> None:
    assert cgroups.effective(0, 4096) == 4096
    assert cgroups.effective(100, 4096) == 100
    assert cgroups.effective(10**6, 4096) == 4096
    memory, tasks = cgroups.default_limits(0, 0)
    total = cgroups.node_memory_bytes()
    assert total // 2 <= memory <= total - 2**30 or memory == total // 2
    assert tasks >= 1024
    assert cgroups.default_limits(2048, 500) == (2048 * 2**20, 500)


def test_the_join_prefix_puts_the_process_in_each_cgroup_then_execs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With plain files for cgroup.procs: each gets the pid the command then runs as."""
    layout = cgroups.Layout("hybrid", str(tmp_path / "u"), True, memory=str(tmp_path / "m"))
    group = cgroups.Group(layout, "job/gen-1")
    for f in group.procs_files():
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
    adj = int(open("/proc/self/oom_score_adj").read())
    out = subprocess.run([*cgroups.join_prefix([group], oom_score_adj=max(adj, 0) + 1), "/bin/sh", "-c",
                          "echo $$; cat /proc/$$/oom_score_adj"], capture_output=True, text=True, check=True)
    pid, score = out.stdout.split()
    assert int(score) == max(adj, 0) + 1
    assert [open(f).read().strip() for f in group.procs_files()] == [pid, pid]
    (tmp_path / "m/job/gen-1/cgroup.procs").unlink()
    (tmp_path / "m/job/gen-1").rmdir()
    assert subprocess.run([*cgroups.join_prefix([group]), "/bin/true"]).returncode == 126  # (cannot join: not run)


def test_spec_and_settings_refuse_limits_no_job_could_start_under() -> None:
    base = dict(name="j", script="/s.py", checkpoint_dir="/c")
    assert JobSpec.from_dict({**base, "memory_limit_mb": 4096, "max_processes": 512}).memory_limit_mb == 4096
    with pytest.raises(SpecError, match="field 'memory_limit_mb': must be 0 .* or at least 256"):
        JobSpec.from_dict({**base, "memory_limit_mb": 100})
    with pytest.raises(SpecError, match="field 'max_processes'"):
        JobSpec.from_dict({**base, "max_processes": 10})
    with pytest.raises(SpecError, match="field 'max_processes': must be >= 0"):
        JobSpec.from_dict({**base, "max_processes": -1})
    with pytest.raises(SettingsError, match="cgroups: must be auto, required or off"):
        Settings(node_id="n0", cgroups="yes").validate()


def test_on_pure_v2_the_limits_go_to_the_v2_files_with_their_controllers_handed_down(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A pure v2 node (unrun on these hybrid machines: the files, as plain files): every job together
    held by the subtree's memory.max and pids.max, the controllers handed to the jobs' groups and
    from each job's group to its generations; a limit written again only when it changes."""
    root = str(tmp_path)
    layout = cgroups.Layout("v2", root, True, memory=root, memory_v2=True, pids=root, pids_v2=True)
    tree = cgroups.Tree(layout, cgroups.Limits(8 << 30, 16000))
    read = lambda *p: (tmp_path.joinpath(*p)).read_text()  # noqa: E731
    assert read("cgroup.subtree_control") == "+memory +pids"
    assert (read("memory.max"), read("pids.max")) == (str(8 << 30), "16000")
    tree.job("a", cgroups.Limits(768 << 20, 256))
    assert (read("a", "memory.max"), read("a", "pids.max"), read("a", "cgroup.subtree_control")) == \
        (str(768 << 20), "256", "+memory +pids")
    tmp_path.joinpath("a", "pids.max").write_text("max")
    tree.job("a", cgroups.Limits(768 << 20, 256))  # (the same: not written again)
    assert read("a", "pids.max") == "max"
    tree.job("a", cgroups.Limits(1 << 30, 512))
    assert (read("a", "memory.max"), read("a", "pids.max")) == (str(1 << 30), "512")
    assert layout.v2_limits() == "+memory +pids" and cgroups.Layout("hybrid", root, True).v2_limits() == ""


def test_members_are_signalled_and_moved_only_while_they_are_the_process_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With plain files for cgroup.procs: a member listed there is signalled through a pidfd; a
    process is moved only while its pidfd says it has not exited."""
    import os
    import signal
    root = str(tmp_path)
    layout = cgroups.Layout("hybrid", root, True)
    group = cgroups.Group(layout, "job").make()
    child = subprocess.Popen(["sleep", "30"])
    try:
        fd = os.pidfd_open(child.pid)
        gen = group.child("gen").make()
        gen.move(child.pid, fd)
        assert (tmp_path / "job/gen/cgroup.procs").read_text() == str(child.pid)
        group.signal(signal.SIGTERM)
        assert child.wait(5) == -signal.SIGTERM
        with pytest.raises(cgroups.CgroupError, match="it ended"):
            gen.move(child.pid, fd)
        os.close(fd)
    finally:
        child.kill()
        child.wait()
