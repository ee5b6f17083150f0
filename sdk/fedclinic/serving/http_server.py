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
import ipaddress
import json
import logging
import resource
import signal
import socket
import ssl
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import uvicorn

from fedclinic.errors import ConfigError
from fedclinic.serving.bundle import ClassifierBundle
from fedclinic.serving.bundle_trust import check_bundle_trust, trust_ca
from fedclinic.serving.caller_policy import DEFAULT_ROLES, CallerPolicy
from fedclinic.serving.guarded_h11 import GuardedH11Protocol
from fedclinic.serving.http_app import HttpApp
from fedclinic.serving.pixel_budget import DEFAULT_MAX_PIXELS, PixelBudget
from fedclinic.serving.prediction_service import PredictionService
from fedclinic.serving.work_pool import WorkPool

#: seconds a stopping server waits for requests in progress
GRACEFUL_STOP_S = 10


@dataclass(frozen=True)
class ServeLimits:
    """The bounds of one server (module doc); ``None``: the bundle family's default."""

    max_body: int | None = None
    max_inflight_bytes: int | None = None
    max_connections: int = 1000
    backlog: int = 2048
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    keep_alive_timeout: float = 5.0
    inference_workers: int = 2
    inference_queue: int = 16
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    grpc_max_concurrent_rpcs: int = 64

    def check(self) -> None:
        """ConfigError naming the flag of a value out of range."""
        for flag, value, low in (("--max-connections", self.max_connections, 1), ("--backlog", self.backlog, 1),
                                 ("--inference-workers", self.inference_workers, 1),
                                 ("--inference-queue", self.inference_queue, 0),
                                 ("--max-image-pixels", self.max_image_pixels, 1),
                                 ("--grpc-max-concurrent-rpcs", self.grpc_max_concurrent_rpcs, 1),
                                 ("--max-body", self.max_body if self.max_body is not None else 1, 1)):
            if value < low:
                raise ConfigError(f"{flag} must be >= {low}, got {value}")
        for flag, seconds in (("--header-timeout", self.header_timeout), ("--body-timeout", self.body_timeout),
                              ("--keep-alive-timeout", self.keep_alive_timeout)):
            if not seconds > 0:
                raise ConfigError(f"{flag} must be > 0 seconds, got {seconds}")


class _Uvicorn(uvicorn.Server):
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
        self._socket = _bind(host, port)
        self.http_port: int = self._socket.getsockname()[1]
        ssl_context = _ssl_context(tls, client_certificates=https == "mtls") if https else None
        config = uvicorn.Config(self.app.asgi, http=GuardedH11Protocol.with_header_timeout(limits.header_timeout),
                                loop="asyncio", lifespan="off", ws="none", interface="asgi3",
                                limit_concurrency=limits.max_connections, backlog=limits.backlog,
                                timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]
                                timeout_graceful_shutdown=GRACEFUL_STOP_S, log_config=None, access_log=False,
                                server_header=False, proxy_headers=False,
                                ssl_context_factory=(lambda _config, _default: ssl_context) if ssl_context else None)
        self._started = threading.Event()
        self._on_ready: Callable[[dict[str, int]], None] | None = None
        self._uvicorn = _Uvicorn(config, self._now_ready)
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


def _bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --host/--port "
                          "(0 = any free port)") from None
    return sock


def _ssl_context(tls: Any, *, client_certificates: bool) -> ssl.SSLContext:
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


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def add_serve_command(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve an exported model bundle over HTTP/JSON (and gRPC)")
    p.add_argument("bundle", help="a folder written by `fedclinic export onnx`")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080, help="port (0 = any free port)")
    p.add_argument("--int8", action="store_true", help="serve model.int8.onnx")
    p.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0 = its default)")
    p.add_argument("--threshold", type=float, default=None,
                   help="multi-label models: report every label whose probability is >= this, in place of the "
                        "bundle's per-label thresholds (default: those when the bundle has them, else 0.5)")
    p.add_argument("--port-file", help='write {"http": PORT, "grpc": PORT} here once ready (for supervisors and tests)')
    p.add_argument("--grpc-port", type=int, help="also serve the gRPC Inference service on this port (0 = any)")
    p.add_argument("--cert", help="this server's certificate (fedclinic pki): the gRPC port then requires mTLS")
    p.add_argument("--key", help="its private key")
    p.add_argument("--ca", help="the fedclinic CA certificate")
    sig = p.add_argument_group("bundle signature (checked before the bundle is loaded)")
    sig.add_argument("--trust-ca", help="the fedclinic CA the bundle's BUNDLE_SIGNATURE.json is checked against "
                                        "(default: --ca, else $FEDCLINIC_CA)")
    sig.add_argument("--allow-unsigned", action="store_true",
                     help="serve a bundle that has no signature, or whose signature cannot be checked (no CA): "
                          "with a warning; a signature that fails is refused regardless")
    sec = p.add_argument_group("HTTP security (plain HTTP on loopback by default)")
    sec.add_argument("--https", nargs="?", const="mtls", choices=["mtls", "tls"],
                     help="serve HTTPS with --cert/--key: 'mtls' (the default) requires a client certificate of the "
                          "--ca; 'tls' does not (then --token-file is required)")
    sec.add_argument("--token-file", help="require 'Authorization: Bearer <token>' (the file's one line) on every "
                                          "request but /healthz, and on every gRPC call")
    sec.add_argument("--allow-roles", default=",".join(DEFAULT_ROLES),
                     help="certificate roles that may query the model (default: %(default)s)")
    sec.add_argument("--crl", help="the fedclinic CA's revocation list (crl.pem): refuse revoked client certificates "
                                   "on HTTPS and gRPC (re-read when the file changes)")
    lim = p.add_argument_group("limits")
    d = ServeLimits()
    lim.add_argument("--max-body", type=int, help="request body limit in bytes (default 1 MiB; 64 MiB for image-text)")
    lim.add_argument("--max-inflight-bytes", type=int, help="request bodies held at once, bytes (default 4 x --max-body)")
    lim.add_argument("--max-connections", type=int, default=d.max_connections, help="open connections (default %(default)s)")
    lim.add_argument("--backlog", type=int, default=d.backlog, help="listen backlog (default %(default)s)")
    lim.add_argument("--header-timeout", type=float, default=d.header_timeout,
                     help="seconds for a request's line and headers (default %(default)s)")
    lim.add_argument("--body-timeout", type=float, default=d.body_timeout,
                     help="seconds for a request's body (default %(default)s)")
    lim.add_argument("--keep-alive-timeout", type=float, default=d.keep_alive_timeout,
                     help="idle seconds between requests on one connection (default %(default)s)")
    lim.add_argument("--inference-workers", type=int, default=d.inference_workers,
                     help="predictions run at once (default %(default)s)")
    lim.add_argument("--inference-queue", type=int, default=d.inference_queue,
                     help="predictions waiting for a worker before requests get 503 (default %(default)s)")
    lim.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels,
                     help="pixels per image, checked from its header before decoding (default %(default)s)")
    lim.add_argument("--grpc-max-concurrent-rpcs", type=int, default=d.grpc_max_concurrent_rpcs,
                     help="calls at once on the gRPC port (default %(default)s)")
    p.set_defaults(func=_serve_command)


def _serve_command(args: Any) -> int:
    tls_args = [args.cert, args.key, args.ca]
    if any(tls_args) and not all(tls_args):
        raise ConfigError("give all of --cert, --key and --ca for mutual TLS, or none of them")
    limits = ServeLimits(max_body=args.max_body, max_inflight_bytes=args.max_inflight_bytes,
                         max_connections=args.max_connections, backlog=args.backlog,
                         header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                         keep_alive_timeout=args.keep_alive_timeout, inference_workers=args.inference_workers,
                         inference_queue=args.inference_queue, max_image_pixels=args.max_image_pixels,
                         grpc_max_concurrent_rpcs=args.grpc_max_concurrent_rpcs)
    limits.check()
    if args.crl and not all(tls_args):
        raise ConfigError("--crl checks client certificates: give it with --cert, --key and --ca")
    revocations = None
    if args.crl:
        from fedclinic.pki import PkiError, RevocationList

        try:
            revocations = RevocationList(args.crl, args.ca)
        except PkiError as exc:
            raise ConfigError(f"--crl: {exc}") from None
    callers = CallerPolicy.from_token_file(args.token_file,
                                           tuple(r.strip() for r in args.allow_roles.split(",") if r.strip()),
                                           revocations)
    tls = None
    if all(tls_args):
        # lazy: protobuf/grpc load only when serving over gRPC (HTTP serving has neither)
        from fedclinic.transport.rpc import TlsFiles

        tls = TlsFiles(Path(args.cert), Path(args.key), Path(args.ca))
    trust, warning = check_bundle_trust(args.bundle, ca=trust_ca(args.trust_ca, args.ca),
                                        allow_unsigned=args.allow_unsigned)
    if trust:
        print(trust, file=sys.stderr if warning else sys.stdout, flush=True)
    bundle = ClassifierBundle(args.bundle, int8=args.int8, threads=args.threads, threshold=args.threshold)
    if bundle.multi_label and "thresholds" in bundle.meta:
        print("per-label thresholds: " + (", ".join(f"{lab} {t:.2f}" for lab, t in zip(bundle.labels, bundle.thresholds))
                                          if bundle.tuned_thresholds else f"overridden by --threshold {args.threshold}"),
              flush=True)
    server = InferenceServer(bundle, args.host, args.port, limits=limits, tls=tls, https=args.https,
                             callers=callers, grpc_port=args.grpc_port)
    if not _is_loopback(args.host) and not args.https and not callers.needs_token:
        print(f"warning: serving plain HTTP without authentication on {args.host}: anyone who can reach this port "
              "can query the model; use --https and/or --token-file, or keep it behind the hospital's reverse proxy",
              file=sys.stderr, flush=True)
    if server.grpc_port is not None:
        print(f"gRPC Inference service on {args.host}:{server.grpc_port} ({'mutual TLS' if tls else 'plaintext'})",
              flush=True)

    def ready(ports: dict[str, int]) -> None:
        print(f"serving {args.bundle} ({bundle.family}, {len(bundle.labels)} labels) on "
              f"{server.scheme}://{args.host}:{ports['http']}", flush=True)
        if args.port_file:
            tmp = Path(args.port_file + ".tmp")
            tmp.write_text(json.dumps(ports))
            tmp.replace(args.port_file)

    server.serve(ready)
    return 0
