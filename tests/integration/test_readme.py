"""The README's trainer snippet, extracted from the README (not copied), runs under elasticd: it
trains, a rank SIGKILLed mid-run is recovered, and the next generation resumes from the
checkpoint of step 10 and finishes."""

from __future__ import annotations

import os
import re

import pytest

from mselastic.core.states import GenerationState, JobState
from tests.harness import DATA_DIR, REPO, Etcd, Processes, elasticctl, lenet_spec, start_node, wait_for

pytestmark = pytest.mark.slow
MARK = "<!-- trainer-snippet -->"


def snippet() -> str:
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    found = re.search(re.escape(MARK) + r"\s*```python\n(.*?)```", text, re.S)
    assert found, f"README.md has no python block after {MARK}"
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
