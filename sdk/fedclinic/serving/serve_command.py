"""``fedclinic serve BUNDLE``'s command line: its flags, and the handler that builds the server.

The server itself (:mod:`fedclinic.serving.http_server`, with uvicorn and Starlette from the ``export`` extra) is
imported only when the command runs, so that ``fedclinic`` (``fedclinic pki`` ...) works in every install.
"""

from __future__ import annotations

import ipaddress
import json
import sys
from pathlib import Path
from typing import Any

from fedclinic.errors import ConfigError
from fedclinic.serving.caller_policy import DEFAULT_ROLES, CallerPolicy
from fedclinic.serving.serve_limits import ServeLimits


def is_loopback(host: str) -> bool:
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
    # lazy: the HTTP stack (uvicorn, Starlette) and the model runtime load only when serving, so that `fedclinic`
    # runs in installs without the export extra (the aggregator's, the agent's)
    from fedclinic.serving.bundle import ClassifierBundle
    from fedclinic.serving.bundle_trust import check_bundle_trust, trust_ca
    from fedclinic.serving.http_server import InferenceServer

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
    if not is_loopback(args.host) and not args.https and not callers.needs_token:
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
