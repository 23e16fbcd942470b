"""etcd backed up and restored as docs/operations.md ("Backup and restore") says, with the etcd
tools an operator has: a snapshot of the embedded etcd taken with `etcdctl snapshot save` while a
job trains, elasticd stopped, the snapshot restored into a new data folder, elasticd started
again: the cluster is what the snapshot holds, and the job goes on from its newest checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess

from mselastic.store.embedded import free_port
from mselastic.store.etcd import EtcdAuth
from tests.harness import (DATA_DIR, VENV_BIN, Etcd, Pace, Processes, elasticctl, elasticd_cmd, lenet_spec,
                           local_socket, wait_for)


def test_an_etcd_snapshot_taken_while_a_job_trains_restores_into_a_new_etcd_and_the_job_goes_on(
        procs: Processes, namespace: str, tmp_path: os.PathLike[str]) -> None:
    tmp = str(tmp_path)
    work = os.path.join(tmp, "w")
    etcd_dir, port = os.path.join(work, "etcd"), free_port()
    cmd = elasticd_cmd("n0", f"127.0.0.1:{port}", free_port(), work, namespace) + ["--embedded-etcd-dir", etcd_dir]
    endpoint = "unix:" + local_socket(work)
    elasticd = procs.start("elasticd-n0", cmd)
    wait_for("n0 serving", lambda: elasticctl("nodes", endpoint=endpoint).returncode == 0, 60, 0.3)
    pki = os.path.join(etcd_dir, "pki")
    etcd = Etcd(f"127.0.0.1:{port}", namespace, EtcdAuth(os.path.join(pki, "ca.pem"), os.path.join(pki, "etcd.pem"),
                                                         os.path.join(pki, "etcd-key.pem")))
    out, ckpt = os.path.join(tmp, "out"), os.path.join(tmp, "ckpt")
    pace = Pace(tmp, 0.2)
    spec = lenet_spec(os.path.join(tmp, "job.toml"), "lenet", out, ckpt, 30,
                      args=["--data", DATA_DIR, "--out", out, "--lr", "0.05", *pace.args])
    assert elasticctl("submit", spec, endpoint=endpoint).returncode == 0
    wait_for("step 6", lambda: (r := etcd.report("lenet", 1, "n0")) and r.step >= 6, 180, 0.2)

    # The backup, while the job trains (the operations guide's command, as written there).
    backup = os.path.join(tmp, "etcd-backup.db")
    etcdctl = [os.path.join(VENV_BIN, "etcdctl"), "--endpoints", f"https://127.0.0.1:{port}",
               "--cacert", os.path.join(pki, "ca.pem"), "--cert", os.path.join(pki, "etcd.pem"),
               "--key", os.path.join(pki, "etcd-key.pem")]
    saved = subprocess.run([*etcdctl, "snapshot", "save", backup], capture_output=True, text=True, timeout=60)
    assert saved.returncode == 0 and os.path.getsize(backup) > 0, saved.stderr
    at_backup = etcd.status("lenet")
    assert at_backup is not None and at_backup.generation == 1 and at_backup.state.value == "RUNNING", at_backup
    # A change the snapshot does not hold.
    assert elasticctl("cordon", "n0", "--reason", "after the backup", endpoint=endpoint).returncode == 0

    # Stopped with its jobs: the ranks checkpoint at a step, then the restore into a new folder.
    elasticd.send_signal(signal.SIGINT)
    assert elasticd.wait(timeout=90) == 0
    with open(os.path.join(ckpt, "latest.json")) as f:  # (the newest checkpoint: the stop's)
        manifest = json.load(f)["manifest"]
    with open(os.path.join(ckpt, manifest)) as f:
        stopped_at = json.load(f)["step"]
    assert stopped_at >= 6
    os.rename(os.path.join(etcd_dir, "member-data"), os.path.join(etcd_dir, "member-data.before-restore"))
    peer = f"https://127.0.0.1:{free_port()}"
    restored = subprocess.run([os.path.join(VENV_BIN, "etcdctl"), "snapshot", "restore", backup, "--data-dir",
                               os.path.join(etcd_dir, "member-data"), "--name", "default", "--initial-cluster",
                               f"default={peer}", "--initial-advertise-peer-urls", peer],
                              capture_output=True, text=True, timeout=60)
    assert restored.returncode == 0, restored.stderr

    # Started again on the restored etcd: the cordon made after the backup is gone, and the job
    # the snapshot holds RUNNING in generation 1 goes on from its newest checkpoint, not from the
    # snapshot's step.
    pace.release()
    procs.start("elasticd-n0-restored", cmd)
    nodes = wait_for("n0 serving again", lambda: (r := elasticctl("nodes", endpoint=endpoint)).returncode == 0 and r,
                     60, 0.3)
    assert "n0" in nodes.stdout and "Cordoned" not in nodes.stdout, nodes.stdout
    done = wait_for("the job to end", lambda: (s := etcd.status("lenet")) and s.state.terminal and s, 240, 0.5)
    assert done.state.value == "SUCCEEDED" and done.generation == 2 and done.restart_count <= 1, done
    report = etcd.report("lenet", 2, "n0")  # (the snapshot's generation 1, then one relaunch)
    assert report is not None and report.resumed_step >= stopped_at and report.step == 30, (report, stopped_at)
