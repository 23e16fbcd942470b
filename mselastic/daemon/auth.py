"""Who may call what: every RPC of both services is checked against the caller's roles.

Roles, as Kubernetes maps certificate groups: the *organisation* (O) of a TLS client
certificate names its role, its common name (CN) who it is.

- ``node``: elasticd itself (agents and the coordinator): ``Agent.Launch`` and ``Agent.Stop``,
  only from the node that currently leads (its certificate's CN is the leader's node id);
- ``admin``: every ``elasticctl`` command;
- ``viewer``: status, nodes, jobs, describe (env values hidden for everyone), events, and
  ``Agent.Status``.

Transports without certificates: the local Unix socket (mode 0660, owner root, group
``socket_group``) is admin and node — whoever may open it is trusted like root — and plain
TCP is a viewer, unless ``insecure_listen = true`` makes it everything (a network the admin
trusts). So on the single-machine default a local user reaches the TCP port and can look,
not act, and a job is submitted through the socket.
"""

from __future__ import annotations

import enum
from typing import Any, Awaitable, Callable

import grpc


class Role(str, enum.Enum):
    NODE = "node"
    ADMIN = "admin"
    VIEWER = "viewer"


ALL = frozenset(Role)
#: Method (its last path element, per service) -> the roles that may call it.
RULES: dict[str, frozenset[Role]] = {
    "/mselastic.v1.Control/Status": ALL,
    "/mselastic.v1.Control/Events": ALL,
    "/mselastic.v1.Control/Describe": ALL,
    "/mselastic.v1.Control/Submit": frozenset({Role.ADMIN}),
    "/mselastic.v1.Control/StopJob": frozenset({Role.ADMIN}),
    "/mselastic.v1.Control/Cordon": frozenset({Role.ADMIN}),
    "/mselastic.v1.Control/Restart": frozenset({Role.ADMIN}),
    "/mselastic.v1.Control/Scale": frozenset({Role.ADMIN}),
    "/mselastic.v1.Control/DeleteJob": frozenset({Role.ADMIN}),
    "/mselastic.v1.Agent/Status": ALL,
    "/mselastic.v1.Agent/Logs": frozenset({Role.ADMIN}),
    "/mselastic.v1.Agent/Launch": frozenset({Role.NODE}),
    "/mselastic.v1.Agent/Stop": frozenset({Role.NODE}),
    "/mselastic.v1.Agent/Nudge": frozenset({Role.NODE}),
}
#: Methods a node identity may call only while it leads.
LEADER_ONLY = frozenset({"/mselastic.v1.Agent/Launch", "/mselastic.v1.Agent/Stop"})


class Caller:
    """Who called: the roles and, for a certificate, its common name ("" otherwise)."""

    def __init__(self, roles: frozenset[Role], name: str = "", via: str = "", certified: bool = False,
                 serial: int = 0) -> None:
        self.roles, self.name, self.via, self.certified, self.serial = roles, name, via, certified, serial


def caller(context: grpc.aio.ServicerContext, insecure: bool) -> Caller:
    peer = context.peer() or ""
    if peer.startswith("unix:"):
        return Caller(frozenset({Role.ADMIN, Role.NODE, Role.VIEWER}), via="the local socket")
    auth = context.auth_context()
    pem = (auth.get("x509_pem_cert") or [b""])[0]
    if pem:
        from cryptography import x509
        from cryptography.x509.oid import NameOID

        cert = x509.load_pem_x509_certificate(pem)
        orgs = {a.value for a in cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)}
        names = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
        roles = frozenset(r for r in Role if r.value in orgs)
        name = names[0] if names else ""
        return Caller(roles, name, via=f"certificate {name or '(no CN)'}", certified=True, serial=cert.serial_number)
    if insecure:
        return Caller(ALL, via="plaintext (insecure_listen = true)")
    return Caller(frozenset({Role.VIEWER}), via="plaintext TCP")


class Authorizer(grpc.aio.ServerInterceptor):
    """Checks every call; ``leader`` returns the node id that currently leads ("" unknown),
    ``revoked`` the serials of the certificates the CA revoked (``tls_crl``; read per call)."""

    def __init__(self, insecure: bool, leader: Callable[[], Awaitable[str]],
                 revoked: Callable[[], frozenset[int]] = frozenset) -> None:
        self.insecure = insecure
        self.leader = leader
        self.revoked = revoked

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        method = details.method
        if handler is None:
            return handler
        allowed = RULES.get(method, frozenset())

        async def check(context: grpc.aio.ServicerContext) -> None:
            who = caller(context, self.insecure)
            if who.certified and who.serial in self.revoked():
                await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                    f"{who.via} (serial {who.serial:x}) is revoked (tls_crl): ask for a new one")
            if not who.roles & allowed:
                need = " or ".join(sorted(r.value for r in allowed)) or "nobody"
                hint = (" (elasticctl reaches elasticd as admin through its Unix socket, --endpoint unix:PATH, or "
                        "with an admin certificate)" if Role.ADMIN in allowed else "")
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"{method.rsplit('/', 1)[-1]} needs the {need} role; {who.via} has "
                                    f"{', '.join(sorted(r.value for r in who.roles)) or 'none'}{hint}")
            if method in LEADER_ONLY and who.certified:
                leader = await self.leader()
                if not leader:  # etcd unreadable or an election under way: ask again, not a refusal
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        f"{method.rsplit('/', 1)[-1]}: which node leads is not known here yet")
                if who.name != leader:
                    await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                        f"{method.rsplit('/', 1)[-1]} only from the leading node ({leader or 'unknown'}), "
                                        f"not {who.name}")

        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await check(context)
                return await inner_uu(request, context)
            return grpc.unary_unary_rpc_method_handler(unary_unary, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await check(context)
                async for item in inner_us(request, context):
                    yield item
            return grpc.unary_stream_rpc_method_handler(unary_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        return None  # a client-streaming method (there is none) is not served unchecked
