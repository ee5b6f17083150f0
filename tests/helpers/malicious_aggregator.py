"""A malicious aggregator for the tests of issue 17: the real aggregator service, with the test in the middle.

:class:`MaliciousAggregator` runs fedclinic's own :class:`~aggregator_service.server.Aggregator` (real gRPC server on
127.0.0.1, mutual TLS with the federation's PKI, its SQLite store and blob store, its engine) *in the test's process*,
so the test can drive it: a :class:`Tamper` sits after the aggregator's own interceptors and rewrites what the
operator of an aggregator can rewrite: the work items each site receives (assignments, secure-aggregation phase
messages), the model chunks a site or a scientist downloads, what the services are told, what they answer. The
store (``.aggregator.store``) and blob store (``.aggregator.blobs``) are in reach too, as they are for an operator.
The agents stay real processes (``fed.start_agent``), dialing this aggregator.

Every hook gets the caller's identity ("agent site-a", "scientist scientist") and the method's full name. Hooks
are called on gRPC's worker threads; a Tamper that keeps state guards it itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Iterator

import grpc

from aggregator_service.auth import peer_identity
from aggregator_service.config import AggregatorConfig
from aggregator_service.server import Aggregator
from fedclinic.federation.local_federation import LocalFederation, to_toml
from fedclinic.proto import agent_pb2, tensors_pb2
from fedclinic.transport.handler_wrapping import rewrap

WATCH_WORK = "/fedclinic.v1.AgentService/WatchWork"
AGENT_FETCH = "/fedclinic.v1.AgentService/FetchModel"
CONTROL_FETCH = "/fedclinic.v1.Control/FetchModel"


class Tamper:
    """The honest default: every hook passes its message through. Override what the attack changes."""

    def work_item(self, caller: str, item: agent_pb2.WorkItem) -> Iterable[agent_pb2.WorkItem]:
        """What ``caller`` receives on WatchWork instead of ``item`` (any number of items; [] drops it)."""
        return [item]

    def model_chunk(self, caller: str, method: str, chunk: tensors_pb2.ModelChunk) -> Iterable[tensors_pb2.ModelChunk]:
        """What ``caller`` receives on a FetchModel stream (agent or control) instead of ``chunk``."""
        return [chunk]

    def request(self, caller: str, method: str, request: Any) -> Any:
        """The request (or each message of a request stream) as the aggregator's services see it."""
        return request

    def response(self, caller: str, method: str, response: Any) -> Any:
        """The answer of a unary call as ``caller`` receives it."""
        return response

    def stream_response(self, caller: str, method: str, response: Any) -> Iterable[Any]:
        """Each message of any other response stream (WatchTask, ...)."""
        return [response]


def _caller(context: grpc.ServicerContext) -> str:
    ident = peer_identity(context)
    return f"{ident.role} {ident.name}"


class TamperInterceptor(grpc.ServerInterceptor):
    """Puts a :class:`Tamper` on every call (after auth, errors and limits; next to the services)."""

    def __init__(self, tamper: Tamper) -> None:
        self.tamper = tamper

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        t = self.tamper

        def requests_of(request, context):
            caller = _caller(context)
            if handler.request_streaming:
                return (t.request(caller, method, m) for m in request)
            return t.request(caller, method, request)

        def responses_of(responses: Iterator, caller: str) -> Iterator:
            for r in responses:
                if method == WATCH_WORK:
                    yield from t.work_item(caller, r)
                elif method in (AGENT_FETCH, CONTROL_FETCH):
                    yield from t.model_chunk(caller, method, r)
                else:
                    yield from t.stream_response(caller, method, r)

        def unary(behavior):
            def inner(request, context):
                caller = _caller(context)
                return t.response(caller, method, behavior(requests_of(request, context), context))
            return inner

        def streaming(behavior):
            def inner(request, context):
                caller = _caller(context)
                yield from responses_of(behavior(requests_of(request, context), context), caller)
            return inner

        return rewrap(handler, unary=unary, streaming=streaming)


class MaliciousAggregator:
    """The federation's aggregator, run in this process with ``tamper`` in the middle (module docstring).

    Use instead of ``fed.start_aggregator()``: ``with MaliciousAggregator(fed, tamper) as evil: fed.start_agent(...)``.
    """

    def __init__(self, fed: LocalFederation, tamper: Tamper | None = None, **settings: Any) -> None:
        self.fed = fed
        self.tamper = tamper or Tamper()
        state = fed.root / "aggregator-state"
        state.mkdir(exist_ok=True)
        cfg = {"listen": "127.0.0.1:0", "state_dir": str(state), "log_level": fed.log_level, "heartbeat_s": 2.0,
               **fed.aggregator_settings, **fed.aggregator_state(state), **settings,
               "tls": {**fed.creds("aggregator"), "crl": str(fed.ca_dir / "crl.pem")}}
        path: Path = fed.root / "aggregator.toml"
        path.write_text(to_toml(cfg))
        self.aggregator = Aggregator(AggregatorConfig.load(path), interceptors=[TamperInterceptor(self.tamper)])

    @property
    def store(self):
        return self.aggregator.store

    @property
    def blobs(self):
        return self.aggregator.blobs

    def start(self) -> str:
        self.aggregator.start()
        self.fed.address = self.aggregator.address
        return self.fed.address

    def stop(self) -> None:
        self.aggregator.stop(grace=2.0)

    def __enter__(self) -> "MaliciousAggregator":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
