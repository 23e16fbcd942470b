"""What the leader's watch of its connections to the agents costs as the cluster grows.

For N nodes, one process plays N agents (one gRPC server listening on N ports, with elasticd's
server options, TLS with a node certificate unless ``--no-tls``), and the leader side runs in a
process of its own, in two modes side by side for each N:

* connected: the leader's N channels to the agents opened and READY, as they are after the
  leader pushed a plan to every node, with gRPC's default options (no keepalive pings) and
  nobody watching them (the baseline: what holding the connections costs);
* watched: the same channels as the leader makes them (``Agents.channel``: keepalive pings every
  ``liveness.KEEPALIVE_MS``, less often past 500 nodes: ``liveness.PINGS_PER_S``) and
  ``liveness.Liveness`` watching every node (what peer evidence of a dead node adds).

Printed per N and mode, over ``--seconds`` once every channel is READY: the leader process's CPU
(all its threads, % of one core), the channels READY at the end, the suspects, and the watched
mode's extra CPU per 1000 nodes. The fraction of the leader's CPU the watch takes is the question; a real leader also
reconciles (``bench/coordinator_scale.py``).

Usage: make bench-liveness   (or: python bench/liveness_scale.py --nodes 250 1000 4000)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time

import grpc

from mselastic import tls
from mselastic.daemon import liveness
from mselastic.daemon.agents import Agents

MODES = ("connected", "watched")


def _more_files() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def agents(n: int, pki: str) -> None:
    """N agents: one server on N ports; prints the first port, then serves until killed."""
    files = tls.TlsFiles(os.path.join(pki, "ca.pem"), os.path.join(pki, "agents.pem"),
                         os.path.join(pki, "agents-key.pem")) if pki else tls.TlsFiles()
    server = grpc.aio.server(options=liveness.SERVER_OPTIONS)
    ports = []
    for _ in range(n):
        ports.append(server.add_secure_port("127.0.0.1:0", files.server_credentials()) if files.enabled
                     else server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    print(json.dumps(ports), flush=True)
    await asyncio.Event().wait()


async def leader(ports: list[int], mode: str, pki: str, seconds: float) -> None:
    """Open (and in the watched mode, watch) a channel to every port; print the CPU seconds used
    over ``seconds`` once all are READY."""
    files = tls.TlsFiles(os.path.join(pki, "ca.pem"), os.path.join(pki, "leader.pem"),
                         os.path.join(pki, "leader-key.pem")) if pki else tls.TlsFiles()
    addresses = {f"n{i:05d}": f"127.0.0.1:{p}" for i, p in enumerate(ports)}
    hub = Agents(5.0, files)
    hub.cluster_size = len(addresses)  # (as the leader does from the registered nodes)
    watch = None
    if mode == "watched":
        channels = {a: hub.channel(a) for a in addresses.values()}
        watch = liveness.Liveness(hub.channel, lambda: None)
        watch.watch(addresses)
    else:
        channels = {a: files.aio_channel(a) for a in addresses.values()}
    for i in range(0, len(ports), 200):  # (a few hundred handshakes at a time)
        await asyncio.gather(*(asyncio.wait_for(ch.channel_ready(), 120)
                               for ch in list(channels.values())[i:i + 200]))
    await asyncio.sleep(2)  # (the last handshakes' work is over)
    before, t0 = time.process_time(), time.monotonic()
    await asyncio.sleep(seconds)
    used, wall = time.process_time() - before, time.monotonic() - t0
    if watch is not None:
        suspects = len(watch.suspects)
        await watch.close()
    else:
        suspects = 0
    ready = sum(ch.get_state() is grpc.ChannelConnectivity.READY for ch in channels.values())
    print(json.dumps({"cpu_s": used, "wall_s": wall, "ready": ready, "suspects": suspects}), flush=True)
    os._exit(0)  # (closing thousands of channels one by one is not what is measured)


def measure(n: int, mode: str, pki: str, seconds: float) -> dict[str, float]:
    me = [sys.executable, os.path.abspath(__file__)]
    server = subprocess.Popen([*me, "--agents", str(n), "--pki", pki], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert server.stdout is not None
        ports = server.stdout.readline().strip()
        if not ports:
            raise SystemExit(f"the agents process for {n} nodes did not start")
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            f.write(ports)
            f.flush()
            out = subprocess.run([*me, "--leader", f.name, "--mode", mode, "--pki", pki, "--seconds", str(seconds)],
                                 capture_output=True, text=True, timeout=600, start_new_session=True)
        if out.returncode:
            raise SystemExit(f"the leader for {n} nodes ({mode}) failed: {out.stderr.strip()[-500:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        return {"leader_pct": 100 * r["cpu_s"] / r["wall_s"], "ready": r["ready"], "suspects": r["suspects"],
}
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, nargs="+", default=[250, 1000, 4000])
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--no-tls", action="store_true", help="plaintext channels (a cluster without TLS)")
    p.add_argument("--agents", type=int, help=argparse.SUPPRESS)
    p.add_argument("--leader", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--pki", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    _more_files()
    if args.agents:
        asyncio.run(agents(args.agents, args.pki))
        return 0
    if args.leader:
        with open(args.leader) as f:
            asyncio.run(leader(json.load(f), args.mode, args.pki, args.seconds))
        return 0
    with tempfile.TemporaryDirectory(prefix="mselastic-bench-liveness-") as pki:
        if not args.no_tls:
            tls.make_ca(pki)
            tls.issue(pki, "agents", "node", hosts=("127.0.0.1",))
            tls.issue(pki, "leader", "node", hosts=("127.0.0.1",))
        rows = []
        print(f"{'nodes':>6}{'mode':>11}{'leader CPU':>12}{'ready':>7}{'suspects':>9}{'ping every':>12}", flush=True)
        for n in args.nodes:
            for mode in MODES:
                r = measure(n, mode, "" if args.no_tls else pki, args.seconds)
                rows.append({"nodes": n, "mode": mode, **r})
                every = f"{liveness.keepalive_ms(n) / 1000:g} s" if mode == "watched" else "-"
                print(f"{n:>6}{mode:>11}{r['leader_pct']:>10.1f} %{r['ready']:>7}{r['suspects']:>9}{every:>12}",
                      flush=True)
    print(f"\n{'nodes':>6}{'watch adds':>12}{'per 1000 nodes':>16}   (% of one core of the leader's CPU)")
    extra = {}
    for n in args.nodes:
        by = {r["mode"]: r for r in rows if r["nodes"] == n}
        extra[n] = by["watched"]["leader_pct"] - by["connected"]["leader_pct"]
        print(f"{n:>6}{extra[n]:>10.1f} %{1000 * extra[n] / n:>14.2f} %")
    print("BENCH " + json.dumps({"tls": not args.no_tls,
                                 "watch_extra_pct": {str(n): round(v, 2) for n, v in extra.items()},
                                 "rows": [{k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()}
                                          for r in rows]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
