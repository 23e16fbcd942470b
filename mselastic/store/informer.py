"""A local cache of the records a reconcile pass needs, kept current by a watch: client-go's
informer, for etcd.

List the prefixes a pass reads (nodes, cordons, the leader key, jobs, reports), then watch the
namespace from the revision after the first read and apply every change to the cache; when the
watch breaks (etcd restarted, the revision compacted away, the connection lost), list again.
A pass then builds its :class:`~mselastic.store.views.ClusterView` from memory: no etcd read,
and only the records that changed are decoded again. The reads of a list are not one snapshot,
but every change after the first one's revision is replayed in order, so the cache converges
to etcd's state; meanwhile it may be behind. Every write the coordinator makes is
compare-and-set on the revisions it read, so a stale cache costs one refused write and another
pass, never a wrong write.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from mselastic.store.etcd import KV, Store, TemporaryError
from mselastic.store.views import ClusterView, Decoder, Raw, assemble

log = logging.getLogger(__name__)


class Informer:
    def __init__(self, store: Store, on_change: Callable[[], None] = lambda: None) -> None:
        self.store = store
        self.nodes: dict[str, KV] = {}
        self.cordons: dict[str, KV] = {}
        self.jobs: dict[str, KV] = {}
        self.leader: KV | None = None
        #: Reports by (job, generation), then key.
        self.reports: dict[tuple[str, int], dict[str, KV]] = {}
        self.revision = 0
        self.synced = asyncio.Event()
        #: Full lists so far (the first one, then one per broken watch) and changes applied: for the bench.
        self.lists = 0
        self.changes = 0
        self.decoder = Decoder(memo=True)
        self._on_change = on_change

    async def run(self, stop: asyncio.Event) -> None:
        """List, then follow the watch; list again whenever it breaks, until ``stop``."""
        async for attempt in self.store.retry.reconnecting(stop):
            with attempt:
                self.synced.clear()  # passes wait while the cache is rebuilt
                await self._list()
                async for event in self.store.watch_prefix(self.store.keys.namespace + "/", self.revision + 1):
                    try:
                        self._apply(event)
                    except Exception:  # one odd key must not freeze the cache
                        log.exception("watch event skipped")
                raise TemporaryError("watch ended")

    def view(self) -> ClusterView:
        """The cluster as cached now."""
        def reports(job: str, generation: int) -> list[KV]:
            return list(self.reports.get((job, generation), {}).values())
        raw = Raw(self.revision, list(self.nodes.values()), list(self.cordons.values()), self.leader,
                  list(self.jobs.values()), reports)
        return assemble(self.store.keys, raw, self.decoder)

    async def _list(self) -> None:
        k = self.store.keys
        revision, nodes = await self.store.get_prefix(k.nodes)
        _, cordons = await self.store.get_prefix(k.cordons)
        leader = await self.store.get(k.leader)
        _, jobs = await self.store.get_prefix(k.jobs)
        _, reports = await self.store.get_prefix(k.all_reports)
        self.nodes = {kv.key: kv for kv in nodes}
        self.cordons = {kv.key: kv for kv in cordons}
        self.leader = leader
        self.jobs = {kv.key: kv for kv in jobs}
        self.reports = {}
        for kv in reports:
            self._put_report(kv)
        self.revision = revision
        self.lists += 1
        self.synced.set()
        log.debug("listed %d nodes, %d job records, %d reports at revision %d", len(nodes), len(jobs), len(reports),
                  revision)
        self._on_change()

    def _put_report(self, kv: KV) -> bool:
        parsed = self.store.keys.parse_report_key(kv.key)
        if parsed is None:
            return False
        self.reports.setdefault(parsed[:2], {})[kv.key] = kv
        return True

    def _apply(self, event: Any) -> None:
        """One watch event: a PUT carries the key's new value, a DELETE its deletion."""
        raw = event.kv
        key = raw.key.decode(errors="replace")
        kv = KV(key, raw.value, raw.create_revision, raw.mod_revision, getattr(raw, "lease", 0))
        self.revision = max(self.revision, raw.mod_revision)
        deleted = event.kind == "DELETE"
        k = self.store.keys
        if key == k.leader:
            self.leader = None if deleted else kv
        elif key.startswith(k.all_reports):
            parsed = k.parse_report_key(key)
            if parsed is None:
                return
            if deleted:
                group = self.reports.get(parsed[:2], {})
                group.pop(key, None)
                if not group:
                    self.reports.pop(parsed[:2], None)
            else:
                self._put_report(kv)
        else:
            for prefix, table in ((k.nodes, self.nodes), (k.cordons, self.cordons), (k.jobs, self.jobs)):
                if key.startswith(prefix):
                    if deleted:
                        table.pop(key, None)
                    else:
                        table[key] = kv
                    break
            else:
                return  # events, plan history, deleted/: not a pass's business
        if deleted:
            self.decoder.forget(key)
        self.changes += 1
        self._on_change()
