"""The README and the getting-started guide, run as written. The user guide's trainer snippet,
extracted from docs/user-guide.md (not copied), runs under elasticd: it trains, a rank SIGKILLed
mid-run is recovered, and the next generation resumes from the checkpoint of step 10 and
finishes. The command blocks (marked ``<!-- readme-run: NAME -->``: the README's one machine,
then docs/getting-started.md's) run in order as a user would type them: as root, and as a user
with a venv of their own."""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import socket
import subprocess
import sysconfig

import psutil
import pytest

from mselastic.core.states import GenerationState, JobState
from tests import doc_blocks
from tests.harness import (DATA_DIR, REPO, TEST_MARK, VENV_BIN, Etcd, Processes, elasticctl, lenet_spec, start_node,
                           wait_for)

pytestmark = pytest.mark.slow
MARK = "<!-- trainer-snippet -->"


def snippet() -> str:
    with open(os.path.join(REPO, "docs", "user-guide.md")) as f:
        text = f.read()
    found = re.search(re.escape(MARK) + r"\s*```python\n(.*?)```", text, re.S)
    assert found, f"docs/user-guide.md has no python block after {MARK}"
    return found.group(1)


def test_the_readme_snippet_is_complete_and_resumes(procs: Processes, etcd: Etcd, namespace: str,
                                                    tmp_path: os.PathLike[str], digits: str) -> None:
    tmp = str(tmp_path)
    script = os.path.join(tmp, "train.py")
    with open(script, "w") as f:
        f.write(snippet())
    endpoint = start_node(procs, etcd, namespace, os.path.join(tmp, "work"))
    spec = lenet_spec(os.path.join(tmp, "job.toml"), "readme", tmp, os.path.join(tmp, "ckpt"), total_steps=20,
                      script=script, args=[DATA_DIR], checkpoint_interval_steps=5,
                      env={"MSELASTIC_FAULT": "sigkill:rank=1:generation=1:step=12"})
    r = elasticctl("submit", spec, endpoint=endpoint)
    assert r.returncode == 0, r.stderr
    status = wait_for("the job to end", lambda: (s := etcd.status("readme")) and s.state.terminal and s, 240, 0.5)
    assert status.state is JobState.SUCCEEDED and status.generation == 2, status.message
    first, second = etcd.report("readme", 1, "n0"), etcd.report("readme", 2, "n0")
    assert first is not None and first.state is GenerationState.FAILED and first.failed_rank == 1, first
    assert second is not None and second.resumed_step == 10 and second.step == 20, second


# -- the README's command blocks, run as written ----------------------------------------------

DEFAULT_SOCKET = "/run/mselastic/elasticd.sock"
#: The pages with blocks, in the order a reader follows them, and their blocks in order.
PAGES = {"README.md": ("one machine",), "docs/getting-started.md": ("then", "a failed job", "starting over")}
#: What the blocks need of a clone: the example, its data (made by `make`), and a venv.
WORKSPACE = ("examples/lenet/train.py", "examples/lenet/job.toml", "examples/lenet/long.toml",
             "examples/lenet/fails.toml")


def readme_blocks() -> dict[str, str]:
    found: dict[str, str] = {}
    for page, names in PAGES.items():
        blocks = doc_blocks.blocks(page)
        assert tuple(blocks) == names, f"{page}'s runnable blocks are {tuple(blocks)}, this test knows {names}"
        found.update(blocks)
    return found


def ports_free() -> bool:
    """The README's defaults (etcd 2379, elasticd 7070, metrics 9464) are this machine's to take."""
    for port in (2379, 2380, 7070, 9464):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return False
    return True


def workspace(root: str, owner: int) -> str:
    """What a clone has that the blocks use, in a folder of ``owner``'s: the example, the data."""
    ws = os.path.join(root, "mselastic")
    for rel in WORKSPACE:
        os.makedirs(os.path.dirname(os.path.join(ws, rel)), exist_ok=True)
        shutil.copy(os.path.join(REPO, rel), os.path.join(ws, rel))
    os.makedirs(os.path.join(ws, "build", "data"))
    shutil.copytree(DATA_DIR, os.path.join(ws, "build", "data", "digits"))
    for d, dirs, files in os.walk(root):
        for name in [d, *(os.path.join(d, n) for n in dirs + files)]:
            os.chown(name, owner, -1)
    return ws


def run_blocks(procs: Processes, home: str, ws: str, user: str, names: tuple[str, ...]) -> str:
    """The blocks as ``user`` (a clean environment: HOME, a PATH without the venv), until they end;
    returns what they printed."""
    script = os.path.join(home, "readme.sh")
    with open(script, "w") as f:
        f.write(doc_blocks.as_script([readme_blocks()[n] for n in names]))
    env = ["env", "-i", f"HOME={home}", "PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8", f"WS={ws}",
           f"{TEST_MARK}={procs.mark}"]
    who = [] if user == "root" else ["setpriv", f"--reuid={user}", f"--regid={pwd.getpwnam(user).pw_gid}",
                                      "--clear-groups"]
    p = procs.start(f"readme-{user}", [*who, *env, "bash", script])
    try:
        rc = p.wait(timeout=600)
    finally:
        with open(os.path.join(procs.log_dir, f"readme-{user}.log"), errors="replace") as f:
            printed = f.read()
        print(printed[-6000:])
    assert rc == 0, printed[-3000:]
    return printed


@pytest.fixture
def readme_home(shared_tmp: str) -> str:
    """A home and a clone for the README's user, reachable by that user (pytest's folders are root's)."""
    try:  # (the previous run's elasticd and etcd may be closing them still)
        wait_for("the README's default ports free", ports_free, 20, 0.2)
    except AssertionError:
        pytest.skip("the README's default ports (2379, 2380, 7070, 9464) are in use on this machine")
    return shared_tmp


def test_the_quick_start_runs_as_written_as_root(procs: Processes, readme_home: str) -> None:
    """As root, with this venv (its Python may live under /root, as with pyenv): the job trains to
    the end, run as root because the README says to run it as oneself."""
    with socket.socket(socket.AF_UNIX) as s:
        if s.connect_ex(DEFAULT_SOCKET) == 0:
            pytest.skip(f"an elasticd of this machine answers on {DEFAULT_SOCKET}")
    ws = workspace(readme_home, 0)
    os.symlink(os.path.join(REPO, ".venv"), os.path.join(ws, ".venv"))
    printed = run_blocks(procs, readme_home, ws, "root", ("one machine",))
    assert re.search(r"lenet SUCCEEDED gen=1 world=2 step=60/60", printed), printed[-2000:]


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3.11"), reason="needs a Python 3.11 every user may run")
def test_the_readme_runs_as_written_as_a_user_with_a_venv_of_their_own(procs: Processes, readme_home: str) -> None:
    """Every block, in order, as nobody, with a venv nobody made from a Python every user may run
    (not this venv, whose Python may be under /root). Its packages are this venv's, added to its
    path (installing MindSpore again would take minutes): what matters here is that nothing of
    the user's run needs root's files. The two-node block moves a job with restart, drain,
    uncordon and scale, and stops it; starting over is refused with the reason, then trains."""
    nobody = pwd.getpwnam("nobody")
    ws = workspace(readme_home, nobody.pw_uid)
    venv = os.path.join(ws, ".venv")
    subprocess.run(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
                    "/usr/bin/python3.11", "-m", "venv", "--without-pip", venv], check=True, timeout=60)
    site = os.path.join(venv, "lib", "python3.11", "site-packages")
    with open(os.path.join(site, "borrowed.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    for tool in ("elasticd", "elasticctl", "msrun"):  # the console scripts, on the user's interpreter
        with open(os.path.join(VENV_BIN, tool)) as f:
            body = f.read().split("\n", 1)[1]
        with open(os.path.join(venv, "bin", tool), "w") as f:
            f.write(f"#!{venv}/bin/python3.11\n{body}")
        os.chmod(os.path.join(venv, "bin", tool), 0o755)
    printed = run_blocks(procs, readme_home, ws, "nobody", tuple(n for names in PAGES.values() for n in names))
    # One machine: the job trained to its end, as nobody.
    assert re.search(r"lenet SUCCEEDED gen=1 world=2 step=60/60", printed), printed[-2000:]
    # Then: two nodes; the job ran on both, was restarted, drained off n1, narrowed to one node, stopped.
    assert re.search(r"long RUNNING gen=1 world=4 step=[1-9]\d*/3000", printed), "the job did not train on both nodes"
    events = printed.split("+ elasticctl events long\n")[1].split("+ elasticctl logs")[0]
    assert re.search(r"generation 2 on n0, n1 \(world size 4.*restart requested", events), events
    assert re.search(r"generation 3 on n0 \(world size 2.*drain of n1", events), events
    assert "the ranks checkpointed at step" in events, events  # the stop: at a step, not killed
    assert re.search(r"n1\s.*Ready", printed), "elasticctl nodes did not show n1"
    logs = printed.split("+ elasticctl logs long --rank 1\n")[1].split("+ elasticctl report")[0]
    assert re.search(r"step \d+/3000 loss", logs) and "[WARNING]" not in logs and "[INFO]" not in logs, logs
    assert os.path.getsize(os.path.join(ws, "timeline.png")) > 10_000
    # A failed job: watch exits 1 on it, describe names the rank and how it ended, its log the traceback.
    failed = printed.split("+ elasticctl watch fails\n")[1].split("+ elasticctl delete fails")[0]
    assert "fails FAILED" in failed and "rank 1" in failed, failed[-3000:]
    log = failed.split("+ elasticctl logs fails --rank 1\n")[1]
    assert "RuntimeError: injected fault at step 3" in log, log[-2000:]
    # Starting over: refused with the way out, then from step 0.
    assert "holds a checkpoint of step 60, at or past total_steps=60: this job is done there" in printed
    assert "final reports" not in printed  # (a shutdown after the jobs ended: nothing counted as a crash)
    # Everything the blocks started is gone once elasticd is stopped (kill -INT %2 %1 && wait).
    assert not [p for p in psutil.process_iter() if _marked(p, procs.mark)]
    assert not glob.glob(f"/dev/shm/mselastic-{nobody.pw_uid}/*/*"), "snapshot folders left"


def _marked(p: psutil.Process, mark: str) -> bool:
    try:
        return p.environ().get(TEST_MARK) == mark and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
