"""What the fuzz campaign (campaign/fuzz.py) found, each pinned over a real aggregator with real certificates.

- A request message that does not parse (damaged bytes: a cut length, an overlong varint) got grpc's own
  ``INTERNAL: Exception deserializing request!`` and a traceback in the aggregator's log, for every RPC, unary
  and streamed. It is now refused with INVALID_ARGUMENT naming the method and what to do, and the log stays
  free of tracebacks (aggregator_service.rpc_errors).
"""

from __future__ import annotations

import grpc
import pytest

from fedclinic.proto import agent_pb2
from fedclinic.transport.rpc import TlsFiles, secure_channel

pytestmark = pytest.mark.integration

#: field 1, length-delimited, length 127 but 1 byte follows; ten 0xff bytes: a varint longer than 64 bits
DAMAGED = (b"\x0a\x7f\x00", b"\xff" * 10 + b"\x01")


def _channel(fed, name: str) -> grpc.Channel:
    c = fed.creds(name)
    return secure_channel(fed.address, TlsFiles(c["cert"], c["key"], c["ca"]), server_name="localhost")


def _code_and_details(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return exc.value.code(), exc.value.details() or ""


def test_a_request_that_does_not_parse_is_invalid_argument_not_internal(federation_factory):
    fed = federation_factory(1, start=False)
    fed.make_pki()
    fed.start_aggregator()
    with _channel(fed, "scientist") as sci, _channel(fed, "site-a") as site:
        calls = {  # request_serializer=None: the bytes go out as they are
            "/fedclinic.v1.Control/GetTask": lambda b: sci.unary_unary("/fedclinic.v1.Control/GetTask",
                                                                       request_serializer=None)(b, timeout=30),
            "/fedclinic.v1.Control/WatchTask": lambda b: list(sci.unary_stream(
                "/fedclinic.v1.Control/WatchTask", request_serializer=None)(b, timeout=30)),
            "/fedclinic.v1.Control/SubmitTask": lambda b: sci.stream_unary(
                "/fedclinic.v1.Control/SubmitTask", request_serializer=None)(iter([b]), timeout=30),
            "/fedclinic.v1.AgentService/Hello": lambda b: site.unary_unary(
                "/fedclinic.v1.AgentService/Hello", request_serializer=None)(b, timeout=30),
            "/fedclinic.v1.AgentService/SubmitUpdate": lambda b: site.stream_unary(
                "/fedclinic.v1.AgentService/SubmitUpdate", request_serializer=None)(iter([b]), timeout=30),
        }
        for method, call in calls.items():
            for damaged in DAMAGED:
                code, details = _code_and_details(lambda: call(damaged))
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, damaged, code, details)
                assert "does not parse" in details and method in details, (method, damaged, details)
                assert str(fed.root) not in details
        # the aggregator still answers a well-formed call, and logged no traceback for the damaged ones
        hello = agent_pb2.HelloRequest(protocol_version=1).SerializeToString()
        assert agent_pb2.HelloResponse.FromString(calls["/fedclinic.v1.AgentService/Hello"](hello)).site_id == "site-a"
    assert fed.aggregator.poll() is None
    assert "Traceback" not in fed.log_text("aggregator"), fed.log_text("aggregator")[-3000:]
