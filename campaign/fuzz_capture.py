"""Valid messages captured from a real run: what the SDK's client and a real hospital agent send over their
channels, recorded by a client interceptor (the messages the fuzzer then mutates).

:func:`recording_channels` patches the channel factory that ``fedclinic.client`` and ``hospital_agent.connection``
use, in this process only, so that every channel they open records each request message (unary or streamed,
pre-serialized bytes included) into a :class:`Capture` under its full method name.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from typing import Any, Iterator

import grpc


class Capture:
    """Requests seen per method: ``calls[method]`` is a list of calls, each a list of serialized messages."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: dict[str, list[list[bytes]]] = defaultdict(list)

    def add(self, method: str, messages: list[bytes]) -> None:
        with self._lock:
            self.calls[method].append(messages)

    def messages(self, method: str, cls: Any) -> list[Any]:
        """Every message sent to ``method`` (all calls, in order), parsed as ``cls``."""
        return [cls.FromString(m) for call in self.calls.get(method, []) for m in call]

    def streams(self, method: str, cls: Any) -> list[list[Any]]:
        """Each call to ``method`` as its list of messages, parsed as ``cls``."""
        return [[cls.FromString(m) for m in call] for call in self.calls.get(method, [])]


def _serialize(message: Any) -> bytes:
    return message if isinstance(message, (bytes, bytearray)) else message.SerializeToString()


class _Recorder(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, capture: Capture) -> None:
        self.capture = capture

    def intercept_unary_unary(self, continuation, details, request):
        self.capture.add(details.method, [_serialize(request)])
        return continuation(details, request)

    def intercept_unary_stream(self, continuation, details, request):
        self.capture.add(details.method, [_serialize(request)])
        return continuation(details, request)

    def _record_stream(self, method: str, requests: Iterator[Any]) -> Iterator[Any]:
        seen: list[bytes] = []
        try:
            for r in requests:
                seen.append(_serialize(r))
                yield r
        finally:
            self.capture.add(method, seen)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(details, self._record_stream(details.method, requests))

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(details, self._record_stream(details.method, requests))


@contextlib.contextmanager
def recording_channels(capture: Capture) -> Iterator[Capture]:
    """While entered, channels opened by the SDK's control channel (``fedclinic.control_channel``, which
    ``fedclinic.client`` dials through) and ``hospital_agent.connection`` record into ``capture`` (module docstring)."""
    import fedclinic.control_channel as client_mod
    import hospital_agent.connection as conn_mod

    originals = (client_mod.secure_channel, conn_mod.secure_channel_pem)
    recorder = _Recorder(capture)

    def wrap(factory):
        def make(*args, **kwargs):
            return grpc.intercept_channel(factory(*args, **kwargs), recorder)
        return make

    client_mod.secure_channel = wrap(originals[0])
    conn_mod.secure_channel_pem = wrap(originals[1])
    try:
        yield capture
    finally:
        client_mod.secure_channel, conn_mod.secure_channel_pem = originals
