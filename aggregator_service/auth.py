"""Authorization from the peer certificate: who is calling, in which role, and is the certificate revoked.

The TLS layer has already checked that the client certificate chains to our CA and is within its validity
window (otherwise there is no connection). This interceptor then reads the certificate from the call's
``auth_context`` (never from a message field), maps it to a :class:`PeerIdentity`, refuses revoked
certificates (CRL from ``fedclinic pki revoke``, reloaded when the file changes) and enforces which role
may call which service. A certificate revoked while a streaming call is open ends that call before its next
message (``UNAUTHENTICATED``): an agent's WatchWork stream at the latest one heartbeat after the CRL changed,
an update upload at its next chunk.

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
    def __init__(self, revocations: RevocationList | None, on_refusal: Callable[[str, str, str], None] | None = None,
                 count_refusal: Callable[[str], None] | None = None) -> None:
        self.revocations = revocations
        self.on_refusal = on_refusal
        #: called with the refusal's kind: "no_certificate", "revoked" or "role" (the metrics)
        self.count_refusal = count_refusal

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        service = method.rsplit("/", 2)[-2] if method.count("/") >= 2 else ""
        allowed = ROLES_BY_SERVICE.get(service, frozenset())
        return _wrap(handler, lambda ctx: self._check(ctx, method, allowed),
                     lambda ctx, ident: self._still_valid(ctx, method, ident))

    def _check(self, context: grpc.ServicerContext, method: str, allowed: frozenset[str]) -> PeerIdentity | None:
        """At the start of every call: a certificate with a fedclinic identity, not revoked, of an allowed role."""
        try:
            ident = peer_identity(context)
        except PkiError as exc:
            self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, str(exc), method, "?", "no_certificate")
            return None
        if self._revoked(ident):
            self._refuse(context, grpc.StatusCode.UNAUTHENTICATED,
                         f"certificate {ident.serial_hex} of {ident.role} {ident.name!r} has been revoked; "
                         "ask the fedclinic administrator for a new certificate", method, ident.name, "revoked")
            return None
        if ident.role not in allowed:
            need = " or ".join(sorted(allowed)) or "no role"
            self._refuse(context, grpc.StatusCode.PERMISSION_DENIED,
                         f"a certificate with role {ident.role!r} may not call {method}; it needs role {need}",
                         method, ident.name, "role")
        return ident

    def _still_valid(self, context: grpc.ServicerContext, method: str, ident: PeerIdentity | None) -> None:
        """Before each further message of a streaming call: end the call if its certificate was revoked since
        it started (the CRL file is re-read when it changes)."""
        if ident is not None and self._revoked(ident):
            self._refuse(context, grpc.StatusCode.UNAUTHENTICATED,
                         f"certificate {ident.serial_hex} of {ident.role} {ident.name!r} was revoked while this "
                         f"call was open; the call is ended. Ask the fedclinic administrator for a new certificate",
                         method, ident.name, "revoked")

    def _revoked(self, ident: PeerIdentity) -> bool:
        if self.revocations is None:
            return False
        self.revocations.reload_if_changed()
        return self.revocations.is_revoked(ident.serial_hex)

    def _refuse(self, context, code, message: str, method: str, who: str, kind: str) -> None:
        log.warning("call refused", method=method, peer=who, reason=message)
        if self.count_refusal is not None:
            self.count_refusal(kind)
        if self.on_refusal is not None:
            self.on_refusal(who, message, method)  # (peer name, reason, method): the audit trail
        context.abort(code, message)


def _wrap(handler: grpc.RpcMethodHandler, check: Callable[[grpc.ServicerContext], PeerIdentity | None],
          recheck: Callable[[grpc.ServicerContext, PeerIdentity | None], None]) -> grpc.RpcMethodHandler:
    """``handler`` with ``check`` at the start of each call and ``recheck`` before every further message a
    streaming call receives or sends (so a revoked peer's open stream ends at its next message, and a
    WatchWork stream sends a heartbeat every heartbeat_s)."""

    def rechecked(messages, context, ident):
        for message in messages:
            recheck(context, ident)
            yield message

    def unary(behavior, streaming_request: bool = False):
        def inner(request, context):
            ident = check(context)
            return behavior(rechecked(request, context, ident) if streaming_request else request, context)
        return inner

    def streaming(behavior, streaming_request: bool = False):
        def inner(request, context):
            ident = check(context)
            responses = behavior(rechecked(request, context, ident) if streaming_request else request, context)
            try:
                for response in responses:
                    recheck(context, ident)
                    yield response
            finally:
                close = getattr(responses, "close", None)  # a generator's own cleanup (WatchWork's disconnect) runs now
                if close is not None:
                    close()
        return inner

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), handler.request_deserializer,
                                                   handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), handler.request_deserializer,
                                                    handler.response_serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary, True), handler.request_deserializer,
                                                    handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream, True), handler.request_deserializer,
                                                 handler.response_serializer)
