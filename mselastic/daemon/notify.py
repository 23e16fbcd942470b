"""systemd's notify protocol (``Type=notify``), through libsystemd's sd_notify (cysystemd).

READY=1 once the node is registered in etcd, WATCHDOG=1 from the event loop every half
``WatchdogSec`` (so a wedged loop gets the daemon restarted; a ``WatchdogSec`` longer than the
fencing rule allows is shortened with ``WATCHDOG_USEC=``), STATUS= lines for
``systemctl status``, STOPPING=1 on shutdown. Outside systemd (no ``$NOTIFY_SOCKET``)
every call does nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os

from mselastic.core.waits import within

log = logging.getLogger(__name__)


def _notify(*fields: str) -> None:
    if not os.environ.get("NOTIFY_SOCKET"):
        return
    from cysystemd.daemon import Notification, notify

    kinds = {"READY": Notification.READY, "WATCHDOG": Notification.WATCHDOG, "STOPPING": Notification.STOPPING,
             "STATUS": Notification.STATUS, "WATCHDOG_USEC": Notification.WATCHDOG_USEC}
    for f in fields:
        key, _, value = f.partition("=")
        try:
            # (return_exceptions=False: cysystemd would otherwise log and return a failure.)
            if key == "STATUS":
                notify(kinds[key], value, return_exceptions=False)
            elif key == "WATCHDOG_USEC":
                notify(kinds[key], int(value), return_exceptions=False)
            else:
                notify(kinds[key], return_exceptions=False)
        except Exception as e:  # noqa: BLE001 - a notify failure must never stop the daemon
            log.warning("sd_notify %s failed: %s", key, e)


def ready(status: str) -> None:
    _notify(f"STATUS={status}", "READY=1")


def status(text: str) -> None:
    _notify(f"STATUS={text}")


def stopping() -> None:
    _notify("STOPPING=1", "STATUS=stopping: local workers checkpoint, then exit")


def extend_timeout(seconds: float) -> None:
    """Ask systemd (236+) for ``seconds`` more from now before it gives up on the current state
    (a stop whose jobs' checkpoints take longer than the unit's TimeoutStopSec)."""
    if not os.environ.get("NOTIFY_SOCKET"):
        return
    from cysystemd.daemon import sd_notify

    try:
        sd_notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}", 0)
    except Exception as e:  # noqa: BLE001 - a notify failure must never stop the daemon
        log.warning("sd_notify EXTEND_TIMEOUT_USEC failed: %s", e)


def watchdog_interval_s() -> float:
    """Half the watchdog timeout systemd set for this process, or 0 when there is none."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or (pid and pid != str(os.getpid())):
        return 0.0
    return int(usec) / 2e6


async def watchdog(stop: asyncio.Event, within_s: float = 0.0) -> None:
    """Ping the watchdog from the event loop until ``stop``. ``within_s``: the longest the
    watchdog may take to see a hung elasticd (fencing.watchdog_s of the lease TTL); a unit's
    longer WatchdogSec is shortened to it (``WATCHDOG_USEC=``, systemd 236+)."""
    interval = watchdog_interval_s()
    if not interval:
        await stop.wait()
        return
    if within_s and within_s < 2 * interval:
        usec = int(within_s * 1e6)
        _notify(f"WATCHDOG_USEC={usec}")
        log.info("watchdog timeout %.1fs (the unit's %.0fs is longer than a hung elasticd may keep its workers; "
                 "systemd older than 236 ignores this: there, set WatchdogSec=%d or less in a drop-in)",
                 within_s, 2 * interval, int(within_s))
        interval = within_s / 2
    while not stop.is_set():
        _notify("WATCHDOG=1")
        try:
            await within(stop.wait(), timeout=interval)
        except asyncio.TimeoutError:
            pass


#: How long ``systemctl list-jobs`` may take at a SIGTERM (systemd answers at once; a wedged bus
#: must not hold the shutdown).
JOBS_S = 3.0


def own_unit(cgroup_file: str = "/proc/self/cgroup") -> str:
    """The systemd unit this process runs in ("" none): the ``.service`` of its cgroup path (v2's
    line, else v1's ``name=systemd``), whatever leaf elasticd moved itself into below it."""
    try:
        with open(cgroup_file) as f:
            lines = f.read().splitlines()
    except OSError:
        return ""
    paths = [line.split(":", 2)[2] for line in lines if line.startswith("0::") or ":name=systemd:" in line]
    for path in paths:
        units = [part for part in path.split("/") if part.endswith(".service")]
        if units:
            return units[-1]
    return ""


async def job_on_own_unit() -> str:
    """Under systemd, what the SIGTERM elasticd got is for: the type of the job systemd runs on its
    unit now (``restart``, ``stop``; ``systemctl list-jobs``), "stop" too while the system shuts
    down (``shutdown.target`` queued: a reboot), "" when not under systemd or not known."""
    unit = own_unit() if os.environ.get("INVOCATION_ID") else ""
    if not unit:
        return ""
    try:
        proc = await asyncio.create_subprocess_exec("systemctl", "list-jobs", "--plain", "--no-legend", "--no-pager",
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
                                                    stdin=asyncio.subprocess.DEVNULL)
    except OSError as e:
        log.warning("systemctl cannot be run (%s): the SIGTERM is taken for a stop", e)
        return "stop"
    try:
        out, _ = await within(proc.communicate(), timeout=JOBS_S)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        log.warning("systemctl list-jobs did not answer within %.0fs: the SIGTERM is taken for a stop", JOBS_S)
        return "stop"
    jobs = [line.split() for line in out.decode(errors="replace").splitlines()]
    if any(len(j) >= 3 and j[1] == "shutdown.target" for j in jobs):
        return "stop"
    return next((j[2] for j in jobs if len(j) >= 3 and j[1] == unit), "")
