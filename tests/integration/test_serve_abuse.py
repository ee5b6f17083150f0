"""`fedclinic serve` under the ordinary abuse of issue 16 (item 5), as a real process on 127.0.0.1: a negative
Content-Length with a 50 MB body, bodies over the cap, 200 concurrent requests, 300 slow clients, a pixel bomb;
and its callers: HTTPS with client certificates, a bearer token, certificate roles on the gRPC port."""

from __future__ import annotations

import base64
import http.client
import json
import select
import socket
import ssl
import threading

import psutil
import pytest

from fedclinic import pki
from fedclinic.export.onnx_export import export_onnx
from fedclinic.federation.local_federation import wait_until

from tests.helpers.serving import PeakRss, ServeProcesses, call, png_header_bomb
from tests.helpers.text_models import tiny_package

pytestmark = pytest.mark.integration
PREDICT = {"texts": ["fever cough"]}


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A text classifier bundle (tiny logistic regression: fast to export and to run)."""
    root = tmp_path_factory.mktemp("abuse-bundle")
    tiny_package("logreg").save(root / "pkg")
    export_onnx(root / "pkg", root / "bundle")
    return root / "bundle"


@pytest.fixture
def serve(tmp_path):
    with ServeProcesses(tmp_path) as procs:
        yield procs.start


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A fedclinic CA ("ca_dir"), the server's certificate and client certificates of three roles."""
    root = tmp_path_factory.mktemp("abuse-pki")
    pki.init_ca(root / "ca")
    out = {"server": pki.issue(root / "ca", role="aggregator", name="inference", out_dir=root / "srv",
                               dns=["localhost"], ips=["127.0.0.1"])}
    for role in ("scientist", "agent", "admin"):
        out[role] = pki.issue(root / "ca", role=role, name=f"{role}-1", out_dir=root / role)
    out["ca_dir"] = root / "ca"
    return out


def _tls_flags(certs) -> list[str]:
    server = certs["server"]
    return ["--cert", str(server.cert_path), "--key", str(server.key_path), "--ca", str(server.ca_path)]


@pytest.fixture(scope="module")
def tls_server(bundle, certs, tmp_path_factory):
    """One server for the module's certificate tests: HTTPS and the gRPC port over mutual TLS, with the CA's
    revocation list naming a scientist's certificate ("left-the-project"). Yields (ports, that certificate)."""
    ca_dir = certs["ca_dir"]
    root = tmp_path_factory.mktemp("abuse-tls-serve")
    revoked = pki.issue(ca_dir, role="scientist", name="left-the-project", out_dir=root / "revoked")
    pki.revoke(ca_dir, cert_path=revoked.cert_path)
    with ServeProcesses(root) as procs:
        _, ports = procs.start(bundle, "--https", "--grpc-port", "0", "--crl", str(ca_dir / "crl.pem"),
                               *_tls_flags(certs))
        yield ports, revoked


def _response(sock: socket.socket) -> tuple[int, dict]:
    """Status and JSON body of the one response on ``sock`` (read to the end of its Content-Length or EOF)."""
    sock.settimeout(60)
    data = b""
    while b"\r\n\r\n" not in data:
        piece = sock.recv(65536)
        assert piece, f"connection closed without a response: {data!r}"
        data += piece
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        piece = sock.recv(65536)
        if not piece:
            break
        body += piece
    return int(head.split(b" ", 2)[1]), json.loads(body[:length])


def test_negative_content_length_is_refused_and_the_body_never_read(bundle, serve):
    proc, ports = serve(bundle, "--inference-workers", "1")
    port = ports["http"]
    texts = ["x" * 170_000] * 300  # 50 MB of JSON
    body = json.dumps({"texts": texts}).encode()
    assert len(body) > 50_000_000
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)

    def send_body() -> None:
        try:
            for start in range(0, len(body), 1 << 20):
                sock.sendall(body[start:start + (1 << 20)])
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server closed the connection: what it should do

    with PeakRss(proc.pid) as rss:
        sock.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: -1\r\n\r\n")
        sender = threading.Thread(target=send_body)
        sender.start()
        status, answer = _response(sock)
        sender.join(timeout=120)
    sock.close()
    assert rss.growth_mib < 30, f"the server's RSS grew by {rss.growth_mib:.0f} MiB for a refused body"
    assert status == 400 and "Content-Length" in answer["error"], answer
    assert call(port, "/v1/predict", PREDICT)[0] == 200


def test_bodies_over_the_cap_are_413_declared_or_streamed(bundle, serve):
    port = serve(bundle, "--max-body", "100000")[1]["http"]
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:  # refused before a byte of body
        sock.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Length: 2000000\r\n\r\n")
        status, answer = _response(sock)
    assert status == 413 and "the limit is 100000" in answer["error"], answer
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:  # chunked: counted while streaming
        sock.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"a" * 30_000
        try:
            for _ in range(10):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except OSError:
            pass  # closed after the answer
        status, answer = _response(sock)
    assert status == 413 and "more than 100000 bytes" in answer["error"], answer
    assert call(port, "/v1/predict", PREDICT)[0] == 200


def test_200_concurrent_requests_are_answered_200_or_503_never_reset(bundle, serve):
    port = serve(bundle, "--inference-workers", "1", "--inference-queue", "4")[1]["http"]
    n = 200
    barrier = threading.Barrier(n)
    results: list[object] = [None] * n

    def one(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        try:
            barrier.wait(timeout=60)
            conn.request("POST", "/v1/predict", json.dumps(PREDICT), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            results[i] = (resp.status, resp.getheader("Retry-After"), json.loads(resp.read()))
        except Exception as exc:  # noqa: BLE001 - what the client saw is the result
            results[i] = exc
        finally:
            conn.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    failures = [r for r in results if not isinstance(r, tuple)]
    assert not failures, f"{len(failures)} of {n} requests failed at the connection level, e.g. {failures[:3]}"
    assert {r[0] for r in results} <= {200, 503}
    assert any(r[0] == 200 for r in results)
    for status, retry_after, answer in results:
        if status == 503:
            assert retry_after and "busy" in answer["error"], answer


def test_slow_clients_time_out_and_do_not_block_an_honest_one(bundle, serve):
    proc, ports = serve(bundle, "--header-timeout", "3")
    port = ports["http"]
    slow = []
    for _ in range(300):
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\n")
        slow.append(s)
    status, answer = call(port, "/v1/predict", PREDICT)  # answered while the 300 are open
    assert status == 200 and len(answer["predictions"]) == 1
    assert psutil.Process(proc.pid).num_threads() < 50, "a thread per slow client"
    open_ = set(slow)

    def trickle_and_reap() -> bool:
        """Send each open slow client's next header byte (a slowloris keeps trickling); forget those the server
        closed. True once the server has closed them all."""
        for s in list(open_):
            try:
                s.send(b"X")
            except OSError:
                open_.discard(s)
        readable, _, _ = select.select(list(open_), [], [], 0.5) if open_ else ([], [], [])
        for s in readable:
            try:
                if not s.recv(4096):
                    open_.discard(s)
            except OSError:
                open_.discard(s)
        return not open_

    wait_until(trickle_and_reap, timeout=90, what="the server to close 300 clients that trickle their headers")
    for s in slow:
        s.close()
    assert call(port, "/v1/predict", PREDICT)[0] == 200


def test_a_body_that_trickles_is_cut_off_with_408(bundle, serve):
    port = serve(bundle, "--body-timeout", "2")[1]["http"]
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")

        def trickle_until_answered() -> bool:
            try:
                sock.send(b" ")
            except OSError:
                pass  # the server has answered and closed
            return bool(select.select([sock], [], [], 0.5)[0])

        wait_until(trickle_until_answered, timeout=60, what="the server to cut off a body that trickles")
        status, answer = _response(sock)
    assert status == 408 and "--body-timeout" in answer["error"], answer
    assert call(port, "/v1/predict", PREDICT)[0] == 200


@pytest.fixture(scope="module")
def image_bundle(tmp_path_factory):
    """An (untrained) image + report bundle: the weights do not matter to a refusal."""
    import torch

    from tests.helpers.image_text_models import package

    root = tmp_path_factory.mktemp("abuse-image-bundle")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        package(seed=1).save(root / "pkg")
        export_onnx(root / "pkg", root / "bundle")
    finally:
        torch.set_num_threads(before)
    return root / "bundle"


def test_a_pixel_bomb_is_refused_from_its_header(image_bundle, serve):
    import grpc

    from fedclinic.proto import inference_pb2, inference_pb2_grpc

    bomb = png_header_bomb(13_000, 13_000)
    assert len(bomb) < 1_000_000  # < 1 MB on the wire, 169 megapixels decoded
    proc, ports = serve(image_bundle, "--grpc-port", "0")
    with PeakRss(proc.pid) as rss:
        status, answer = call(ports["http"], "/v1/predict", {"images": [base64.b64encode(bomb).decode()],
                                                             "texts": ["chest film"]})
        with grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}") as channel:
            with pytest.raises(grpc.RpcError) as refused:
                inference_pb2_grpc.InferenceStub(channel).Predict(
                    inference_pb2.PredictRequest(texts=["chest film"], images=[bomb]), timeout=60)
    assert rss.growth_mib < 100, f"the server's RSS grew by {rss.growth_mib:.0f} MiB for a refused image"
    assert status == 413, answer
    assert "13000 x 13000" in answer["error"] and "pixel budget is 25,000,000" in answer["error"]
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "pixel budget" in refused.value.details()


def _https(port: int, ca_path, cert=None) -> tuple[int, dict]:
    """POST a prediction over HTTPS, trusting ``ca_path``, presenting ``cert`` (None: no client certificate)."""
    ctx = ssl.create_default_context(cafile=str(ca_path))
    if cert is not None:
        ctx.load_cert_chain(str(cert.cert_path), str(cert.key_path))
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=ctx, timeout=30)
    try:
        conn.request("POST", "/v1/predict", json.dumps(PREDICT), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_https_requires_a_client_certificate_of_an_allowed_role(tls_server, certs):
    ports, _ = tls_server
    ca = certs["server"].ca_path
    status, answer = _https(ports["http"], ca, certs["scientist"])
    assert status == 200 and len(answer["predictions"]) == 1
    assert _https(ports["http"], ca, certs["agent"])[0] == 200
    status, answer = _https(ports["http"], ca, certs["admin"])
    assert status == 403 and "role 'admin'" in answer["error"]
    with pytest.raises((OSError, http.client.HTTPException)):  # the handshake refuses a client without one
        _https(ports["http"], ca)
    with pytest.raises((OSError, http.client.HTTPException)):  # and plain HTTP gets no answer
        call(ports["http"], "/healthz")


def test_bearer_token(bundle, serve, tmp_path):
    token = "s3cret-token-for-the-integration-engine"
    (tmp_path / "token").write_text(token + "\n")
    _, ports = serve(bundle, "--token-file", str(tmp_path / "token"))
    port = ports["http"]
    status, answer = call(port, "/v1/predict", PREDICT)
    assert status == 401 and "Authorization: Bearer" in answer["error"]
    status, answer = call(port, "/v1/predict", PREDICT, headers={"Authorization": "Bearer " + token[:-1] + "X"})
    assert status == 401 and "not this server's token" in answer["error"]
    assert call(port, "/readyz")[0] == 401
    assert call(port, "/healthz") == (200, {"status": "ok"})  # liveness probes need no token
    status, answer = call(port, "/v1/predict", PREDICT, headers={"Authorization": "Bearer " + token})
    assert status == 200 and len(answer["predictions"]) == 1


def test_grpc_refuses_a_certificate_of_a_role_not_allowed(tls_server, certs):
    import grpc

    from fedclinic.proto import inference_pb2, inference_pb2_grpc
    from fedclinic.transport.rpc import TlsFiles, secure_channel

    ports, _ = tls_server
    address = f"127.0.0.1:{ports['grpc']}"
    for role in ("scientist", "agent"):
        c = certs[role]
        with secure_channel(address, TlsFiles(c.cert_path, c.key_path, c.ca_path)) as channel:
            out = inference_pb2_grpc.InferenceStub(channel).Predict(inference_pb2.PredictRequest(texts=["rash"]),
                                                                    timeout=30)
            assert len(out.predictions) == 1
    c = certs["admin"]
    with secure_channel(address, TlsFiles(c.cert_path, c.key_path, c.ca_path)) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        for rpc, request in ((stub.Predict, inference_pb2.PredictRequest(texts=["rash"])),
                             (stub.DescribeModel, inference_pb2.DescribeModelRequest())):
            with pytest.raises(grpc.RpcError) as denied:
                rpc(request, timeout=30)
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "role 'admin'" in denied.value.details() and "scientist or agent" in denied.value.details()


def test_with_a_crl_a_revoked_certificate_is_refused_on_both_ports(tls_server, certs):
    import grpc

    from fedclinic.proto import inference_pb2, inference_pb2_grpc
    from fedclinic.transport.rpc import TlsFiles, secure_channel

    ports, revoked = tls_server  # the server was started with the CA's revocation list, which names ``revoked``
    status, answer = _https(ports["http"], revoked.ca_path, revoked)
    assert status == 403 and "has been revoked" in answer["error"]
    assert _https(ports["http"], revoked.ca_path, certs["scientist"])[0] == 200
    with secure_channel(f"127.0.0.1:{ports['grpc']}", TlsFiles(revoked.cert_path, revoked.key_path,
                                                               revoked.ca_path)) as channel:
        with pytest.raises(grpc.RpcError) as denied:
            inference_pb2_grpc.InferenceStub(channel).DescribeModel(inference_pb2.DescribeModelRequest(), timeout=30)
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED and "has been revoked" in denied.value.details()


def test_a_grpc_request_that_does_not_parse_is_invalid_argument_not_internal(tls_server, certs):
    """Found by the fuzz campaign: damaged bytes got grpc's own INTERNAL 'Exception deserializing request!'."""
    import grpc

    from fedclinic.transport.rpc import TlsFiles, secure_channel

    ports, _ = tls_server
    c = certs["scientist"]
    damaged = (b"\x0a\x7f\x00", b"\xff" * 10 + b"\x01")  # a cut length; a varint longer than 64 bits
    with secure_channel(f"127.0.0.1:{ports['grpc']}", TlsFiles(c.cert_path, c.key_path, c.ca_path)) as channel:
        for method in ("/fedclinic.v1.Inference/Predict", "/fedclinic.v1.Inference/DescribeModel",
                       "/grpc.health.v1.Health/Check"):
            for data in damaged:
                with pytest.raises(grpc.RpcError) as refused:  # request_serializer=None: the bytes go out as they are
                    channel.unary_unary(method, request_serializer=None)(data, timeout=30)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, refused.value.details())
                assert "does not parse" in refused.value.details()


def test_a_client_that_half_closes_after_its_request_is_answered(bundle, serve):
    """Found by the fuzz campaign: uvicorn closed on end-of-file without answering a complete request."""
    _, port = serve(bundle)
    body = json.dumps(PREDICT).encode()
    cases = {b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body): b"200",
             b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + body[:5]: b"400",
             b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n": b"200",
             b"GET /heal": b"400"}
    for raw, expected in cases.items():
        with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
            sock.sendall(raw)
            sock.shutdown(socket.SHUT_WR)
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.split(b" ", 2)[1:2] == [expected], (raw, answer[:300])
