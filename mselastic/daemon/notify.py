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
            await asyncio.wait_for(stop.wait(), timeout=interval)
        except asyncio.TimeoutError:
            pass
