"""``fedclinic serve BUNDLE``: an HTTP/JSON (and optionally gRPC) inference service for an exported model bundle.

API (JSON in, JSON out; every error is ``{"error": "..."}`` with a 4xx/5xx status)::

    GET  /healthz                -> 200 {"status": "ok"}                      (the process is up)
    GET  /readyz                 -> 200 {"ready": true, "model": {...}}      (the model is loaded; "model" has
                                                                              the model card's summary in "card"
                                                                              when the bundle has a card)
    POST /v1/predict             {"texts": ["...", ...]}                     (text bundles)
                                 {"features": [[...], ...]}                   (feature bundles)
                                 {"texts": [question, ...], "contexts": [context, ...]}
                                                                              (question-answering bundles;
                                                                              "contexts" optional, one per
                                                                              question, "" for none)
                                 {"images": [base64, ...], "texts": [report, ...]}
                                                                              (image-text bundles: one image per
                                                                              report, each the base64 of a PNG,
                                                                              JPEG or DICOM file's bytes; a
                                                                              "data:...;base64," prefix is allowed)
                             -> 200 {"predictions": [{"label": ..., "scores": {...}}, ...]}
                                    multi-label (image-text too): [{"labels": [...], "scores": {...},
                                    "threshold": t}, ...] (with tuned per-label thresholds "thresholds":
                                    {label: t} instead); NER: [{"entities": [...]}, ...];
                                    question-answering: [{"answer": "..."}, ...]

Before anything of the bundle is loaded its signature is checked (:mod:`fedclinic.serving.bundle_trust`): a bundle
whose signature fails (a file edited, added or missing; a signer from another CA) is refused with exit code 2
naming what failed, and an unsigned one unless ``--allow-unsigned``.

Statuses: 400 a bad request (named input), 401 no/wrong bearer token, 403 a client certificate of a role not
allowed, 404/405 unknown path/method, 408 body too slow, 413 body or image too large, 422 what the model
refuses (an empty text, a question longer than the prompt budget), 503 busy (with ``Retry-After``; past
``--max-connections`` it is uvicorn's own plain-text 503, and the connection is closed).

The HTTP stack is uvicorn (h11's HTTP/1.1 parser) with Starlette, not hand-rolled request handling, and every
resource a client can hold is bounded (defaults; each has a flag of ``fedclinic serve``):

==============================  =======================================================================
``--max-body``                  1 MiB per request (64 MiB for image-text bundles), counted on the bytes
                                read, whatever Content-Length says; a declared excess is refused unread
``--max-inflight-bytes``        4 x ``--max-body``: all request bodies held in memory at once
``--max-connections``           1000 open connections (more requests: 503)
``--backlog``                   2048 pending connections in the listen queue
``--header-timeout``            10 s for the request line and headers, however slowly they trickle
``--body-timeout``              60 s for the whole body
``--keep-alive-timeout``        5 s idle between requests on a kept-alive connection
``--inference-workers``         2 threads run predictions; ``--inference-queue`` 16 more wait, then 503
``--max-image-pixels``          25,000,000 pixels per image, read from the header before decoding (413);
                                Pillow's decompression-bomb limit is set to the same budget
``--grpc-max-concurrent-rpcs``  64 calls at once on the gRPC port
==============================  =======================================================================

Inputs per call: ``MAX_ITEMS`` texts or feature rows, ``MAX_QUESTIONS`` questions, ``MAX_IMAGES`` image + report
pairs (:mod:`fedclinic.serving.prediction_service`).

Security: the server binds to 127.0.0.1 and speaks plain HTTP by default, for use behind the hospital's
reverse proxy or integration engine. ``--https`` (with ``--cert/--key/--ca`` from ``fedclinic pki``) serves
HTTPS that requires a client certificate of the fedclinic CA (``--https tls``: server certificate only, then
``--token-file`` is required). ``--token-file`` requires ``Authorization: Bearer <token>`` on every request but
``/healthz``. Client certificates must have a role allowed to query a model (``--allow-roles``, default
scientist and agent; :mod:`fedclinic.serving.caller_policy`); with ``--crl`` revoked certificates are refused.

With ``--grpc-port`` the same predictions are also served by the ``fedclinic.v1.Inference`` gRPC service
(:mod:`fedclinic.serving.inference_grpc`) with the standard health service; with ``--cert/--key/--ca`` that port
requires mutual TLS and the same role check. SIGTERM and SIGINT stop both gracefully (exit status 0).
"""

from __future__ import annotations

import contextlib
import logging
import resource
import signal
import socket
import ssl
import threading
from typing import Any, Callable, Iterator

import uvicorn

from fedclinic.errors import ConfigError
from fedclinic.serving.caller_policy import CallerPolicy
from fedclinic.serving.guarded_h11 import GuardedH11Protocol
from fedclinic.serving.http_app import HttpApp
from fedclinic.serving.pixel_budget import PixelBudget
from fedclinic.serving.prediction_service import PredictionService
from fedclinic.serving.serve_limits import ServeLimits
from fedclinic.serving.work_pool import WorkPool

#: seconds a stopping server waits for requests in progress
GRACEFUL_STOP_S = 10


class UvicornServer(uvicorn.Server):
    """uvicorn's server, telling us when it listens, and ending on SIGTERM/SIGINT with status 0 (uvicorn
    re-raises the signal after a graceful stop, which would end the process with -15)."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_started = on_started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._on_started()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


class InferenceServer:
    """One ``fedclinic serve`` process's servers: HTTP(S) on ``host:port`` and, with ``grpc_port``, gRPC.

    The HTTP socket is bound at construction (:attr:`http_port` is known at once); :meth:`serve` runs until
    SIGTERM/SIGINT (or :meth:`stop`). ``https``: None (plain HTTP), ``"mtls"`` (client certificate required)
    or ``"tls"``; both need ``tls``, the files that also secure the gRPC port."""

    def __init__(self, bundle: Any, host: str = "127.0.0.1", port: int = 8080, *, limits: ServeLimits = ServeLimits(),
                 tls: Any = None, https: str | None = None, callers: CallerPolicy | None = None,
                 grpc_port: int | None = None) -> None:
        limits.check()
        if https is not None and tls is None:
            raise ConfigError("--https needs --cert, --key and --ca (this server's certificate from `fedclinic pki`)")
        self.callers = callers or CallerPolicy()
        if https == "tls" and not self.callers.needs_token:
            raise ConfigError("--https tls checks no client certificate, so it would let anyone in: add --token-file, "
                              "or use --https mtls")
        budget = PixelBudget(limits.max_image_pixels)
        budget.install()
        self.service = PredictionService(bundle, budget, limits.max_body)
        if limits.max_inflight_bytes is not None and limits.max_inflight_bytes < self.service.body_limit:
            raise ConfigError(f"--max-inflight-bytes ({limits.max_inflight_bytes}) must be at least --max-body "
                              f"({self.service.body_limit})")
        self.limits = limits
        self.host = host
        self.pool = WorkPool(limits.inference_workers, limits.inference_queue)
        self.app = HttpApp(self.service, self.pool, self.callers, body_timeout=limits.body_timeout,
                           max_inflight_bytes=limits.max_inflight_bytes, client_certificates=https == "mtls")
        self.scheme = "https" if https else "http"
        _raise_open_file_limit(limits.max_connections + 256)
        self._socket = bind_listener(host, port)
        self.http_port: int = self._socket.getsockname()[1]
        ssl_context = server_ssl_context(tls, client_certificates=https == "mtls") if https else None
        config = uvicorn.Config(self.app.asgi, http=GuardedH11Protocol.with_header_timeout(limits.header_timeout),
                                loop="asyncio", lifespan="off", ws="none", interface="asgi3",
                                limit_concurrency=limits.max_connections, backlog=limits.backlog,
                                timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]
                                timeout_graceful_shutdown=GRACEFUL_STOP_S, log_config=None, access_log=False,
                                server_header=False, proxy_headers=False,
                                ssl_context_factory=(lambda _config, _default: ssl_context) if ssl_context else None)
        self._started = threading.Event()
        self._on_ready: Callable[[dict[str, int]], None] | None = None
        self._uvicorn = UvicornServer(config, self._now_ready)
        self.grpc_server = None
        self.grpc_port: int | None = None
        if grpc_port is not None:
            # lazy: protobuf/grpc load only when serving over gRPC (HTTP serving has neither)
            from fedclinic.serving.inference_grpc import make_grpc_server

            self.grpc_server, self.grpc_port = make_grpc_server(self.service, self.pool, f"{host}:{grpc_port}", tls,
                                                                self.callers, limits.grpc_max_concurrent_rpcs)

    @property
    def ports(self) -> dict[str, int]:
        """``{"http": PORT}`` and ``"grpc"`` when served."""
        return {"http": self.http_port, **({"grpc": self.grpc_port} if self.grpc_port is not None else {})}

    def serve(self, on_ready: Callable[[dict[str, int]], None] | None = None) -> None:
        """Serve until stopped; ``on_ready(ports)`` once both ports accept requests."""
        import asyncio

        # uvicorn logs a warning per refused request (503, malformed): under a flood that is the flood again
        logging.getLogger("uvicorn.error").setLevel(logging.ERROR)
        if self.grpc_server is not None:
            self.grpc_server.start()
        self._on_ready = on_ready
        try:
            asyncio.run(self._uvicorn.serve(sockets=[self._socket]))
        finally:
            if self.grpc_server is not None:
                self.grpc_server.stop(grace=GRACEFUL_STOP_S).wait()
            self.pool.shutdown()
            self._socket.close()

    def _now_ready(self) -> None:
        self._started.set()
        if self._on_ready is not None:
            self._on_ready(self.ports)

    def start_in_thread(self, timeout: float = 60.0) -> threading.Thread:
        """:meth:`serve` in a daemon thread, returned once it accepts requests (for tests and embedding)."""
        thread = threading.Thread(target=self.serve, name="fedclinic-serve", daemon=True)
        thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError(f"the inference server did not start within {timeout} s")
        return thread

    def stop(self) -> None:
        """Ask :meth:`serve` to stop gracefully (returns at once)."""
        self._uvicorn.should_exit = True


def bind_listener(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --host/--port "
                          "(0 = any free port)") from None
    return sock


def server_ssl_context(tls: Any, *, client_certificates: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(tls.cert), str(tls.key))
        if client_certificates:
            ctx.load_verify_locations(cafile=str(tls.ca))
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the HTTPS certificate {tls.cert}, key {tls.key} or CA {tls.ca}: {exc}; "
                          "check the paths (create them with `fedclinic pki issue`)") from None
    return ctx


def _raise_open_file_limit(wanted: int) -> None:
    """Raise this process's soft limit on open files towards ``wanted`` (within the hard limit), so that
    ``--max-connections`` and not the file limit is what refuses a connection."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
