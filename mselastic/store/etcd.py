"""The etcd client the daemons use: aetcd behind one retry policy.

Errors are split the way kopf splits them: :class:`TemporaryError` (etcd
unreachable, a deadline passed) is retried with exponential backoff and jitter
within a budget of attempts and seconds; anything else is a
:class:`PermanentError` and surfaces at once. Every call in the daemons goes
through :meth:`Store.call` or the helpers built on it, so there is exactly one
retry policy for etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol, Sequence, TypeVar

import aetcd
import aetcd.client
import aetcd.exceptions as aerr
import aetcd.rpc
import aetcd.watcher
import grpc
import tenacity

from mselastic.core.waits import within
from mselastic.store.keys import Keys

log = logging.getLogger(__name__)
T = TypeVar("T")


class Record(Protocol):
    """A record kept as JSON in etcd (mselastic.core.model's)."""

    def to_json(self) -> str: ...


R = TypeVar("R", bound=Record)


class TemporaryError(Exception):
    """etcd could not be reached in time; worth retrying."""


class PermanentError(Exception):
    """etcd refused the request; retrying will not help."""


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """Backoff for etcd calls: exponential with jitter, bounded in attempts and time."""

    attempts: int = 8
    budget_s: float = 10.0
    initial_wait_s: float = 0.1
    max_wait_s: float = 2.0
    #: The etcd endpoint(s), for the messages (set by the Store).
    endpoint: str = ""

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.budget_s <= 0 or self.initial_wait_s <= 0 or self.max_wait_s <= 0:
            raise ValueError("retry policy values must be positive")

    def retrying(self) -> tenacity.AsyncRetrying:
        return tenacity.AsyncRetrying(
            stop=tenacity.stop_after_attempt(self.attempts) | tenacity.stop_after_delay(self.budget_s),
            wait=tenacity.wait_exponential_jitter(multiplier=self.initial_wait_s, max=self.max_wait_s, jitter=self.initial_wait_s),
            retry=tenacity.retry_if_exception_type(TemporaryError),
            before_sleep=lambda rs: log.debug("etcd retry %d: %s", rs.attempt_number, rs.outcome and rs.outcome.exception()),
            reraise=True,
        )

    def reconnecting(self, stop: "asyncio.Event") -> tenacity.AsyncRetrying:
        """For long-lived work (registration, watches): retry any etcd error until ``stop`` is set."""
        return tenacity.AsyncRetrying(
            stop=lambda _: stop.is_set(),
            wait=tenacity.wait_exponential_jitter(multiplier=self.initial_wait_s, max=self.max_wait_s,
                                                  jitter=self.initial_wait_s),
            retry=tenacity.retry_if_exception_type((TemporaryError, PermanentError)),
            before_sleep=self._tell,
            reraise=True,
        )

    def _tell(self, rs: tenacity.RetryCallState) -> None:
        """A failing long-lived call: a WARNING that says what to check, at attempts 1, 2, 4, 8, ...
        (so a long outage is reported with backoff, not every two seconds); INFO in between."""
        error = rs.outcome.exception() if rs.outcome else None
        n = rs.attempt_number
        if isinstance(error, TemporaryError) and n & (n - 1) == 0:
            log.warning("etcd at %s unreachable (%s; attempt %d); retrying. Check that etcd runs there and that "
                        "etcd_endpoint (and the network to it) is right", self.endpoint or "?", error, n)
        else:
            log.info("etcd: %s; retrying", error)


@dataclasses.dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int


def _unreachable(e: BaseException) -> bool:
    """The member could not be reached or did not answer in time (another one might)."""
    return isinstance(e, (aerr.ConnectionFailedError, aerr.ConnectionTimeoutError, TimeoutError))


def _channel_closed() -> TemporaryError | None:
    """For a ``CancelledError`` out of a call: a temporary error when gRPC raised it because the
    call's channel was closed under it (the client moving to another member, or logging in again),
    None when this task itself is being cancelled (then it must propagate)."""
    task = asyncio.current_task()
    if task is None or task.cancelling():
        return None
    return TemporaryError("the call's channel was closed (the client moved to another etcd member); retrying")


def _classify(e: Exception) -> Exception:
    cause = e.__cause__
    if _unreachable(e) or (isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.CANCELLED):
        # (CANCELLED: a call in flight on a channel closed under it, to move to another member)
        return TemporaryError(str(e) or type(e).__name__)
    return PermanentError(str(e) or type(e).__name__)


def _kv(raw: Any) -> KV:
    return KV(raw.key.decode(), raw.value, raw.create_revision, raw.mod_revision, raw.lease)


@dataclasses.dataclass(frozen=True)
class EtcdAuth:
    """How elasticd proves itself to etcd, named like etcdctl's flags: TLS (``cacert``; ``cert`` and
    ``key`` for a client certificate, whose CN etcd takes as the user when it runs with
    ``--client-cert-auth``), and/or a user and password (etcd's ``auth enable``)."""

    cacert: str = ""
    cert: str = ""
    key: str = ""
    user: str = ""
    password: str = ""

    @property
    def tls(self) -> bool:
        return bool(self.cacert or self.cert)

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str) -> bytes | None:
            if not path:
                return None
            with open(path, "rb") as f:
                return f.read()
        return grpc.ssl_channel_credentials(root_certificates=read(self.cacert), private_key=read(self.key),
                                            certificate_chain=read(self.cert))


#: How long a member's TLS channel may take to get ready before the next member is tried.
MEMBER_READY_S = 1.0


class _TlsClient(aetcd.Client):
    """aetcd 1.0 opens plaintext channels only, in ``connect`` (the one place a channel is made):
    the same ``connect`` with TLS credentials. Everything else (stubs, the watcher, the token a
    user and password get) is aetcd's.

    With several members, one at a time: gRPC checks one TLS name per channel (its target's host),
    and each member's certificate names its own address, so one channel over all of them (the
    plaintext path's round robin) would be refused by all but one. The member is the first, from
    the one used last, whose channel gets ready within ``MEMBER_READY_S``; a call that finds it
    unreachable or silent (``Store.once``) leaves its channel, and the next call connects to the
    next member (etcd's own Go client moves between endpoints so, each with its own TLS name)."""

    def __init__(self, credentials: grpc.ChannelCredentials, endpoints: list[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._credentials, self.endpoints, self._at = credentials, endpoints, 0
        #: Channels left behind by move_on, closing in the background (kept from the collector).
        self._closing: set[asyncio.Task[None]] = set()

    def move_on(self, channel: Any) -> None:
        """A call on ``channel`` found its member unreachable or silent: unless the client already
        left that channel (another call's failure, a reconnect), the next call connects to the next
        member, and ``channel`` is closed in the background (its calls still in flight fail and are
        retried; the caller's task does not wait for it, so a cancellation of its own is never
        caught in aetcd's shutdown of the channel's watcher)."""
        if channel is None or channel is not self.channel:
            return
        watcher = self._watcher
        self._init_channel_attrs()
        self._connected.clear()
        self._at = (self._at + 1) % len(self.endpoints)

        async def close() -> None:
            with contextlib.suppress(Exception):
                if watcher is not None:
                    await watcher.shutdown()
                await channel.close()

        task = asyncio.create_task(close(), name="etcd-channel-close")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _channel(self) -> grpc.aio.Channel:
        options = list(self._options.items())
        n = len(self.endpoints)
        for i in range(n if n > 1 else 0):
            at = (self._at + i) % n
            channel = grpc.aio.secure_channel(self.endpoints[at], self._credentials, options=options)
            ready = False
            try:
                await within(channel.channel_ready(), MEMBER_READY_S)
                ready = True
            except TimeoutError:
                continue
            finally:
                if not ready:  # (also when the connecting call is cancelled: no channel is left open)
                    await asyncio.shield(channel.close())
            self._at = at
            return channel
        # One member, or none ready now: the one in turn (its calls fail and move on, until one answers).
        return grpc.aio.secure_channel(self.endpoints[self._at], self._credentials, options=options)

    @aetcd.client._handle_errors
    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:  # type: ignore[has-type]
            await within(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self.channel = await self._channel()
            if self._username is not None and self._password is not None:
                self.auth_stub = aetcd.rpc.AuthStub(self.channel)
                resp = await self.auth_stub.Authenticate(
                    aetcd.rpc.AuthenticateRequest(name=self._username, password=self._password), timeout=self._timeout)
                self.metadata = (("token", resp.token),)
            self.kvstub = aetcd.rpc.KVStub(self.channel)
            self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
            self.leasestub = aetcd.rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(aetcd.rpc.WatchStub(self.channel), timeout=self._timeout,
                                                  metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


CHANNEL_OPTIONS: dict[str, object] = {
    "grpc.lb_policy_name": "round_robin",
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.min_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 1000,
}


class Store:
    """An etcd connection with the project's key layout and retry policy."""

    def __init__(self, endpoint: str, keys: Keys = Keys(), retry: RetryPolicy = RetryPolicy(),
                 rpc_timeout_s: float = 2.0, auth: EtcdAuth = EtcdAuth()) -> None:
        """``endpoint``: ``host:port``, or several separated by commas (the members of a cluster)."""
        endpoints = [e.strip() for e in endpoint.split(",")]
        for e in endpoints:
            h, _, p = e.rpartition(":")
            if not h or not p.isdigit():
                raise ValueError(f"etcd endpoint {e!r} must be host:port")
        if len(endpoints) > 1 and not auth.tls:
            # aetcd dials f"{host}:{port}"; gRPC's ipv4: target takes a list of addresses and
            # fails over between them (round robin skips members that are down). (With TLS: one
            # member at a time, see _TlsClient.)
            host, _, port = ("ipv4:" + ",".join(endpoints)).rpartition(":")
        else:
            host, _, port = endpoint.rpartition(":")
        self.endpoint = endpoint
        self.keys = keys
        self.retry = dataclasses.replace(retry, endpoint=endpoint)
        # gRPC's default reconnect backoff grows to minutes; after an etcd restart the
        # leases must be renewed within a TTL, so reconnect within a second.
        user = dict(username=auth.user or None, password=auth.password or None) if auth.user else {}
        if auth.tls:
            self.client: aetcd.Client = _TlsClient(auth.credentials(), endpoints, host=host, port=int(port),
                                                   timeout=rpc_timeout_s, options=CHANNEL_OPTIONS, **user)
        else:
            self.client = aetcd.Client(host=host, port=int(port), timeout=rpc_timeout_s, options=CHANNEL_OPTIONS,
                                       **user)
        self.tx = self.client.transactions
        self._auth, self._rpc_timeout_s = auth, rpc_timeout_s
        #: Keys returned by reads so far (an empty read counts one): what ``make bench-scale`` reports.
        self.keys_read = 0

    def single(self, endpoint: str) -> "Store":
        """A store of the same namespace and credentials on one member only (to ask that member)."""
        return Store(endpoint, self.keys, self.retry, self._rpc_timeout_s, self._auth)

    async def close(self) -> None:
        await self.client.close()

    async def once(self, fn: Callable[[], Awaitable[T]]) -> T:
        """One attempt, with aetcd's errors mapped to Temporary/Permanent."""
        channel = self.client.channel  # (the member this call goes to, if connected: see _TlsClient.move_on)
        try:
            return await fn()
        except asyncio.CancelledError:
            if (closed := _channel_closed()) is None:
                raise
            raise closed from None
        except (aerr.ClientError, TimeoutError) as e:
            if "invalid auth token" in str(e):  # etcd restarted: its tokens are gone; authenticate again
                await self.client.close()
                raise TemporaryError(str(e)) from e
            if _unreachable(e) and isinstance(self.client, _TlsClient) and len(self.client.endpoints) > 1:
                self.client.move_on(channel or self.client.channel)  # (the next call: to another member)
            raise _classify(e) from e

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """``fn`` under the retry policy."""
        async for attempt in self.retry.retrying():
            with attempt:
                return await self.once(fn)
        raise AssertionError("unreachable")

    # -- reads -------------------------------------------------------------

    async def get(self, key: str) -> KV | None:
        res = await self.call(lambda: self.client.get(key.encode()))
        self.keys_read += 1
        return None if res is None else _kv(res)

    async def get_prefix(self, prefix: str) -> tuple[int, list[KV]]:
        """All keys under ``prefix`` and the store revision they were read at."""
        res = await self.call(lambda: self.client.get_prefix(prefix.encode()))
        kvs = [_kv(kv) for kv in res]
        self.keys_read += max(1, len(kvs))
        return res.header.revision, kvs

    async def keys_under(self, prefix: str) -> list[str]:
        """The keys under ``prefix``, sorted, without their values."""
        res = await self.call(lambda: self.client.get_prefix(prefix.encode(), keys_only=True, sort_order="ascend"))
        return [kv.key.decode() for kv in res]

    async def get_range(self, start: str, end: str) -> list[KV]:
        """Keys in ``[start, end)``."""
        res = await self.call(lambda: self.client.get_range(start.encode(), end.encode()))
        kvs = [_kv(kv) for kv in res]
        self.keys_read += max(1, len(kvs))
        return kvs

    # -- writes ------------------------------------------------------------

    async def put(self, key: str, value: str, lease: int | None = None) -> None:
        await self.call(lambda: self.client.put(key.encode(), value.encode(), lease=lease))

    async def delete(self, key: str) -> None:
        await self.call(lambda: self.client.delete(key.encode()))

    async def delete_prefix(self, prefix: str) -> None:
        await self.call(lambda: self.client.delete_prefix(prefix.encode()))

    async def create(self, key: str, value: str, lease: int | None = None) -> bool:
        """Put ``key`` only if it does not exist; True when this call created it."""
        ok, _ = await self.call(lambda: self.client.transaction(
            compare=[self.tx.create(key.encode()) == 0],
            success=[self.tx.put(key.encode(), value.encode(), lease=lease)],
            failure=[],
        ))
        return bool(ok)

    async def txn(self, compare: list[Any], success: list[Any]) -> bool:
        ok, _ = await self.call(lambda: self.client.transaction(compare=compare, success=success, failure=[]))
        return bool(ok)

    async def update(self, key: str, decode: Callable[[bytes], R], change: Callable[[R], R | None],
                     guard: Sequence[Any] = ()) -> R | None:
        """Compare-and-set one record: read ``key``, ``decode`` it, ``change`` it (None: leave it
        as it is), and write the change only if nobody wrote the key meanwhile and every ``guard``
        holds (a leader's term: :meth:`mselastic.store.lease.Term.guard`). Returns what was written;
        None when the key is absent, left as it was, or changed meanwhile (nothing written).
        ``decode``'s errors (a malformed record) are raised."""
        kv = await self.get(key)
        if kv is None:
            return None
        new = change(decode(kv.value))
        if new is None:
            return None
        written = await self.txn([*guard, self.tx.mod(key.encode()) == kv.mod_revision],
                                 [self.tx.put(key.encode(), new.to_json().encode())])
        return new if written else None

    async def txn_get(self, compare: list[Any], success: list[Any], key: str) -> KV | None:
        """``txn``, then ``key`` as the transaction left it (for the next compare-and-set on its
        revision); None when a compare failed."""
        ok, responses = await self.call(lambda: self.client.transaction(
            compare=compare, success=[*success, self.tx.get(key.encode())], failure=[]))
        if not ok:
            return None
        found = responses[-1] if responses and isinstance(responses[-1], list) else []
        return _kv(found[0][1]) if found else None

    # -- leases ------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        lease = await self.call(lambda: self.client.lease(ttl_s))
        return int(lease.id)

    async def refresh(self, lease_id: int) -> int:
        """One keep-alive; the lease's remaining TTL, 0 when it has expired. Not retried."""
        reply = await self.once(lambda: self.client.refresh_lease(lease_id))
        return int(reply.TTL) if reply is not None else 0

    async def revoke(self, lease_id: int) -> None:
        await self.once(lambda: self.client.revoke_lease(lease_id))

    # -- watches -----------------------------------------------------------

    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[Any]:
        """Events under ``prefix`` from ``start_revision`` on (raises on compaction or loss)."""
        watch = await self.once(lambda: self.client.watch_prefix(prefix.encode(), start_revision=start_revision))
        try:
            async for event in watch:
                yield event
        except asyncio.CancelledError:
            if (closed := _channel_closed()) is None:
                raise
            raise closed from None
        except (aerr.ClientError, TimeoutError) as e:
            raise _classify(e) from e
        finally:
            with contextlib.suppress(Exception):  # (a channel closed meanwhile has no watcher to ask)
                await watch.cancel()
