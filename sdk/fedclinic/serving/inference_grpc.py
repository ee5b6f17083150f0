"""The ``fedclinic.v1.Inference`` gRPC service of ``fedclinic serve`` (``protos/fedclinic/v1/inference.proto``).

:class:`InferenceServicer` answers ``Predict`` and ``DescribeModel`` with the same
:class:`~fedclinic.serving.prediction_service.PredictionService` and the same bounded
:class:`~fedclinic.serving.work_pool.WorkPool` as the HTTP port. With mutual TLS every call first passes the
caller check of :class:`~fedclinic.serving.caller_policy.CallerPolicy`: a certificate of a role that may not
query the model gets ``PERMISSION_DENIED`` naming its role (``UNAUTHENTICATED`` for a missing or wrong bearer
token when ``--token-file`` is set). Statuses: a bad request ``INVALID_ARGUMENT`` (the HTTP 4xx messages), an
image above the pixel budget or a full pool ``RESOURCE_EXHAUSTED``.

The server itself is bounded too (:func:`make_grpc_server`): messages up to the body limit, at most
``max_concurrent_rpcs`` calls at once (more get ``RESOURCE_EXHAUSTED`` from gRPC), idle connections closed.
"""

from __future__ import annotations

from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedclinic.errors import FedclinicError
from fedclinic.proto import inference_pb2, inference_pb2_grpc
from fedclinic.serving.caller_policy import CallerPolicy
from fedclinic.serving.pixel_budget import ImageTooLarge
from fedclinic.serving.prediction_service import BadRequest, PredictionService
from fedclinic.serving.work_pool import PoolFull, WorkPool
from fedclinic.transport.request_parsing import UnparsableRequestInterceptor
from fedclinic.transport.rpc import TlsFiles, server_credentials

#: calls served at once on the gRPC port, by default (more are refused with RESOURCE_EXHAUSTED)
DEFAULT_MAX_CONCURRENT_RPCS = 64
#: a connection without a call for this long is closed (ms)
IDLE_CONNECTION_MS = 5 * 60 * 1000


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """``Predict`` and ``DescribeModel`` for ``service``; ``mutual_tls``: check each caller's certificate role."""

    def __init__(self, service: PredictionService, pool: WorkPool, callers: CallerPolicy, *, mutual_tls: bool) -> None:
        self.service = service
        self.pool = pool
        self.callers = callers
        self.mutual_tls = mutual_tls

    def Predict(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 - generated name
        self._check_caller(context)
        try:
            items = self.pool.run(self.service.predict_message, request)
        except (PoolFull, ImageTooLarge) as exc:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except (BadRequest, FedclinicError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return inference_pb2.PredictResponse(predictions=[_prediction_message(p) for p in items])

    def DescribeModel(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 - generated name
        self._check_caller(context)
        bundle = self.service.bundle
        image = getattr(bundle, "image", None)
        return inference_pb2.ModelDescription(family=bundle.family, labels=bundle.labels,
                                              multi_label=bundle.multi_label,
                                              threshold=(bundle.threshold or 0.0) if bundle.multi_label else 0.0,
                                              thresholds=bundle.decision().get("thresholds", {})
                                              if bundle.multi_label else {},
                                              image_size=image.size if image is not None else 0)

    def _check_caller(self, context: grpc.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata() or ())
        why = self.callers.check_token(metadata.get("authorization"))
        if why is not None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        if self.mutual_tls:
            pems = context.auth_context().get("x509_pem_cert")
            why = self.callers.check_certificate(pems[0] if pems else None)
            if why is not None:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, why)


def _prediction_message(p: dict) -> Any:
    return inference_pb2.Prediction(label=p.get("label", ""), labels=p.get("labels", []), scores=p.get("scores", {}),
                                    entities=[inference_pb2.Entity(**e) for e in p.get("entities", [])],
                                    answer=p.get("answer", ""), threshold=p.get("threshold", 0.0),
                                    thresholds=p.get("thresholds", {}))


def make_grpc_server(service: PredictionService, pool: WorkPool, address: str, tls: TlsFiles | None = None,
                     callers: CallerPolicy | None = None,
                     max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS) -> tuple[grpc.Server, int]:
    """A gRPC server with the Inference and health services bound to ``address`` (mutual TLS when ``tls`` is
    given, then with the role check). Returns (server, bound port); the caller starts it."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=min(max_concurrent_rpcs, 16),
                                                    thread_name_prefix="fedclinic-grpc"),
                         maximum_concurrent_rpcs=max_concurrent_rpcs,
                         interceptors=[UnparsableRequestInterceptor()],  # damaged bytes: INVALID_ARGUMENT
                         options=[("grpc.max_receive_message_length", service.body_limit),
                                  ("grpc.max_connection_idle_ms", IDLE_CONNECTION_MS)])
    servicer = InferenceServicer(service, pool, callers or CallerPolicy(), mutual_tls=tls is not None)
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_secure_port(address, server_credentials(tls)) if tls else server.add_insecure_port(address)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("fedclinic.v1.Inference", health_pb2.HealthCheckResponse.SERVING)
    return server, port
