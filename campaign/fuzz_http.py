"""HTTP cases for ``fedclinic serve``: raw requests over a socket, so the fuzz speaks only HTTP/1.1 (it works
against any server stack behind the same endpoints).

:func:`http_cases` draws a request: a method and path (the real endpoints, unknown ones, odd ones), headers
(Content-Length right, missing, negative, huge, short or long, repeated; chunked transfer encoding; odd
content types) and a body (JSON shaped like the API with edge values, JSON of any shape, non-JSON bytes).
:func:`send` writes it, half-closes the socket (so a server waiting for more body sees the end) and reads the
status line. A case "answers" with its HTTP status, ``no status line`` (an HTTP/0.9-style answer to a request line
without a version, or a connection closed or reset without an answer), or ``timeout``.
"""

from __future__ import annotations

import base64
import json
import math
import socket
from dataclasses import dataclass

from hypothesis import strategies as st

PATHS = ("/v1/predict", "/v1/predict", "/v1/predict", "/healthz", "/readyz", "/", "/v1/predict/", "/v1/predict?x=1",
         "//v1/predict", "/v1/../healthz", "/%00", "/v1/predict#x", "*", "/" + "a" * 9000)
METHODS = ("POST", "POST", "POST", "GET", "GET", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH", "BREW", "")
_PNG_1x1 = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAAAAAA6fptVAAAACklEQVR4nGNgAAAAAgABSK+kcQAAAABJRU5ErkJggg==")


@dataclass
class HttpCase:
    raw: bytes

    def describe(self, limit: int = 300) -> str:
        return repr(self.raw[:limit])


def _json_values() -> st.SearchStrategy:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                        st.sampled_from(("", "fever cough", "é" * 3000, "\x00", "a" * 70_000, 1e308)),
                        st.text(max_size=30))
    return st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                        st.dictionaries(st.text(max_size=8), kids, max_size=4)),
                        max_leaves=12)


def _api_bodies() -> st.SearchStrategy:
    texts = st.one_of(st.lists(st.one_of(st.text(max_size=60), st.sampled_from(("fever cough", "rash", ""))),
                               max_size=6),
                      st.sampled_from((["x"] * 300, ["fever"] * 256, [], None, "fever", 7, [None], [["a"]])))
    feats = st.one_of(st.lists(st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=4), max_size=4),
                      st.sampled_from(([[math.inf]], [[1, "a"]], [[1], [1, 2]], [])))
    images = st.one_of(st.lists(st.sampled_from((base64.b64encode(_PNG_1x1).decode(), "not base64!",
                                                 "data:image/png;base64," + base64.b64encode(_PNG_1x1).decode(),
                                                 "", "AAAA")), max_size=3), st.just("x"))

    @st.composite
    def body(draw) -> bytes:
        if _chance(draw, 30):  # a well-formed request now and then: the model runs, on odd but valid text
            return json.dumps({"texts": draw(st.lists(st.one_of(st.sampled_from(("fever cough", "rash", "é" * 3000)),
                                                                 st.text(min_size=1, max_size=40)),
                                                       min_size=1, max_size=8))}).encode()
        doc = {}
        for key, strat in (("texts", texts), ("features", feats), ("contexts", texts), ("images", images)):
            if _chance(draw, 85 if key == "texts" else 20):
                doc[key] = draw(strat)
        if _chance(draw, 10):
            doc[draw(st.text(max_size=10))] = draw(_json_values())
        return json.dumps(doc, allow_nan=True).encode()

    return body()


def _chance(draw, percent: int) -> bool:
    """True about ``percent`` % of the time (hypothesis favours the ends of a range, and both ends are split)."""
    return draw(st.integers(1, 100)) <= percent


@st.composite
def http_cases(draw) -> HttpCase:
    """One raw HTTP request (module docstring)."""
    # most cases are a POST to /v1/predict with an API-shaped body: that is where the work is
    method = "POST" if _chance(draw, 65) else draw(st.sampled_from(METHODS))
    path = "/v1/predict" if _chance(draw, 70) else draw(st.one_of(
        st.sampled_from(PATHS), st.binary(max_size=30).map(
            lambda b: "/" + b.decode("latin-1").replace("\r", "").replace("\n", "").replace(" ", ""))))
    version = "HTTP/1.1" if _chance(draw, 90) else draw(st.sampled_from(("HTTP/1.0", "HTTP/2.0", "HTTP/9", "")))
    body = draw(_api_bodies()) if _chance(draw, 70) else draw(st.one_of(
        _json_values().map(lambda v: json.dumps(v).encode()), st.binary(max_size=200),
        st.sampled_from((b"", b"{not json", b"\xff\xfe", b"null", b"[]", b'{"texts": ["a"]}' * 3))))
    length = "right" if _chance(draw, 70) else draw(st.sampled_from(("none", "-1", "huge", "short", "long", "twice",
                                                                      "junk", "chunked")))
    headers = ["Host: 127.0.0.1", "Connection: close"]
    ctype = "application/json" if _chance(draw, 80) else draw(st.sampled_from((
        "text/plain", "", "multipart/form-data; boundary=x", "application/json; charset=utf-16")))
    if ctype:
        headers.append(f"Content-Type: {ctype}")
    if length == "right":
        headers.append(f"Content-Length: {len(body)}")
    elif length == "-1":
        headers.append("Content-Length: -1")
    elif length == "huge":
        headers.append(f"Content-Length: {draw(st.sampled_from((2**31, 2**63, 10**30, 50_000_000)))}")
    elif length == "short":
        headers.append(f"Content-Length: {max(len(body) - draw(st.integers(1, 10)), 0)}")
    elif length == "long":
        headers.append(f"Content-Length: {len(body) + draw(st.integers(1, 1000))}")
    elif length == "twice":
        headers += [f"Content-Length: {len(body)}", "Content-Length: 3"]
    elif length == "junk":
        headers.append(f"Content-Length: {draw(st.sampled_from(('abc', '1e3', ' 12', '0x10', '')))}")
    elif length == "chunked":
        headers.append("Transfer-Encoding: chunked")
        body = (f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n") if draw(st.booleans()) else body
    if _chance(draw, 3):
        headers.append(draw(st.sampled_from(("Expect: 100-continue", "Bad Header", ": empty", "Content-Encoding: gzip",
                                              "X-Long: " + "a" * 70_000))))
    head = f"{method} {path} {version}".strip() + "\r\n" + "\r\n".join(headers) + "\r\n\r\n"
    return HttpCase(head.encode("latin-1", errors="replace") + body)


def send(port: int, case: HttpCase, timeout: float = 15.0) -> str:
    """Send ``case`` to 127.0.0.1:``port``; its answer: the HTTP status, ``no status line`` or ``timeout``
    (``refused`` when nothing listens)."""
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "timeout"
    try:
        try:
            sock.sendall(case.raw)
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server answered and closed before reading it all: read what it said
            pass
        data = b""
        while b"\r\n" not in data and len(data) < 4096:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    except socket.timeout:
        return "timeout"
    except OSError:
        data = data if "data" in locals() else b""
        if not data:
            return "no status line"
    finally:
        sock.close()
    parts = data.split(b" ", 2)
    if len(parts) >= 2 and parts[0].startswith(b"HTTP/") and parts[1].isdigit():
        return parts[1].decode()
    return "no status line"
