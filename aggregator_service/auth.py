"""Authorization from the peer certificate: who is calling, in which role, and is the certificate revoked.

The TLS layer has already checked that the client certificate chains to our CA and is within its validity
window (otherwise there is no connection). This interceptor then reads the certificate from the call's
``auth_context`` (never from a message field), maps it to a :class:`PeerIdentity`, refuses revoked
certificates (CRL from ``fedclinic pki revoke``, reloaded when the file changes) and enforces which role
may call which service:

- ``fedclinic.v1.AgentService``: role ``agent``;
- ``fedclinic.v1.Control``: roles ``scientist`` and ``admin``;
- ``grpc.health.v1.Health``: any valid certificate.
"""

from __future__ import annotations

from typing import Callable

import grpc
import structlog

from fedclinic.pki import PeerIdentity, PkiError, RevocationList, identity_from_pem

log = structlog.get_logger("fedclinic.aggregator.auth")

ROLES_BY_SERVICE: dict[str, frozenset[str]] = {
    "fedclinic.v1.AgentService": frozenset({"agent"}),
    "fedclinic.v1.Control": frozenset({"scientist", "admin"}),
    "grpc.health.v1.Health": frozenset({"agent", "scientist", "admin", "aggregator"}),
}


def peer_identity(context: grpc.ServicerContext) -> PeerIdentity:
    """The caller's identity, parsed from its mTLS certificate (cached per certificate)."""
    pems = context.auth_context().get("x509_pem_cert")
    if not pems:
        raise PkiError("the call carries no client certificate; connect with mutual TLS")
    return identity_from_pem(pems[0])


class AuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, revocations: RevocationList | None, on_refusal: Callable[[str, str, str], None] | None = None) -> None:
        self.revocations = revocations
        self.on_refusal = on_refusal

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        service = method.rsplit("/", 2)[-2] if method.count("/") >= 2 else ""
        allowed = ROLES_BY_SERVICE.get(service, frozenset())
        return _wrap(handler, lambda ctx: self._check(ctx, method, allowed))

    def _check(self, context: grpc.ServicerContext, method: str, allowed: frozenset[str]) -> None:
        try:
            ident = peer_identity(context)
        except PkiError as exc:
            self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, str(exc), method, "?")
            return
        if self.revocations is not None:
            self.revocations.reload_if_changed()
            if self.revocations.is_revoked(ident.serial_hex):
                self._refuse(context, grpc.StatusCode.UNAUTHENTICATED,
                             f"certificate {ident.serial_hex} of {ident.role} {ident.name!r} has been revoked; "
                             "ask the fedclinic administrator for a new certificate", method, ident.name)
                return
        if ident.role not in allowed:
            need = " or ".join(sorted(allowed)) or "no role"
            self._refuse(context, grpc.StatusCode.PERMISSION_DENIED,
                         f"a certificate with role {ident.role!r} may not call {method}; it needs role {need}",
                         method, ident.name)

    def _refuse(self, context, code, message: str, method: str, who: str) -> None:
        log.warning("call refused", method=method, peer=who, reason=message)
        if self.on_refusal is not None:
            self.on_refusal(who, message, method)  # (peer name, reason, method): the audit trail
        context.abort(code, message)


def _wrap(handler: grpc.RpcMethodHandler, check: Callable[[grpc.ServicerContext], None]) -> grpc.RpcMethodHandler:
    def unary(behavior):
        def inner(request, context):
            check(context)
            return behavior(request, context)
        return inner

    def streaming(behavior):
        def inner(request, context):
            check(context)
            yield from behavior(request, context)
        return inner

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), handler.request_deserializer,
                                                   handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), handler.request_deserializer,
                                                    handler.response_serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), handler.request_deserializer,
                                                    handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), handler.request_deserializer,
                                                 handler.response_serializer)
