"""The HTTP/JSON API of ``fedclinic serve`` as an ASGI (Starlette) application: routes, body reading, callers.

Routes (the API is described in :mod:`fedclinic.serving.http_server`): ``GET /healthz``, ``GET /readyz``,
``POST /v1/predict``; anything else is a JSON 404 (unknown path) or 405 (wrong method).

The body of ``POST /v1/predict`` is read here, never trusting its headers:

- a declared ``Content-Length`` above the limit is a 413 before a byte of the body is read (h11 has already
  answered 400 to a negative or non-numeric one, see :mod:`fedclinic.serving.guarded_h11`);
- the bytes actually received are counted as they stream in (chunked bodies too): past the limit, 413;
- the whole body must arrive within ``body_timeout`` seconds (408);
- all bodies being received or waiting for the model together hold at most ``max_inflight_bytes`` (503 with
  ``Retry-After``), so many large uploads at once cannot exhaust memory;
- the prediction runs in the bounded :class:`~fedclinic.serving.work_pool.WorkPool` (503 with ``Retry-After``
  when it is full).

Every error is ``{"error": "..."}``; an answer sent before the body was read whole closes the connection.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fedclinic.errors import FedclinicError
from fedclinic.serving.caller_policy import CallerPolicy
from fedclinic.serving.pixel_budget import ImageTooLarge
from fedclinic.serving.prediction_service import BadRequest, PredictionService
from fedclinic.serving.work_pool import PoolFull, WorkPool

log = logging.getLogger("fedclinic.serve")
RETRY_AFTER_S = "1"


class _Refusal(Exception):
    def __init__(self, status: int, message: str, *, close: bool = False, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.close, self.headers = status, close, headers or {}


class HttpApp:
    """The ASGI application (:attr:`asgi`) answering with ``service`` and running predictions in ``pool``.

    ``client_certificates``: the server speaks HTTPS with client certificates, whose role ``callers`` checks."""

    def __init__(self, service: PredictionService, pool: WorkPool, callers: CallerPolicy, *,
                 body_timeout: float = 60.0, max_inflight_bytes: int | None = None,
                 client_certificates: bool = False) -> None:
        self.service = service
        self.pool = pool
        self.callers = callers
        self.body_timeout = body_timeout
        self.max_inflight_bytes = max_inflight_bytes if max_inflight_bytes is not None else 4 * service.body_limit
        self.client_certificates = client_certificates
        self._inflight = 0  # body bytes held by requests in progress (only touched on the event loop)
        self.asgi = Starlette(routes=[Route("/healthz", self._healthz, methods=["GET"]),
                                      Route("/readyz", self._readyz, methods=["GET"]),
                                      Route("/v1/predict", self._predict, methods=["POST"])],
                              exception_handlers={HTTPException: self._http_exception})

    @property
    def inflight_bytes(self) -> int:
        """Body bytes held right now by requests being received or predicted."""
        return self._inflight

    async def _healthz(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _readyz(self, request: Request) -> Response:
        try:
            self._check_caller(request)
        except _Refusal as refusal:
            return _error(refusal)
        return JSONResponse({"ready": True, "model": self.service.info})

    async def _predict(self, request: Request) -> Response:
        held = [0]
        try:
            self._check_caller(request)
            body = await self._read_body(request, held)
            return JSONResponse({"predictions": await self.pool.run_async(self.service.predict_json, body)})
        except _Refusal as refusal:
            return _error(refusal)
        except PoolFull as exc:
            return _error(_Refusal(503, str(exc), headers={"Retry-After": RETRY_AFTER_S}))
        except BadRequest as exc:
            return _error(_Refusal(400, str(exc)))
        except ImageTooLarge as exc:
            return _error(_Refusal(413, str(exc)))
        except FedclinicError as exc:
            return _error(_Refusal(422, str(exc)))
        except ClientDisconnect:
            return _error(_Refusal(400, "the client closed the connection before sending the whole body", close=True))
        except Exception:  # a defect: log it here, tell the caller no more than that
            log.exception("prediction failed")
            return _error(_Refusal(500, "the prediction failed inside the server; its log has the details"))
        finally:
            self._inflight -= held[0]

    def _check_caller(self, request: Request) -> None:
        """401 without the bearer token (when one is set), 403 for a certificate of a role not allowed."""
        why = self.callers.check_token(request.headers.get("authorization"))
        if why is not None:
            raise _Refusal(401, why, close=True, headers={"WWW-Authenticate": "Bearer"})
        if self.client_certificates:
            chain = request.scope.get("extensions", {}).get("tls", {}).get("client_cert_chain") or []
            why = self.callers.check_certificate(chain[0] if chain else None)
            if why is not None:
                raise _Refusal(403, why, close=True)

    async def _read_body(self, request: Request, held: list[int]) -> bytes:
        """The request body, within the size limit, the time limit and the in-flight byte budget (module doc).
        ``held[0]`` counts the bytes charged to the budget (the caller gives them back)."""
        limit = self.service.body_limit
        declared = request.headers.get("content-length")
        if declared is not None:
            # h11 has refused anything but a non-negative decimal; checked again here all the same
            if not declared.strip().isdigit():
                raise _Refusal(400, "Content-Length must be a non-negative decimal number of bytes", close=True)
            if int(declared) > limit:
                raise _Refusal(413, f"the body is {int(declared)} bytes; the limit is {limit} (fedclinic serve "
                                    "--max-body): send fewer inputs per call", close=True)
        chunks: list[bytes] = []
        try:
            async with asyncio.timeout(self.body_timeout):
                async for chunk in request.stream():
                    if held[0] + len(chunk) > limit:
                        raise _Refusal(413, f"the body is more than {limit} bytes, the limit (fedclinic serve "
                                            "--max-body): send fewer inputs per call", close=True)
                    if self._inflight + len(chunk) > self.max_inflight_bytes:
                        raise _Refusal(503, "the server is holding as many request bodies as it may "
                                            f"({self.max_inflight_bytes} bytes, fedclinic serve --max-inflight-bytes); "
                                            "retry in a moment", close=True, headers={"Retry-After": RETRY_AFTER_S})
                    self._inflight += len(chunk)
                    held[0] += len(chunk)
                    chunks.append(chunk)
        except TimeoutError:
            raise _Refusal(408, f"the body did not arrive within {self.body_timeout:g} s (fedclinic serve "
                                "--body-timeout); send it in one go", close=True) from None
        return b"".join(chunks)

    async def _http_exception(self, request: Request, exc: Any) -> Response:
        """Routing's 404 (unknown path) and 405 (wrong method), as JSON."""
        if exc.status_code == 405:
            allowed = "POST" if request.url.path == "/v1/predict" else "GET"
            return _error(_Refusal(405, f"{request.method} is not allowed on {request.url.path}; use {allowed}",
                                   headers={"Allow": allowed}))
        where = "POST to /v1/predict" if request.method == "POST" else "see /v1/predict"
        return _error(_Refusal(exc.status_code, f"no such endpoint {request.url.path}; {where}"))


def _error(refusal: _Refusal) -> Response:
    headers = dict(refusal.headers)
    if refusal.close:
        headers["Connection"] = "close"
    return JSONResponse({"error": str(refusal)}, status_code=refusal.status, headers=headers)
