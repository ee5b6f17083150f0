"""Request messages that do not parse are the caller's fault: refuse them with INVALID_ARGUMENT.

grpc parses a request with the method's deserializer before any handler or interceptor code runs; a parser
exception becomes ``INTERNAL: Exception deserializing request!`` and a traceback in the server's log, which
reads as a server fault and floods the log with what a fuzzer (or a damaged link) sends. The fix is to parse
leniently (:func:`lenient_parser` turns a parser failure into the :data:`UNPARSABLE` marker) and refuse the
marker in the handler (:func:`checked_requests`). Servers with their own handler-wrapping interceptor
(aggregator_service.rpc_errors.ErrorInterceptor) use the two functions; others add
:class:`UnparsableRequestInterceptor`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import grpc
from fedclinic.transport.handler_wrapping import rewrap


class _Unparsable:
    """What :func:`lenient_parser` hands on for bytes its parser refused."""

    def __repr__(self) -> str:
        return "UNPARSABLE"


UNPARSABLE: Any = _Unparsable()


def lenient_parser(parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``parse`` (a message's ``FromString``), returning :data:`UNPARSABLE` instead of raising."""
    if parse is None:
        return None

    def lenient(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception:  # noqa: BLE001 - any parser failure is the caller's damaged message
            return UNPARSABLE
    return lenient


def refuse_unparsable(context: grpc.ServicerContext, method: str) -> None:
    """Abort the call with INVALID_ARGUMENT naming ``method``."""
    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                  f"a request message to {method} does not parse as the message it expects (damaged, cut, or not "
                  "a fedclinic message); send a well-formed message from a fedclinic client of this version")


def _parsed_stream(requests: Iterator[Any], context: grpc.ServicerContext, method: str) -> Iterator[Any]:
    for r in requests:
        if r is UNPARSABLE:
            refuse_unparsable(context, method)
        yield r


def checked_requests(request: Any, context: grpc.ServicerContext, method: str, streamed: bool) -> Any:
    """The request (or, for a client stream, an iterator over its messages) with :data:`UNPARSABLE` refused."""
    if streamed:
        return _parsed_stream(request, context, method)
    if request is UNPARSABLE:
        refuse_unparsable(context, method)
    return request


class UnparsableRequestInterceptor(grpc.ServerInterceptor):
    """Every method of the server parses leniently and refuses a message that does not parse."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        streamed = handler.request_streaming
        parse = lenient_parser(handler.request_deserializer)

        def wrap(behavior: Callable) -> Callable:
            def inner(request, context):
                return behavior(checked_requests(request, context, method, streamed), context)
            return inner

        return rewrap(handler, unary=wrap, streaming=wrap, request_deserializer=parse)
