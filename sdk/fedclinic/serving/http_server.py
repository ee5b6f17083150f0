"""``fedclinic serve BUNDLE``: an HTTP/JSON inference service for an exported model bundle.

API (JSON in, JSON out; every error is ``{"error": "..."}`` with a 4xx status)::

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
                                    "threshold": t}, ...]; NER: [{"entities": [...]}, ...];
                                    question-answering: [{"answer": "..."}, ...]

Limits: at most ``MAX_ITEMS`` inputs (``MAX_QUESTIONS`` questions: each answer is generated token by token;
``MAX_IMAGES`` image + report pairs) and ``MAX_BODY`` bytes per request (``MAX_IMAGE_BODY`` for image-text
bundles); a question whose prompt exceeds the model's prompt budget gets a 422, not a silently shortened
question. For an image-text bundle every input problem is a 400 naming the input: an image missing, not
base64, empty, not a PNG/JPEG/DICOM file, corrupt, or one the decoder cannot make one grayscale image of
(several frames, palette colour); an empty report; a count of images that differs from the count of reports.
It binds to 127.0.0.1 by default.
The HTTP service has no TLS and no authentication: expose it only behind the hospital's reverse proxy or
integration engine (see SECURITY.md).

With ``--grpc-port`` the same predictions are also served by the ``fedclinic.v1.Inference`` gRPC service
(``protos/fedclinic/v1/inference.proto``) with the standard health service. With ``--cert/--key/--ca`` from
``fedclinic pki`` that port requires mutual TLS, as every other fedclinic port does. Bad requests get
INVALID_ARGUMENT with the same messages as HTTP's 4xx. SIGTERM and SIGINT stop both gracefully.
"""

from __future__ import annotations

import base64
import binascii
import json
import signal
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np

from fedclinic.errors import ConfigError, DatasetError, FedclinicError
from fedclinic.serving.bundle import ClassifierBundle
from fedclinic.spec.model_card import card_summary

MAX_ITEMS = 256
#: questions per request to a question-answering bundle (generation costs one model step per answer token)
MAX_QUESTIONS = 32
MAX_BODY = 1 << 20
#: image + report pairs per request to an image-text bundle, and its body limit (a DICOM study image is MBs)
MAX_IMAGES = 16
MAX_IMAGE_BODY = 64 << 20
IMAGE_TEXT = "image-text-classification"


class _BadRequest(Exception):
    pass


def _item_limit(bundle) -> int:
    if bundle.family == IMAGE_TEXT:
        return MAX_IMAGES
    return MAX_QUESTIONS if bundle.family == "question-answering" else MAX_ITEMS


def _body_limit(bundle) -> int:
    return MAX_IMAGE_BODY if bundle.family == IMAGE_TEXT else MAX_BODY


def _b64_image(value: Any, index: int) -> bytes:
    """The bytes of image ``index`` of a JSON request: standard base64 (RFC 4648; whitespace and a
    ``data:<type>;base64,`` prefix are allowed)."""
    if not isinstance(value, str) or not value.strip():
        raise _BadRequest(f"image {index} is missing or not a string; send each image as the base64 of its PNG, "
                          "JPEG or DICOM file's bytes")
    text = value.strip()
    if text.startswith("data:"):
        head, sep, text = text.partition(",")
        if not sep or not head.endswith(";base64"):
            raise _BadRequest(f"image {index} is a data URL without ';base64,'; send the file base64-encoded")
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise _BadRequest(f"image {index} is not valid base64 (standard alphabet, '=' padding); send the image "
                          "file's bytes base64-encoded") from None


def _predict_images(bundle, images: list[bytes], texts: Any) -> list[dict]:
    """An image-text bundle's predictions; every problem with the inputs is a bad request (400 /
    INVALID_ARGUMENT) that names the input."""
    if not isinstance(texts, list) or not texts:
        raise _BadRequest("expected a non-empty list of reports in 'texts', one per image (this model is "
                          f"{IMAGE_TEXT})")
    if not images:
        raise _BadRequest("no images: send one image per report in 'images' (this model is "
                          f"{IMAGE_TEXT}: it reads an image and its report together)")
    if len(texts) > MAX_IMAGES or len(images) > MAX_IMAGES:
        raise _BadRequest(f"{max(len(texts), len(images))} inputs; the limit is {MAX_IMAGES} image + report pairs "
                          "per call")
    if len(images) != len(texts):
        raise _BadRequest(f"{len(images)} images for {len(texts)} reports; send exactly one image per report")
    try:
        return bundle.predict_image_text(images, texts)
    except DatasetError as exc:
        raise _BadRequest(str(exc)) from None


def _contexts(bundle, contexts: Any, count: int) -> list[str] | None:
    """The request's contexts (None: none given), checked: only question-answering bundles take them, one
    string per question."""
    if contexts is None or contexts == []:
        return None
    if bundle.family != "question-answering":
        raise _BadRequest(f"'contexts' are for question-answering bundles; this model is {bundle.family}")
    if not isinstance(contexts, list) or not all(isinstance(c, str) for c in contexts):
        raise _BadRequest("'contexts' must be a list of strings, one per question (\"\" for none)")
    if len(contexts) != count:
        raise _BadRequest(f"{len(contexts)} contexts for {count} questions; give one per question (\"\" for none)")
    return contexts


def make_server(bundle, host: str = "127.0.0.1", port: int = 8080) -> ThreadingHTTPServer:
    """An HTTP server answering the API above with ``bundle`` (a :class:`fedclinic.serving.bundle.ClassifierBundle`)."""
    info: dict[str, Any] = {"family": bundle.family, "labels": bundle.labels, "multi_label": bundle.multi_label}
    if bundle.multi_label:
        info["threshold"] = bundle.threshold
    if getattr(bundle, "image", None) is not None:
        info["image"] = {"channels": 1, "size": bundle.image.size, "mean": bundle.image.mean, "std": bundle.image.std,
                         "formats": ["png", "jpeg", "dicom"]}
    if getattr(bundle, "card", None):
        info["card"] = card_summary(bundle.card)

    class Handler(BaseHTTPRequestHandler):
        server_version = "fedclinic-serve"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            pass  # request logs would carry nothing useful; errors are returned to the caller

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - stdlib name
            if self.path == "/healthz":
                self._send(HTTPStatus.OK, {"status": "ok"})
            elif self.path == "/readyz":
                self._send(HTTPStatus.OK, {"ready": True, "model": info})
            else:
                self._send(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint {self.path}; see /v1/predict"})

        def do_POST(self) -> None:  # noqa: N802 - stdlib name
            if self.path != "/v1/predict":
                self._send(HTTPStatus.NOT_FOUND, {"error": f"no such endpoint {self.path}; POST to /v1/predict"})
                return
            try:
                self._send(HTTPStatus.OK, {"predictions": self._predict()})
            except _BadRequest as exc:
                self._send(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            except FedclinicError as exc:
                self._send(HTTPStatus.UNPROCESSABLE_ENTITY, {"error": str(exc)})

        def _predict(self) -> list[dict]:
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                raise _BadRequest("send a JSON body with a Content-Length header") from None
            if length > _body_limit(bundle):
                raise _BadRequest(f"the body is {length} bytes; the limit is {_body_limit(bundle)}: send fewer inputs "
                                  "per call")
            try:
                body = json.loads(self.rfile.read(length) or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise _BadRequest("the body is not valid JSON") from None
            if not isinstance(body, dict):
                raise _BadRequest('expected a JSON object like {"texts": ["..."]}')
            if bundle.family == IMAGE_TEXT:
                images = body.get("images")
                if images is not None and not isinstance(images, list):
                    raise _BadRequest("'images' must be a list of base64 strings, one per report")
                images = images or []
                if len(images) > MAX_IMAGES:
                    raise _BadRequest(f"{len(images)} images; the limit is {MAX_IMAGES} per call")
                return _predict_images(bundle, [_b64_image(v, i) for i, v in enumerate(images)], body.get("texts"))
            if body.get("images") is not None:
                raise _BadRequest(f"'images' are for {IMAGE_TEXT} bundles; this model is {bundle.family}")
            key = "features" if bundle.family == "feature-classification" else "texts"
            items = body.get(key)
            if not isinstance(items, list) or not items:
                raise _BadRequest(f"expected a non-empty list in {key!r} (this model is {bundle.family})")
            if len(items) > _item_limit(bundle):
                raise _BadRequest(f"{len(items)} inputs; the limit is {_item_limit(bundle)} per call")
            if key == "texts":
                contexts = _contexts(bundle, body.get("contexts"), len(items))
                return bundle.predict(items) if contexts is None else bundle.predict(items, contexts=contexts)
            try:
                x = np.asarray(items, dtype=np.float32)
            except (TypeError, ValueError):
                raise _BadRequest("features must be a list of equal-length lists of numbers") from None
            return bundle.predict_features(x)

    return ThreadingHTTPServer((host, port), Handler)


def _prediction_message(p: dict):
    # lazy: protobuf/grpc load only when serving over gRPC (HTTP serving has neither)
    from fedclinic.proto import inference_pb2

    return inference_pb2.Prediction(label=p.get("label", ""), labels=p.get("labels", []), scores=p.get("scores", {}),
                                    entities=[inference_pb2.Entity(**e) for e in p.get("entities", [])],
                                    answer=p.get("answer", ""), threshold=p.get("threshold", 0.0))


def make_grpc_server(bundle, address: str, tls=None):
    """A gRPC server with the Inference and health services bound to ``address`` (mTLS when ``tls`` is given).

    Returns (server, bound port)."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    # lazy: protobuf/grpc load only when serving over gRPC (HTTP serving has neither)
    from fedclinic.proto import inference_pb2, inference_pb2_grpc
    from fedclinic.transport.rpc import server_credentials

    class Inference(inference_pb2_grpc.InferenceServicer):
        def Predict(self, request, context):  # noqa: N802 - generated name
            try:
                if bundle.family == "feature-classification":
                    if not request.features:
                        raise _BadRequest("send features (this model is feature-classification)")
                    rows = [list(r.values) for r in request.features]
                    if len({len(r) for r in rows}) != 1:
                        raise _BadRequest("every feature row must have the same length")
                    items = bundle.predict_features(np.asarray(rows, dtype=np.float32))
                elif bundle.family == IMAGE_TEXT:
                    items = _predict_images(bundle, list(request.images), list(request.texts))
                else:
                    if request.images:
                        raise _BadRequest(f"images are for {IMAGE_TEXT} bundles; this model is {bundle.family}")
                    if not request.texts:
                        raise _BadRequest(f"send texts (this model is {bundle.family})")
                    if len(request.texts) > _item_limit(bundle):
                        raise _BadRequest(f"{len(request.texts)} inputs; the limit is {_item_limit(bundle)} per call")
                    contexts = _contexts(bundle, list(request.contexts), len(request.texts))
                    items = (bundle.predict(list(request.texts)) if contexts is None else
                             bundle.predict(list(request.texts), contexts=contexts))
            except (_BadRequest, FedclinicError) as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            return inference_pb2.PredictResponse(predictions=[_prediction_message(p) for p in items])

        def DescribeModel(self, request, context):  # noqa: N802 - generated name
            image = getattr(bundle, "image", None)
            return inference_pb2.ModelDescription(family=bundle.family, labels=bundle.labels,
                                                  multi_label=bundle.multi_label,
                                                  threshold=bundle.threshold if bundle.multi_label else 0.0,
                                                  image_size=image.size if image is not None else 0)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         options=[("grpc.max_receive_message_length", _body_limit(bundle))])
    inference_pb2_grpc.add_InferenceServicer_to_server(Inference(), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_secure_port(address, server_credentials(tls)) if tls else server.add_insecure_port(address)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("fedclinic.v1.Inference", health_pb2.HealthCheckResponse.SERVING)
    return server, port


def add_serve_command(sub) -> None:
    p = sub.add_parser("serve", help="serve an exported model bundle over HTTP/JSON (and gRPC)")
    p.add_argument("bundle", help="a folder written by `fedclinic export onnx`")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8080, help="port (0 = any free port)")
    p.add_argument("--int8", action="store_true", help="serve model.int8.onnx")
    p.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0 = its default)")
    p.add_argument("--threshold", type=float, default=0.5,
                   help="multi-label models: a label is reported when its probability is >= this (default 0.5)")
    p.add_argument("--port-file", help='write {"http": PORT, "grpc": PORT} here once ready (for supervisors and tests)')
    p.add_argument("--grpc-port", type=int, help="also serve the gRPC Inference service on this port (0 = any)")
    p.add_argument("--cert", help="this server's certificate (fedclinic pki): the gRPC port then requires mTLS")
    p.add_argument("--key", help="its private key")
    p.add_argument("--ca", help="the fedclinic CA certificate")
    p.set_defaults(func=_serve_command)


def _serve_command(args) -> int:
    tls_args = [args.cert, args.key, args.ca]
    if any(tls_args) and not all(tls_args):
        raise ConfigError("give all of --cert, --key and --ca for mutual TLS, or none of them")
    bundle = ClassifierBundle(args.bundle, int8=args.int8, threads=args.threads, threshold=args.threshold)
    server = make_server(bundle, args.host, args.port)
    port = server.server_address[1]
    grpc_server = None
    ports = {"http": port}
    if args.grpc_port is not None:
        # lazy: protobuf/grpc load only when serving over gRPC (HTTP serving has neither)
        from fedclinic.transport.rpc import TlsFiles

        tls = TlsFiles(Path(args.cert), Path(args.key), Path(args.ca)) if all(tls_args) else None
        grpc_server, ports["grpc"] = make_grpc_server(bundle, f"{args.host}:{args.grpc_port}", tls)
        grpc_server.start()
        print(f"gRPC Inference service on {args.host}:{ports['grpc']} ({'mutual TLS' if tls else 'plaintext'})",
              flush=True)

    def stop(_signum, _frame) -> None:
        if grpc_server is not None:
            grpc_server.stop(grace=5)
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"serving {args.bundle} ({bundle.family}, {len(bundle.labels)} labels) on http://{args.host}:{port}",
          flush=True)
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(json.dumps(ports))
        tmp.replace(args.port_file)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0
