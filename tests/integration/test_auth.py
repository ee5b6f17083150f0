"""Every port requires a client certificate from our CA; identity and role come from that certificate."""

from __future__ import annotations

import datetime as dt
import subprocess
import sys

import grpc
import pytest

from fedclinic import pki
from fedclinic.errors import FedclinicError
from fedclinic.proto import agent_pb2, agent_pb2_grpc, control_pb2, control_pb2_grpc
from fedclinic.transport.rpc import TlsFiles, secure_channel

pytestmark = pytest.mark.integration


@pytest.fixture
def running(federation_factory):
    fed = federation_factory(1, start=False)
    fed.make_pki()
    fed.start_aggregator()
    return fed


def _files(out, name, ca_path) -> TlsFiles:
    return TlsFiles(out / f"{name}.crt", out / f"{name}.key", ca_path)


def _list_tasks(fed, tls: TlsFiles):
    with secure_channel(fed.address, tls, server_name="localhost") as ch:
        return control_pb2_grpc.ControlStub(ch).ListTasks(control_pb2.ListTasksRequest(), timeout=15)


def _hello(fed, tls: TlsFiles):
    with secure_channel(fed.address, tls, server_name="localhost") as ch:
        return agent_pb2_grpc.AgentServiceStub(ch).Hello(agent_pb2.HelloRequest(protocol_version=1), timeout=15)


def test_valid_scientist_and_agent_are_served(running):
    c = running.creds("scientist")
    assert _list_tasks(running, TlsFiles(c["cert"], c["key"], c["ca"])).tasks == []
    a = running.creds("site-a")
    assert _hello(running, TlsFiles(a["cert"], a["key"], a["ca"])).site_id == "site-a"


def test_certificate_from_another_ca_is_refused(running, tmp_path):
    other = tmp_path / "other-ca"
    pki.init_ca(other)
    pki.issue(other, role="scientist", name="mallory", out_dir=tmp_path / "m")
    with pytest.raises(grpc.RpcError) as exc:
        _list_tasks(running, _files(tmp_path / "m", "mallory", running.ca_dir / "ca.crt"))
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(FedclinicError, match="not signed by|not issued by|signed by"):
        from fedclinic.client import connect

        connect(running.address, cert=tmp_path / "m" / "mallory.crt", key=tmp_path / "m" / "mallory.key",
                ca=running.ca_dir / "ca.crt")


@pytest.mark.parametrize("start, what", [(-3, "expired"), (2, "not yet valid")])
def test_expired_and_not_yet_valid_certificates_are_refused(running, tmp_path, start, what):
    not_before = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=start)
    pki.issue(running.ca_dir, role="scientist", name="late", out_dir=tmp_path / "late", days=1, not_before=not_before)
    tls = _files(tmp_path / "late", "late", running.ca_dir / "ca.crt")
    with pytest.raises(grpc.RpcError) as exc:
        _list_tasks(running, tls)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    from fedclinic.client import connect

    with pytest.raises(FedclinicError, match=what.split()[0]):
        connect(running.address, cert=tls.cert, key=tls.key, ca=tls.ca)


def test_revoked_certificate_is_refused_without_restart(running):
    a = running.creds("site-a")
    tls = TlsFiles(a["cert"], a["key"], a["ca"])
    assert _hello(running, tls).site_id == "site-a"
    cli = subprocess.run([sys.executable, "-m", "fedclinic.cli", "pki", "revoke", "--ca-dir", str(running.ca_dir),
                          "--cert", a["cert"], "--reason", "keyCompromise"], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    with pytest.raises(grpc.RpcError) as exc:
        _hello(running, tls)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "revoked" in exc.value.details()


def test_roles_are_enforced_per_service(running):
    a = running.creds("site-a")
    with pytest.raises(grpc.RpcError) as exc:
        _list_tasks(running, TlsFiles(a["cert"], a["key"], a["ca"]))
    assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "role 'agent'" in exc.value.details() and "scientist" in exc.value.details()
    s = running.creds("scientist")
    with pytest.raises(grpc.RpcError) as exc:
        _hello(running, TlsFiles(s["cert"], s["key"], s["ca"]))
    assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "role 'scientist'" in exc.value.details()


def test_connection_without_client_certificate_is_refused(running):
    creds = grpc.ssl_channel_credentials(root_certificates=(running.ca_dir / "ca.crt").read_bytes())
    with grpc.secure_channel(running.address, creds, options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
        with pytest.raises(grpc.RpcError) as exc:
            control_pb2_grpc.ControlStub(ch).ListTasks(control_pb2.ListTasksRequest(), timeout=15)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE


def _revoke(fed, site: str) -> None:
    cli = subprocess.run([sys.executable, "-m", "fedclinic.cli", "pki", "revoke", "--ca-dir", str(fed.ca_dir),
                          "--cert", fed.creds(site)["cert"]], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr


def test_an_open_work_stream_ends_when_its_certificate_is_revoked(running):
    a = running.creds("site-a")
    with secure_channel(running.address, TlsFiles(a["cert"], a["key"], a["ca"]), server_name="localhost") as ch:
        stream = agent_pb2_grpc.AgentServiceStub(ch).WatchWork(agent_pb2.WatchWorkRequest(protocol_version=1),
                                                                 timeout=120)
        assert next(stream).WhichOneof("item") == "heartbeat"  # open and served
        _revoke(running, "site-a")
        with pytest.raises(grpc.RpcError) as exc:
            for _item in stream:  # heartbeats (every 2 s here) until the check before the next one ends it
                pass
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "was revoked while this call was open" in exc.value.details()

