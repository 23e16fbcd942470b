"""job_uids: the setting's checks and the user a job of that range runs as (the isolation itself:
tests/integration/test_containment.py)."""

from __future__ import annotations

import pytest

from mselastic.agent.users import WorkerUser
from mselastic.daemon.settings import Settings, SettingsError


def test_job_uids_must_be_a_usable_range() -> None:
    assert Settings(node_id="n0", job_uids="62000-62999").validate().job_uid_range == range(62000, 63000)
    assert Settings(node_id="n0").job_uid_range is None
    for bad in ("62000", "a-b", "500-600", "70000-60000", "1000-200000", "62000-2147483647"):
        with pytest.raises(SettingsError, match="job_uids: .* must"):
            Settings(node_id="n0", job_uids=bad).validate()


def test_a_jobs_user_has_no_passwd_entry_its_own_group_and_the_workers_but_never_roots() -> None:
    worker = WorkerUser("mselastic", 998, 997)
    job = worker.for_job(62000)
    assert (job.uid, job.gid, job.groups, job.passwd) == (62000, 62000, frozenset({997}), False)
    assert job.setpriv_args() == ["--reuid=62000", "--regid=62000", "--groups=997"]
    assert WorkerUser("root", 0, 0).for_job(62001).setpriv_args() == ["--reuid=62001", "--regid=62001",
                                                                       "--clear-groups"]
    assert worker.setpriv_args() == ["--reuid=998", "--regid=997", "--init-groups"]
