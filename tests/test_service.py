"""elasticd as a service: the systemd unit (systemd-analyze verify), the notify protocol on a
real notify socket, the config file (every key documented, precedence, one-line errors)
and TLS on the gRPC port with real certificates."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import tomllib

import pytest

from mselastic.daemon.main import FIELDS, Settings, SettingsError, parse_args
from mselastic.store.embedded import free_port
from tests.harness import REPO, VENV_BIN, Etcd, Processes, elasticd_cmd, lenet_spec, wait_for

UNIT = os.path.join(REPO, "systemd", "elasticd.service")
SAMPLE = os.path.join(REPO, "systemd", "elasticd.toml")


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
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "KillMode=control-group", "After=network-online.target etcd.service"):
        assert line in text
    stop_s = int(text.split("TimeoutStopSec=")[1].split()[0])
    assert stop_s > 3 * Settings().shutdown_grace_s  # the drain grace fits with room to spare
    # The check can fail: a misspelt key and a bad value are reported.
    bad = _verify(text.replace("KillMode=control-group", "KillMode=sometimes\nRestartt=always"),
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
    ("sloots = 2\n", {}, "sloots (from CONFIG): unknown key"),
    ("slots = [\n", {}, "not valid TOML"),
    ("", {"ELASTICD_LEASE_TTL_S": "1"}, "lease_ttl_s (from $ELASTICD_LEASE_TTL_S): must be >= 2"),
    ("", {"ELASTICD_LISTEN": "7070"}, "listen (from $ELASTICD_LISTEN): '7070' must be host:port"),
    ("tls_cert = '/nonexistent.pem'\ntls_key = '/nonexistent.key'\n", {}, "tls_cert (from CONFIG)"),
    ("log_format = 'xml'\n", {}, "log_format (from CONFIG): must be text or json"),
    ("slots = \"2\"\n", {}, "slots (from CONFIG): must be an integer (got '2')"),  # TOML is typed
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
])
def test_bad_flags_and_unusable_directories_are_one_line_exit_2(args: list[str], words: str,
                                                                 tmp_path: os.PathLike[str]) -> None:
    r = subprocess.run([os.path.join(VENV_BIN, "elasticd"), "--config", os.devnull, "--metrics-listen", "",
                        "--work-dir", str(tmp_path), *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [r.stderr.strip()] and words in r.stderr, r.stderr
    assert "usage:" not in r.stderr and "Traceback" not in r.stderr


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


def _certs(d: str) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    files: dict[str, str] = {}

    def write(name: str, data: bytes) -> str:
        files[name] = os.path.join(d, name)
        with open(files[name], "wb") as f:
            f.write(data)
        return files[name]

    def key_pem(k: ec.EllipticCurvePrivateKey) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                               serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mselastic test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    write("ca.pem", ca.public_bytes(serialization.Encoding.PEM))
    for name, usage in (("server", ExtendedKeyUsageOID.SERVER_AUTH), ("client", ExtendedKeyUsageOID.CLIENT_AUTH)):
        k = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_name).public_key(k.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                               critical=False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                                                     if name == "server" else [usage]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        write(f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM))
        write(f"{name}-key.pem", key_pem(k))
    return files


@pytest.mark.slow
def test_tls_everywhere(procs: Processes, etcd: Etcd, namespace: str, tmp_path: os.PathLike[str]) -> None:
    """elasticd serves only TLS with client certificates; elasticctl connects with etcdctl-style
    flags or their variables; the leader launches a job on the agent over the same TLS."""
    tmp = str(tmp_path)
    c = _certs(tmp)
    port = free_port()
    procs.start("elasticd-n0", elasticd_cmd("n0", etcd.endpoint, port, os.path.join(tmp, "work"), namespace)
                + ["--tls-cert", c["server.pem"], "--tls-key", c["server-key.pem"], "--tls-cacert", c["ca.pem"]])
    wait_for("n0 leading", lambda: etcd.leader() == "n0", 30)
    ctl = [os.path.join(VENV_BIN, "elasticctl"), "--endpoints", f"127.0.0.1:{port}", "--timeout-s", "5"]
    tls = ["--cacert", c["ca.pem"], "--cert", c["client.pem"], "--key", c["client-key.pem"]]

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*ctl, *args], capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})})

    ok = run(*tls, "nodes")
    assert ok.returncode == 0 and "n0" in ok.stdout, ok.stderr
    plain = run("nodes")
    assert plain.returncode == 3 and len(plain.stderr.strip().splitlines()) == 1
    no_client_cert = run("--cacert", c["ca.pem"], "nodes")
    assert no_client_cert.returncode == 3
    by_env = run("nodes", env={"ELASTICCTL_CACERT": c["ca.pem"], "ELASTICCTL_CERT": c["client.pem"],
                               "ELASTICCTL_KEY": c["client-key.pem"]})
    assert by_env.returncode == 0 and "n0" in by_env.stdout
    spec = lenet_spec(os.path.join(tmp, "job.toml"), "lenet", os.path.join(tmp, "out"), os.path.join(tmp, "ckpt"), 5)
    assert run(*tls, "submit", spec).returncode == 0
    status = wait_for("job to end", lambda: (s := etcd.status("lenet")) and s.state.terminal and s, 180, 0.5)
    assert status.state.value == "SUCCEEDED", status.message
