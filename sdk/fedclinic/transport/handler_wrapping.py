"""Run code around a gRPC method: one place that rebuilds a method handler of any of the four kinds.

A server interceptor that wraps methods (the aggregator's error mapping and per-peer limits, the lenient request
parser, the test suite's tampering aggregator) replaces a handler's *behavior* and keeps its serializers. gRPC
Python has one constructor per kind; :func:`rewrap` picks it, so each interceptor only says what it does around
a method that answers one message (``unary``) and around one that answers a stream (``streaming``).
"""

from __future__ import annotations

from typing import Any, Callable

import grpc

Behavior = Callable[[Any, grpc.ServicerContext], Any]


def rewrap(handler: grpc.RpcMethodHandler, *, unary: Callable[[Behavior], Behavior],
           streaming: Callable[[Behavior], Behavior],
           request_deserializer: Callable[[bytes], Any] | None = None) -> grpc.RpcMethodHandler:
    """``handler`` with its behavior ``b`` replaced by ``unary(b)`` (unary-unary, stream-unary) or
    ``streaming(b)`` (unary-stream, stream-stream), parsing requests with ``request_deserializer`` when given (the
    handler's own otherwise)."""
    h = handler
    parse = request_deserializer or h.request_deserializer
    if h.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(h.unary_unary), parse, h.response_serializer)
    if h.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming(h.unary_stream), parse, h.response_serializer)
    if h.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(h.stream_unary), parse, h.response_serializer)
    return grpc.stream_stream_rpc_method_handler(streaming(h.stream_stream), parse, h.response_serializer)
