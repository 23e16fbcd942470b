"""job_uids: the setting's checks and the user a job of that range runs as (the isolation itself:
tests/integration/test_containment.py)."""

from __future__ import annotations

import pytest

from mselastic.agent.containment.users import WorkerUser
from mselastic.daemon.settings import Settings, SettingsError


def test_job_uids_must_be_a_usable_range() -> None:
    assert Settings(node_id="n0", job_uids="62000-62999").validate().job_uid_range == range(62000, 63000)
    assert Settings(node_id="n0").job_uid_range is None
    for bad in ("62000", "a-b", "500-600", "70000-60000", "1000-200000", "62000-2147483647"):
        with pytest.raises(SettingsError, match="job_uids: .* must"):
            Settings(node_id="n0", job_uids=bad).validate()


def test_a_jobs_user_has_no_passwd_entry_and_its_own_group_alone() -> None:
    worker = WorkerUser("mselastic", 998, 997)
    job = worker.for_job(62000)
    assert (job.uid, job.gid, job.groups, job.passwd) == (62000, 62000, frozenset(), False)
    assert job.setpriv_args() == ["--reuid=62000", "--regid=62000", "--clear-groups"]
    assert WorkerUser("root", 0, 0).for_job(62001).setpriv_args() == ["--reuid=62001", "--regid=62001",
                                                                       "--clear-groups"]
    assert worker.setpriv_args() == ["--reuid=998", "--regid=997", "--init-groups"]
    assert WorkerUser("x", 5, 5, frozenset({7, 6}), passwd=False).setpriv_args()[2] == "--groups=6,7"


def test_an_etcd_other_machines_reach_needs_credentials_and_a_ca_of_its_own(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """etcd decides what every node runs: plaintext without a user off loopback is refused (unless
    insecure), and so is an etcd CA that is the cluster's (its admin and viewer certificates would
    write to etcd)."""
    from mselastic import tls

    with pytest.raises(SettingsError, match="etcd_endpoint: 10.0.0.2:2379 is reachable from other machines"):
        Settings(node_id="n0", etcd_endpoint="127.0.0.1:2379,10.0.0.2:2379").validate()
    assert Settings(node_id="n0", etcd_endpoint="10.0.0.2:2379", insecure=True).validate()
    # (#49: the two are apart: each lets one thing, and says which in its refusal.)
    assert Settings(node_id="n0", etcd_endpoint="10.0.0.2:2379", insecure_etcd=True).validate()
    with pytest.raises(SettingsError, match="listen: 10.0.0.1:7070 is reachable .* set insecure_listen = true"):
        Settings(node_id="n0", etcd_endpoint="10.0.0.2:2379", listen="10.0.0.1:7070", insecure_etcd=True).validate()
    with pytest.raises(SettingsError, match="etcd_endpoint: 10.0.0.2:2379 .* set insecure_etcd = true"):
        Settings(node_id="n0", etcd_endpoint="10.0.0.2:2379", listen="10.0.0.1:7070", insecure_listen=True).validate()
    assert Settings(node_id="n0", etcd_endpoint="10.0.0.2:2379", listen="10.0.0.1:7070", insecure_listen=True,
                    insecure_etcd=True).validate()
    assert Settings(node_id="n0", etcd_endpoint="10.0.0.2:2379", etcd_user="u", etcd_password="p").validate()
    cluster, own = str(tmp_path / "cluster"), str(tmp_path / "etcd")
    ca, _ = tls.make_ca(cluster)
    etcd_ca, _ = tls.make_ca(own, name="etcd CA")
    cert, key = tls.issue(own, "n0", "admin")  # (a client certificate of etcd's CA: its CN is the etcd user)
    node_cert, node_key = tls.issue(cluster, "n0", "node", ("10.0.0.1",))
    base = dict(node_id="n0", etcd_endpoint="10.0.0.2:2379", listen="10.0.0.1:7070", tls_cert=node_cert,
                tls_key=node_key, tls_cacert=ca, etcd_cert=cert, etcd_key=key)
    assert Settings(**base, etcd_cacert=etcd_ca).validate()
    with pytest.raises(SettingsError, match="etcd_cacert: .* is the cluster's CA"):
        Settings(**base, etcd_cacert=ca).validate()
