"""elasticd as a service: the systemd unit (systemd-analyze verify), the notify protocol on a
real notify socket, the config file (every key documented, precedence, one-line errors)
and TLS on the gRPC port with real certificates."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import tomllib

import grpc
import psutil
import pytest

from mselastic.daemon.settings import Settings, SettingsError, parse_args
from mselastic.store.embedded import free_port
from tests.harness import REPO, VENV_BIN, Etcd, Processes, elasticd_cmd, lenet_spec, wait_for

UNIT = os.path.join(REPO, "mselastic", "systemd", "elasticd.service")
SAMPLE = os.path.join(REPO, "mselastic", "systemd", "elasticd.toml")


def _verify(unit_text: str, root: str) -> subprocess.CompletedProcess[str]:
    """systemd-analyze verify in a scratch root that has systemd's own units and the ExecStart binary."""
    shutil.copytree("/usr/lib/systemd/system", os.path.join(root, "usr/lib/systemd/system"), symlinks=True,
                    dirs_exist_ok=True)
    exe = os.path.join(root, "opt/mselastic/.venv/bin/elasticd")
    os.makedirs(os.path.dirname(exe), exist_ok=True)
    with open(exe, "w") as f:
        f.write("#!/bin/sh\n")
    os.chmod(exe, 0o755)
    unit = os.path.join(root, "etc/systemd/system/elasticd.service")
    os.makedirs(os.path.dirname(unit), exist_ok=True)
    with open(unit, "w") as f:
        f.write(unit_text)
    return subprocess.run(["systemd-analyze", f"--root={root}", "verify", unit], capture_output=True, text=True,
                          timeout=120)


def test_unit_passes_systemd_analyze_verify(tmp_path: os.PathLike[str]) -> None:
    with open(UNIT) as f:
        text = f.read()
    r = _verify(text, os.path.join(str(tmp_path), "good"))
    assert r.returncode == 0 and not r.stderr.strip() and not r.stdout.strip(), r.stderr
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "KillMode=process", "RuntimeDirectoryPreserve=yes",
                 "After=network-online.target etcd.service"):
        assert line in text
    stop_s = int(text.split("TimeoutStopSec=")[1].split()[0])
    assert stop_s > 3 * Settings().shutdown_grace_s  # the drain grace fits with room to spare
    # The check can fail: a misspelt key and a bad value are reported.
    bad = _verify(text.replace("KillMode=process", "KillMode=sometimes\nRestartt=always"),
                  os.path.join(str(tmp_path), "bad"))
    assert "Restartt" in bad.stderr and "kill mode" in bad.stderr


def test_sample_config_documents_every_key_with_its_default() -> None:
    with open(SAMPLE) as f:
        uncommented = "\n".join(line[2:] for line in f if line.startswith("# ") and " = " in line)
    documented = tomllib.loads(uncommented)
    defaults = dataclasses.asdict(Settings())
    assert documented == defaults, set(documented.items()) ^ set(defaults.items())


def test_settings_precedence_defaults_file_environment_flags(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(str(tmp_path), "elasticd.toml")
    with open(path, "w") as f:
        f.write('node_id = "from-file"\nslots = 4\nlease_ttl_s = 7\nwork_dir = "/srv/ms"\n')
    s = parse_args(["--config", path, "--slots", "8"], environ={"ELASTICD_SLOTS": "6", "ELASTICD_LEASE_TTL_S": "9"})
    assert (s.node_id, s.slots, s.lease_ttl_s, s.work_dir) == ("from-file", 8, 9, "/srv/ms")
    assert s.reconcile_interval_s == Settings().reconcile_interval_s  # untouched keys keep their defaults
    s = parse_args([], environ={"ELASTICD_CONFIG": path})
    assert (s.slots, s.lease_ttl_s) == (4, 7)


@pytest.mark.parametrize("content, env, words", [
    ("slots = -1\n", {}, "slots (from CONFIG): must be >= 0 (got -1)"),
    ("slots = 'two'\n", {}, "slots (from CONFIG): must be an integer (got 'two')"),
    ("sloots = 2\n", {}, "sloots (from CONFIG): unknown key; did you mean slots?"),
    ("slots = [\n", {}, "not valid TOML"),
    ("", {"ELASTICD_LEASE_TTL_S": "1"}, "lease_ttl_s (from $ELASTICD_LEASE_TTL_S): must be >= 2"),
    ("", {"ELASTICD_LISTEN": "7070"}, "listen (from $ELASTICD_LISTEN): '7070' must be host:port"),
    ("tls_cert = '/nonexistent.pem'\ntls_key = '/nonexistent.key'\n", {}, "tls_cert (from CONFIG)"),
    ("log_format = 'xml'\n", {}, "log_format (from CONFIG): must be text or json"),
    ("slots = \"2\"\n", {}, "slots (from CONFIG): must be an integer (got '2')"),  # TOML is typed
    ("listen = '0.0.0.0:7070'\n", {}, "listen (from CONFIG): 0.0.0.0:7070 is reachable from other machines, without TLS"),
    ("insecure = 'yes'\n", {}, "insecure (from CONFIG): must be true or false (got 'yes')"),
    ("", {"ELASTICD_INSECURE": "maybe"}, "insecure (from $ELASTICD_INSECURE): must be true or false"),
    ("allow_env = 'LD PRELOAD'\n", {}, "allow_env (from CONFIG): 'LD PRELOAD' is not a variable name"),
])
def test_bad_settings_stop_elasticd_with_one_line(tmp_path: os.PathLike[str], content: str, env: dict[str, str],
                                                   words: str) -> None:
    path = os.path.join(str(tmp_path), "elasticd.toml")
    with open(path, "w") as f:
        f.write(content)
    with pytest.raises(SettingsError, match=None) as e:
        parse_args(["--config", path], environ=env)
    assert words.replace("CONFIG", path) in str(e.value)
    r = subprocess.run([os.path.join(VENV_BIN, "elasticd"), "--config", path], capture_output=True, text=True,
                       timeout=60, env={**os.environ, **env})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert words.replace("CONFIG", path) in r.stderr


@pytest.mark.parametrize("args, words", [
    (["--slots", "two"], "elasticd: argument --slots: invalid int value: 'two'; see elasticd --help"),
    (["--work-dir", "/proc/x"], "elasticd: work_dir: '/proc/x' cannot be created (No such file or directory)"),
    (["--embedded-etcd-dir", "/proc/x/etcd"], "elasticd: embedded_etcd_dir: '/proc/x/etcd' cannot be created"),
    (["--worker-user", "no-such-user-x"], "elasticd: worker_user: there is no user 'no-such-user-x' on this node"),
    (["--worker-user", "nobody"], "elasticd: worker_user: nobody is shared by other daemons"),
    (["--worker-user", ""], "elasticd: worker_user: there is no user mselastic on this node (the default worker "
                            "user): create it"),
    (["--max-log-mb", "0", "--embedded-etcd-dir", "ETCD"], "elasticd: max_log_mb: 0 (no cap) with work_dir"),
    (["--job-uids", "0-100"], "elasticd: job_uids (from --job-uids): '0-100' must lie in 1000..2147483646"),
    (["--etcd-endpoint", "10.9.9.9:2379"], "elasticd: etcd_endpoint (from --etcd-endpoint): 10.9.9.9:2379 is reachable from other machines"),
])
def test_bad_flags_and_unusable_directories_are_one_line_exit_2(args: list[str], words: str,
                                                                 tmp_path: os.PathLike[str]) -> None:
    args = [a.replace("ETCD", os.path.join(str(tmp_path), "etcd")) for a in args]  # (on work_dir's disk)
    r = subprocess.run([os.path.join(VENV_BIN, "elasticd"), "--config", os.devnull, "--metrics-listen", "",
                        "--work-dir", str(tmp_path), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()] and words in r.stderr, r.stderr
    assert "usage:" not in r.stderr and "Traceback" not in r.stderr


def test_an_elasticd_whose_jobs_could_not_start_under_sched_batch_says_so_and_exits_2(
        tmp_path: os.PathLike[str]) -> None:
    """Under SCHED_IDLE, without CAP_SYS_NICE and with RLIMIT_NICE 0, no process of elasticd's may
    leave SCHED_IDLE: rather than fail every launch (msrun's log alone saying why), elasticd refuses
    to start, naming the setting."""
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # (this test's own start is the baseline)
    r = subprocess.run(["prlimit", "--nice=0", "setpriv", "--bounding-set", "-sys_nice", "--", "chrt", "--idle", "0",
                        os.path.join(VENV_BIN, "elasticd"), "--config", os.devnull, "--metrics-listen", "",
                        "--work-dir", str(tmp_path), "--worker-user", "root"], capture_output=True, text=True, timeout=60)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert last.startswith("elasticd: batch_scheduling: root's processes cannot run under SCHED_BATCH: chrt: ") and \
        last.endswith("; set batch_scheduling = false"), r.stderr


def test_plaintext_elsewhere_than_loopback_needs_insecure_and_a_key_others_read_is_refused(
        tmp_path: os.PathLike[str]) -> None:
    s = parse_args(["--config", os.devnull, "--listen", "0.0.0.0:7070", "--insecure", "true"], environ={})
    assert s.insecure and s.listen == "0.0.0.0:7070"
    for host in ("127.0.0.1", "[::1]", "localhost"):
        assert parse_args(["--config", os.devnull, "--listen", f"{host}:7070"], environ={}).listen == f"{host}:7070"
    key, cert = os.path.join(str(tmp_path), "node.key"), os.path.join(str(tmp_path), "node.pem")
    for path in (key, cert):
        with open(path, "w") as f:
            f.write("-----BEGIN-----\n")
    os.chmod(key, 0o644)
    tls = ["--tls-cert", cert, "--tls-key", key, "--tls-cacert", cert]
    with pytest.raises(SettingsError, match="tls_key .* may be read by others \\(mode 644\\): chmod 600 it"):
        parse_args(["--config", os.devnull, *tls], environ={})
    os.chmod(key, 0o600)
    assert parse_args(["--config", os.devnull, *tls, "--listen", "0.0.0.0:7070"], environ={}).tls_key == key
    with pytest.raises(SettingsError, match="tls_cert without tls_cacert would accept any client"):
        parse_args(["--config", os.devnull, "--tls-cert", cert, "--tls-key", key], environ={})
    with pytest.raises(SettingsError, match="a flag is visible to every user in the process list"):
        parse_args(["--config", os.devnull, "--etcd-user", "me", "--etcd-password", "secret"], environ={})


def test_the_worker_environment_is_built_and_a_job_may_not_set_loader_variables() -> None:
    from mselastic.agent.containment.users import inherited_env
    from mselastic.core.spec import forbidden_env

    daemon = {"PATH": "/usr/bin", "LANG": "C.UTF-8", "LC_ALL": "C", "MS_SUBMODULE_LOG_v": "2", "HOME": "/root",
              "ELASTICD_TLS_KEY": "/etc/mselastic/node.key", "AWS_SECRET_ACCESS_KEY": "x", "SSH_AUTH_SOCK": "/tmp/a",
              "ASCEND_HOME_PATH": "/usr/local/Ascend", "SITE_X": "1", "SITE_Y": "2"}
    assert inherited_env(daemon) == {"PATH": "/usr/bin", "LANG": "C.UTF-8", "LC_ALL": "C", "MS_SUBMODULE_LOG_v": "2",
                                     "ASCEND_HOME_PATH": "/usr/local/Ascend"}
    assert set(inherited_env(daemon, frozenset({"SITE_*", "HOME"}))) >= {"SITE_X", "SITE_Y", "HOME"}
    job = {"LD_PRELOAD": "/x.so", "PYTHONPATH": "/x", "PYTHONWARNINGS": "ignore::x.Y", "PATH": "/x", "BASH_ENV": "/x",
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "2", "API_TOKEN": "t"}
    assert forbidden_env(job) == ["BASH_ENV", "LD_PRELOAD", "PATH", "PYTHONPATH", "PYTHONWARNINGS"]
    assert forbidden_env(job, frozenset({"PYTHONPATH"})) == ["BASH_ENV", "LD_PRELOAD", "PATH", "PYTHONWARNINGS"]


def test_a_stalled_event_loop_during_a_shutdown_kills_elasticd_with_sigkill() -> None:
    """systemd stops watching a unit that is stopping, so while the workers take their shutdown
    grace a thread does: once the event loop has not run the deadline check for the limit, it
    SIGKILLs its own process (the workers die with it). Here a process whose loop beat is old
    holds the guard: it dies of SIGKILL within the limit, and says why on stderr."""
    code = ("import time, types\n"
            "from mselastic.agent.node import _StallGuard\n"
            "agent = types.SimpleNamespace(beat=time.monotonic())\n"
            "with _StallGuard(agent, 1.0):\n"
            "    time.sleep(30)\n")
    t0 = time.monotonic()
    r = subprocess.run([os.path.join(VENV_BIN, "python"), "-c", code], capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-500:])
    assert "the event loop stopped for" in r.stderr and took < 20, (took, r.stderr[-500:])


def test_notify_ready_after_registration_then_watchdog_then_stopping(procs: Processes, etcd: Etcd, namespace: str,
                                                                     tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(str(tmp_path), "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(30)
    try:
        p = procs.start("elasticd-n0", elasticd_cmd("n0", etcd.endpoint, free_port(), str(tmp_path), namespace),
                        env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})
        messages: list[str] = []
        while "READY=1" not in messages:
            messages.append(sock.recv(4096).decode())
        # READY only once the node is registered in etcd.
        assert etcd.get(etcd.keys.node("n0")) is not None
        assert any(m.startswith("STATUS=registered as n0") for m in messages)
        watchdogs = 0
        while watchdogs < 3:
            watchdogs += sock.recv(4096).decode() == "WATCHDOG=1"
        os.kill(p.pid, signal.SIGTERM)
        rest = []
        while "STOPPING=1" not in rest:
            rest.append(sock.recv(4096).decode())
        assert p.wait(timeout=30) == 0
    finally:
        sock.close()


@pytest.mark.slow
def test_tls_everywhere_with_roles(procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str]) -> None:
    """elasticd serves only TLS with client certificates made by `elasticctl certs`; the role is
    the certificate's organisation: an admin submits (the job runs), a viewer only looks, a
    certificate of another CA or none is refused, and only the leading node's certificate may
    call Agent.Launch or Agent.Stop."""
    from mselastic.tls import TlsFiles
    from mselastic.v1 import elastic_pb2 as pb
    from mselastic.v1 import elastic_pb2_grpc as pb_grpc

    tmp = str(tmp_path)
    pki, other = os.path.join(tmp, "pki"), os.path.join(tmp, "other")
    certs = [os.path.join(VENV_BIN, "elasticctl"), "certs"]
    for args in (["ca", pki], ["issue", pki, "n0", "--role", "node", "--host", "127.0.0.1"],
                 ["issue", pki, "n9", "--role", "node", "--host", "127.0.0.1"], ["issue", pki, "ops", "--role", "admin"],
                 ["issue", pki, "dash", "--role", "viewer"], ["ca", other], ["issue", other, "ops", "--role", "admin"]):
        r = subprocess.run([*certs, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    assert os.stat(os.path.join(pki, "ops-key.pem")).st_mode & 0o777 == 0o600
    ca = os.path.join(pki, "ca.pem")
    port = free_port()
    procs.start("elasticd-n0", elasticd_cmd("n0", etcd.endpoint, port, os.path.join(tmp, "work"), namespace)
                + ["--tls-cert", os.path.join(pki, "n0.pem"), "--tls-key", os.path.join(pki, "n0-key.pem"),
                   "--tls-cacert", ca])
    wait_for("n0 leading", lambda: etcd.leader() == "n0", 30)
    address = f"127.0.0.1:{port}"
    ctl = [os.path.join(VENV_BIN, "elasticctl"), "--endpoints", address, "--timeout-s", "5"]

    def who(name: str, where: str = pki) -> list[str]:
        return ["--cacert", ca, "--cert", os.path.join(where, f"{name}.pem"), "--key",
                os.path.join(where, f"{name}-key.pem")]

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*ctl, *args], capture_output=True, text=True, timeout=60,
                              env={**os.environ, **(env or {})})

    ok = run(*who("ops"), "nodes")
    assert ok.returncode == 0 and "n0" in ok.stdout, ok.stderr
    plain = run("nodes")
    assert plain.returncode == 3 and len(plain.stderr.strip().splitlines()) == 1
    assert run("--cacert", ca, "nodes").returncode == 3  # no client certificate
    assert run(*who("ops", other), "nodes").returncode == 3  # signed by another CA
    by_env = run("nodes", env={"ELASTICCTL_CACERT": ca, "ELASTICCTL_CERT": os.path.join(pki, "ops.pem"),
                               "ELASTICCTL_KEY": os.path.join(pki, "ops-key.pem")})
    assert by_env.returncode == 0 and "n0" in by_env.stdout
    spec = lenet_spec(os.path.join(tmp, "job.toml"), "lenet", os.path.join(tmp, "out"), os.path.join(tmp, "ckpt"), 5)
    # A viewer looks, and cannot act.
    assert run(*who("dash"), "status").returncode == 0
    for args in (["submit", spec], ["stop", "lenet"], ["drain", "n0"], ["scale", "lenet", "--max", "2"],
                 ["restart", "lenet"], ["delete", "lenet"]):
        r = run(*who("dash"), *args)
        assert r.returncode == 1 and "needs the admin role; certificate dash has viewer" in r.stderr, (args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1
    assert etcd.status("lenet") is None
    assert run(*who("ops"), "submit", spec).returncode == 0
    status = wait_for("job to end", lambda: (s := etcd.status("lenet")) and s.state.terminal and s, 180, 0.5)
    assert status.state.value == "SUCCEEDED", status.message
    # Agent.Launch and Agent.Stop: the leading node's certificate only (not an admin's, not another node's).
    for name, words in (("ops", "Launch needs the node role; certificate ops has admin"),
                        ("n9", "Launch only from the leading node (n0), not n9")):
        files = TlsFiles(ca, os.path.join(pki, f"{name}.pem"), os.path.join(pki, f"{name}-key.pem"))
        with files.channel(address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.AgentStub(ch).Launch(pb.LaunchRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and words in (e.value.details() or ""), \
                e.value.details()
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.AgentStub(ch).Stop(pb.StopRequest(job="lenet"), timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # The leader's own certificate passes the check; the plan itself is then judged: a generation
    # that is not the one committed in etcd (what a deposed leader would push) is refused.
    from mselastic.wire import plan_to_pb

    committed = etcd.plan("lenet")
    assert committed is not None
    stale = plan_to_pb(dataclasses.replace(committed, generation=committed.generation + 1))
    files = TlsFiles(ca, os.path.join(pki, "n0.pem"), os.path.join(pki, "n0-key.pem"))
    with files.channel(address) as ch:
        res = pb_grpc.AgentStub(ch).Launch(pb.LaunchRequest(plan=stale), timeout=10)
        assert not res.accepted and "is not the plan committed in etcd" in res.message, res



def _served_serial(port: int, ca: str, cert: str, key: str) -> int:
    """The serial of the certificate elasticd serves on a new connection (a TLS handshake as a
    client with ``cert``, as elasticctl makes one)."""
    import ssl

    from cryptography import x509

    ctx = ssl.create_default_context(cafile=ca)
    ctx.load_cert_chain(cert, key)
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return int(x509.load_der_x509_certificate(der).serial_number)


def test_a_certificate_renewed_in_place_serves_without_a_restart_and_a_revoked_one_is_refused(
        procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str]) -> None:
    """`elasticctl certs` with --days; the node's certificate issued again (a renewal) is what
    the next connection gets, from the same elasticd; `certs revoke` writes the CA's list, and
    the next call with that certificate is refused while another admin's goes on. A list that is
    not the CA's is not taken (the previous one holds); one at start is refused in one line."""
    from cryptography import x509

    tmp = str(tmp_path)
    pki, other = os.path.join(tmp, "pki"), os.path.join(tmp, "other")
    certs = [os.path.join(VENV_BIN, "elasticctl"), "certs"]
    for args in (["ca", pki, "--days", "30"], ["issue", pki, "n0", "--role", "node", "--host", "127.0.0.1", "--days", "2"],
                 ["issue", pki, "ops", "--role", "admin"], ["issue", pki, "eve", "--role", "admin", "--days", "1"],
                 ["ca", other]):
        r = subprocess.run([*certs, *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    days = {name: (c.not_valid_after_utc - c.not_valid_before_utc).days for name in ("ca", "n0", "ops", "eve")
            for c in [x509.load_pem_x509_certificate(open(os.path.join(pki, f"{name}.pem"), "rb").read())]}
    assert days == {"ca": 30, "n0": 2, "ops": 825, "eve": 1}, days  # (valid from 5 minutes before: clock skew)
    ca, crl = os.path.join(pki, "ca.pem"), os.path.join(pki, "crl.pem")
    tls = ["--tls-cert", os.path.join(pki, "n0.pem"), "--tls-key", os.path.join(pki, "n0-key.pem"), "--tls-cacert", ca]
    port = free_port()
    work = os.path.join(tmp, "work")
    # A list another CA signed is refused at start, in one line.
    bad = subprocess.run(elasticd_cmd("n0", etcd.endpoint, port, work, namespace) + tls
                         + ["--tls-crl", os.path.join(other, "crl.pem")], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "tls_crl" in bad.stderr and "not signed by the CA" in bad.stderr, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    elasticd = procs.start("elasticd-n0", elasticd_cmd("n0", etcd.endpoint, port, work, namespace) + tls
                           + ["--tls-crl", crl])
    wait_for("n0 leading", lambda: etcd.leader() == "n0", 30)
    ctl = [os.path.join(VENV_BIN, "elasticctl"), "--endpoints", f"127.0.0.1:{port}", "--timeout-s", "5", "--cacert", ca]

    def run(name: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*ctl, "--cert", os.path.join(pki, f"{name}.pem"), "--key",
                               os.path.join(pki, f"{name}-key.pem"), *args], capture_output=True, text=True, timeout=60)

    assert run("eve", "nodes").returncode == 0 and run("ops", "nodes").returncode == 0
    first = _served_serial(port, ca, os.path.join(pki, "ops.pem"), os.path.join(pki, "ops-key.pem"))
    assert first == x509.load_pem_x509_certificate(open(os.path.join(pki, "n0.pem"), "rb").read()).serial_number
    # Renewed in place: the next connection gets the new certificate, from the same process.
    r = subprocess.run([*certs, "issue", pki, "n0", "--role", "node", "--host", "127.0.0.1", "--days", "90"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    renewed = x509.load_pem_x509_certificate(open(os.path.join(pki, "n0.pem"), "rb").read())
    assert renewed.serial_number != first
    assert _served_serial(port, ca, os.path.join(pki, "ops.pem"), os.path.join(pki, "ops-key.pem")) == \
        renewed.serial_number
    assert run("ops", "nodes").returncode == 0
    # Revoked: eve's next call is refused; ops goes on.
    shutil.copy(crl, crl + ".before")
    r = subprocess.run([*certs, "revoke", pki, "eve"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "revoked eve" in r.stdout, r.stderr
    refused = run("eve", "nodes")
    assert refused.returncode == 1 and "certificate eve" in refused.stderr and "is revoked (tls_crl)" in refused.stderr, \
        refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert run("ops", "nodes").returncode == 0
    # A list that is not the CA's, then the CA's own older one, copied over it: neither is taken,
    # eve stays refused.
    for stale in (os.path.join(other, "crl.pem"), crl + ".before"):
        shutil.copy(stale, crl + ".other")
        os.replace(crl + ".other", crl)
        assert run("eve", "nodes").returncode == 1 and run("ops", "nodes").returncode == 0
    assert elasticd.poll() is None
    with open(os.path.join(procs.log_dir, "elasticd-n0.log")) as f:
        log = f.read()
    assert "TLS certificate reloaded: O=node,CN=n0" in log and "revocation list not reloaded" in log, log[-3000:]
    assert "list number 1 is older than the one in force (2)" in log, log[-3000:]


def test_a_local_unprivileged_user_cannot_get_a_job_run(procs: Processes, etcd: Etcd, namespace: str,
                                                        python_for_nobody: None) -> None:
    """On the single-machine default (an embedded etcd, plaintext gRPC on loopback, the local
    socket 0600): a local user (uid 65534) may look through the TCP port but not submit, stop or
    call the agent, cannot open the socket, and cannot reach etcd behind elasticd's back (it
    takes clients with the certificate only root can read); nothing was created."""
    base = tempfile.mkdtemp(prefix="mselastic-local-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        port, etcd_port = free_port(), free_port()
        work = os.path.join(base, "work")
        elasticd = procs.start("elasticd-n0", elasticd_cmd("n0", f"127.0.0.1:{etcd_port}", port, work, namespace)
                               + ["--embedded-etcd-dir", os.path.join(work, "etcd")])
        sock = os.path.join(work, "elasticd.sock")
        root_ctl = [os.path.join(VENV_BIN, "elasticctl"), "--endpoint", f"unix:{sock}"]
        wait_for("n0 serving", lambda: subprocess.run([*root_ctl, "nodes"], capture_output=True,
                                                      timeout=30).returncode == 0, 30, 0.1)
        assert os.stat(sock).st_mode & 0o777 == 0o600  # no mselastic group on this machine: root alone
        spec = lenet_spec(os.path.join(base, "job.toml"), "intruder", base, os.path.join(base, "ckpt"), 5)
        os.chmod(spec, 0o644)

        def as_nobody(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(list(args), capture_output=True, text=True, timeout=60, user=65534, group=65534,
                                  extra_groups=[], env={**os.environ, "HOME": base}, cwd=base)

        ctl = os.path.join(VENV_BIN, "elasticctl")
        r = as_nobody(ctl, "--endpoint", f"127.0.0.1:{port}", "submit", spec)
        assert r.returncode == 1 and "Submit needs the admin role; plaintext TCP has viewer" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
        assert as_nobody(ctl, "--endpoint", f"127.0.0.1:{port}", "status").returncode == 0  # looking is fine
        r = as_nobody(ctl, "--endpoint", f"unix:{sock}", "status")
        assert r.returncode == 3, r.stderr  # the socket cannot be opened
        calls = (
            "import grpc, sys\n"
            "from mselastic.v1 import elastic_pb2 as pb, elastic_pb2_grpc as pbg\n"
            f"ch = grpc.insecure_channel('127.0.0.1:{port}')\n"
            "for name, call in (('Launch', lambda: pbg.AgentStub(ch).Launch(pb.LaunchRequest(), timeout=5)),\n"
            "                   ('Stop', lambda: pbg.AgentStub(ch).Stop(pb.StopRequest(job='x'), timeout=5)),\n"
            "                   ('Logs', lambda: list(pbg.AgentStub(ch).Logs(pb.LogsRequest(job='x'), timeout=5))),\n"
            "                   ('StopJob', lambda: pbg.ControlStub(ch).StopJob(pb.StopJobRequest(job='x'), timeout=5))):\n"
            "    try:\n"
            "        call(); print(name, 'OK')\n"
            "    except grpc.RpcError as e:\n"
            "        print(name, e.code().name)\n")
        r = as_nobody(os.path.join(VENV_BIN, "python"), "-c", calls)
        assert r.stdout.split() == ["Launch", "PERMISSION_DENIED", "Stop", "PERMISSION_DENIED", "Logs",
                                    "PERMISSION_DENIED", "StopJob", "PERMISSION_DENIED"], (r.stdout, r.stderr)
        # etcd itself: plaintext is refused, TLS without a client certificate too, and the
        # certificate elasticd made for it cannot be read; root with it gets in (the control).
        pki = os.path.join(work, "etcd", "pki")
        etcdctl = [os.path.join(VENV_BIN, "etcdctl"), "--dial-timeout=2s", "--command-timeout=3s"]
        key = f"{namespace}/jobs/intruder/spec"
        for how in ([f"--endpoints=127.0.0.1:{etcd_port}"],
                    [f"--endpoints=https://127.0.0.1:{etcd_port}", "--insecure-skip-tls-verify"]):
            r = as_nobody(*etcdctl, *how, "put", key, "{}")
            assert r.returncode != 0 and "OK" not in r.stdout, (how, r.stdout, r.stderr)
        r = subprocess.run([*etcdctl, f"--endpoints=https://127.0.0.1:{etcd_port}", f"--cacert={pki}/ca.pem",
                            f"--cert={pki}/etcd.pem", f"--key={pki}/etcd-key.pem", "get", key], capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 0 and r.stdout == "", (r.stdout, r.stderr)
        r = as_nobody("cat", os.path.join(pki, "etcd-key.pem"))
        assert r.returncode != 0 and "Permission denied" in r.stderr, r.stderr
        # Its peer port (raft) takes no one without a certificate either, plaintext or TLS.
        etcd_proc = next(p for p in psutil.Process(elasticd.pid).children() if p.name() == "etcd")
        cmdline = etcd_proc.cmdline()
        peer = cmdline[cmdline.index("--listen-peer-urls") + 1]
        assert peer.startswith("https://127.0.0.1:"), peer
        probe = ("import ssl, sys, urllib.request\n"
                 "for url, ctx in ((sys.argv[1].replace('https', 'http') + '/members', None),\n"
                 "                 (sys.argv[1] + '/members', ssl._create_unverified_context())):\n"
                 "    try:\n"
                 "        print(urllib.request.urlopen(url, timeout=5, context=ctx).read()[:60])\n"
                 "    except Exception as e:\n"
                 "        print('refused', type(e).__name__)\n")
        r = as_nobody(os.path.join(VENV_BIN, "python"), "-c", probe, peer)
        assert [line.split()[0] for line in r.stdout.splitlines()] == ["refused", "refused"], (r.stdout, r.stderr)
        r = subprocess.run([*root_ctl, "jobs", "-o", "json"], capture_output=True, text=True, timeout=30)
        assert r.returncode == 0 and "intruder" not in r.stdout, r.stdout
    finally:
        procs.stop_all()
        shutil.rmtree(base, ignore_errors=True)


def test_install_unit_writes_unit_user_and_config_keeps_an_edited_config_and_stays_under_root(
        tmp_path: os.PathLike[str]) -> None:
    """elasticctl install-unit --root (an image being built): the unit pointing at this venv's
    elasticd, the sysusers.d entry, the sample config (0640) once; never out of the root."""
    tmp = str(tmp_path)
    ctl = os.path.join(VENV_BIN, "elasticctl")
    root = os.path.join(tmp, "image")
    os.makedirs(root)
    r = subprocess.run([ctl, "install-unit", "--root", root], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    unit = os.path.join(root, "etc/systemd/system/elasticd.service")
    with open(unit) as f:
        text = f.read()
    assert f"ExecStart={VENV_BIN}/elasticd --config /etc/mselastic/elasticd.toml\n" in text
    assert "/opt/mselastic/.venv" not in text.split("[Service]")[1]
    assert os.stat(unit).st_mode & 0o777 == 0o644
    with open(os.path.join(root, "etc/sysusers.d/mselastic.conf")) as f:
        assert "\nu mselastic - " in f.read()
    config = os.path.join(root, "etc/mselastic/elasticd.toml")
    assert os.stat(config).st_mode & 0o777 == 0o640 and "next:" not in r.stdout  # --root: no systemctl hint
    with open(config, "w") as f:
        f.write('node_id = "edited"\n')
    r = subprocess.run([ctl, "install-unit", "--root", root], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"kept {config}" in r.stdout, r.stdout
    with open(config) as f:
        assert f.read() == 'node_id = "edited"\n'
    assert not [n for n in os.listdir(os.path.dirname(unit)) if n.startswith(".")]  # no temporary file left
    # A symlink in the tree that leads out of the root is refused, nothing written outside.
    evil, outside = os.path.join(tmp, "evil"), os.path.join(tmp, "outside")
    os.makedirs(evil)
    os.makedirs(outside)
    os.symlink(outside, os.path.join(evil, "etc"))
    r = subprocess.run([ctl, "install-unit", "--root", evil], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "leads out of" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert os.listdir(outside) == []  # not even a folder
    r = subprocess.run([ctl, "install-unit", "--root", os.path.join(tmp, "nope")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "no such directory" in r.stderr, r.stderr


@pytest.mark.slow
def test_elasticd_with_its_embedded_etcd_stops_within_bounds_time_after_time_and_refuses_a_taken_etcd_port(
        procs: Processes, namespace: str, python_for_nobody: None) -> None:
    """#49, as it was seen: an elasticd with its embedded etcd, an unprivileged TCP Submit refused
    a few seconds before, then a SIGTERM (once it logged that it was stopping its workers and then
    waited for minutes). Four times in a row on the same work_dir and etcd data: idle twice, then
    with a job (SIGTERM: the job left to its shim; the next elasticd adopts it), then that one
    stopped with the job (SIGINT): each exits 0 within 30 s, and the job's ranks are gone after the
    last. Then a process listening on the embedded etcd's port: elasticd refuses in one line that
    names the port and the holder, exit 2 (it used to talk to whatever answered there)."""
    base = tempfile.mkdtemp(prefix="mselastic-stops-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        port, etcd_port = free_port(), free_port()
        work = os.path.join(base, "work")
        cmd = elasticd_cmd("n0", f"127.0.0.1:{etcd_port}", port, work, namespace) + \
            ["--embedded-etcd-dir", os.path.join(work, "etcd")]
        root_ctl = [os.path.join(VENV_BIN, "elasticctl"), "--endpoint", f"unix:{os.path.join(work, 'elasticd.sock')}"]
        spec = lenet_spec(os.path.join(base, "job.toml"), "held", os.path.join(base, "out"),
                          os.path.join(base, "ckpt"), 500)
        os.chmod(spec, 0o644)
        took = []
        for i, (sig, job) in enumerate([(signal.SIGTERM, False), (signal.SIGTERM, False), (signal.SIGTERM, True),
                                        (signal.SIGINT, True)]):
            elasticd = procs.start("elasticd-n0", cmd)
            wait_for("n0 serving", lambda: subprocess.run([*root_ctl, "nodes"], capture_output=True,
                                                          timeout=30).returncode == 0, 60, 0.1)
            r = subprocess.run([os.path.join(VENV_BIN, "elasticctl"), "--endpoint", f"127.0.0.1:{port}", "submit",
                                spec], capture_output=True, text=True, timeout=60, user=65534, group=65534,
                               extra_groups=[], env={**os.environ, "HOME": base}, cwd=base)
            assert r.returncode == 1 and "Submit needs the admin role" in r.stderr, r.stderr
            if job and i == 2:
                assert subprocess.run([*root_ctl, "submit", spec], capture_output=True, timeout=60).returncode == 0
            if job:
                wait_for("the job training", lambda: _step_of(root_ctl, "held") >= 2, 120, 0.5)
                ranks = sorted(p.pid for p in psutil.process_iter(["environ"])
                               if (p.info["environ"] or {}).get("MSELASTIC_JOB") == "held")
                if i == 2:
                    left = ranks
                else:  # (the job left to its shim at the SIGTERM before, adopted: the same processes)
                    assert ranks == left and _step_of(root_ctl, "held") < 500, (ranks, left)
            time.sleep(1.0)  # (the refused Submit a few seconds before, as seen)
            t0 = time.monotonic()
            elasticd.send_signal(sig)
            assert elasticd.wait(timeout=30) == 0, (i, sig)
            took.append(time.monotonic() - t0)
        print(f"elasticd stopped {len(took)} times in a row in {', '.join(f'{t:.1f}s' for t in took)}")
        wait_for("the job's ranks gone", lambda: not [p for p in psutil.process_iter(["environ"])
                                                      if (p.info["environ"] or {}).get("MSELASTIC_JOB") == "held"],
                 15, 0.2)
        with socket.socket() as holder:
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (the last etcd's connections linger)
            holder.bind(("127.0.0.1", etcd_port))
            holder.listen()
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
        line = r.stderr.strip().splitlines()[-1]
        assert line.startswith(f"elasticd: etcd_endpoint: the embedded etcd's client port: 127.0.0.1:{etcd_port} is "
                               f"in use by ") and f"(pid {os.getpid()})" in line, r.stderr[-2000:]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _step_of(ctl: list[str], job: str) -> int:
    r = subprocess.run([*ctl, "status", job, "-o", "json"], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return -1
    found = [j for j in json.loads(r.stdout).get("jobs", []) if j.get("job") == job]
    return int(found[0].get("step", -1)) if found else -1


def test_both_binaries_say_their_release_and_elasticd_its_records_schema() -> None:
    from mselastic import __version__
    from mselastic.core.model import SCHEMA
    for tool, said in (("elasticd", f"elasticd {__version__} (etcd records: schema {SCHEMA})"),
                       ("elasticctl", f"elasticctl {__version__}")):
        r = subprocess.run([os.path.join(VENV_BIN, tool), "--version"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == said, (tool, r.stdout, r.stderr)
