"""The last line of every RPC handler: a failure the handler did not map itself still reaches the caller as a
gRPC status that says what to do, never as ``UNKNOWN`` with the exception's text (which can hold a server path,
e.g. a missing blob's file name, or a database error).

:class:`ErrorInterceptor` wraps each handler (unary and streaming). A status the handler set itself
(``context.abort``) and a cancelled call pass through unchanged; anything else is logged with its traceback under
an error id, and the caller gets :func:`status_for`'s code and message with that id (no exception text):

==================================================  ===================  =========================================
failure                                             code                 what the message says to do
==================================================  ===================  =========================================
disk or quota full (ENOSPC, EDQUOT, SQLite FULL)    RESOURCE_EXHAUSTED   ask the operator to free space; retry
out of memory                                       RESOURCE_EXHAUSTED   retry later or ask the operator
a stored file missing (FileNotFoundError)           FAILED_PRECONDITION  ask the operator to check the store
anything else                                       INTERNAL             ask the operator (the log has the id)
==================================================  ===================  =========================================

A request message that does not parse (damaged bytes, another protocol) is refused with INVALID_ARGUMENT
naming the method, instead of grpc's own ``INTERNAL: Exception deserializing request!`` and a traceback in the
log (fedclinic.transport.request_parsing).
"""

from __future__ import annotations

import uuid
from typing import Callable

import grpc
import structlog

from fedclinic.runtime.disk_errors import is_disk_full
from fedclinic.transport.handler_wrapping import rewrap
from fedclinic.transport.request_parsing import checked_requests, lenient_parser

log = structlog.get_logger("fedclinic.aggregator.rpc")


def status_for(exc: BaseException, error_id: str) -> tuple[grpc.StatusCode, str]:
    """The status and message a caller gets for an exception no handler mapped (module docstring); the message
    never contains the exception's text, only ``error_id``, under which the aggregator's log has the details."""
    ref = f"(error id {error_id} in the aggregator's log)"
    if is_disk_full(exc):
        return (grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the aggregator's disk is full, so nothing of this call was stored {ref}; ask its operator to free "
                "space, then try again (a submission or upload may be repeated safely with the same idempotency key)")
    if isinstance(exc, MemoryError):
        return (grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the aggregator ran out of memory on this call {ref}; try again later, or ask its operator")
    if isinstance(exc, FileNotFoundError):
        return (grpc.StatusCode.FAILED_PRECONDITION,
                f"data the aggregator stored for this call is missing {ref}; ask its operator to check its store "
                "(or restore it from a backup)")
    return (grpc.StatusCode.INTERNAL,
            f"the aggregator failed on this call {ref}; ask its operator, the log names the cause")


def _passes_through(exc: BaseException, context: grpc.ServicerContext) -> bool:
    """A cancelled call (grpc.RpcError from the request stream) or a status the handler already set (abort)."""
    return isinstance(exc, grpc.RpcError) or context.code() not in (None, grpc.StatusCode.OK)


def _fail(exc: Exception, context: grpc.ServicerContext, method: str) -> None:
    error_id = uuid.uuid4().hex[:12]
    code, message = status_for(exc, error_id)
    log.error("call failed", method=method, error_id=error_id, code=code.name, exc_info=exc)
    context.abort(code, message)


def _guard(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    streamed = handler.request_streaming

    def checked(request, context):
        return checked_requests(request, context, method, streamed)

    def unary(behavior: Callable):
        def inner(request, context):
            try:
                return behavior(checked(request, context), context)
            except Exception as exc:  # noqa: BLE001 - mapped to a status; aborts pass through
                if _passes_through(exc, context):
                    raise
                _fail(exc, context, method)
        return inner

    def streaming(behavior: Callable):
        def inner(request, context):
            try:
                yield from behavior(checked(request, context), context)
            except Exception as exc:  # noqa: BLE001 - mapped to a status; aborts pass through
                if _passes_through(exc, context):
                    raise
                _fail(exc, context, method)
        return inner

    return rewrap(handler, unary=unary, streaming=streaming,
                  request_deserializer=lenient_parser(handler.request_deserializer))


class ErrorInterceptor(grpc.ServerInterceptor):
    """Wraps every handler so that no exception reaches a caller as UNKNOWN with its text (module docstring).
    Listed after the auth interceptor: it sees the servicer's failures, not the authentication's refusals."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return _guard(handler, handler_call_details.method)
