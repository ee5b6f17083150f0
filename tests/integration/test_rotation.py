"""Certificate rotation and revocation without restarting the aggregator (issue #7 item 7), over real
processes: renewed certificates are picked up mid-task, a revoked agent is cut off while the others go on."""

from __future__ import annotations

import json
import signal
import socket
import ssl
import subprocess
import sys

import grpc
import pytest
from cryptography import x509

from fedclinic.client import state_name
from fedclinic.federation.local_federation import wait_until
from fedclinic.pki import identity_from_pem
from fedclinic.proto import agent_pb2, agent_pb2_grpc
from fedclinic.transport.rpc import TlsFiles, secure_channel

from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package

pytestmark = pytest.mark.integration


def _serial(cert_path) -> str:
    return identity_from_pem(open(cert_path, "rb").read()).serial_hex


def served_serial(fed) -> str:
    """The serial of the certificate the aggregator presents to a new TLS connection (a real handshake)."""
    creds = fed.creds("scientist")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(creds["ca"])
    ctx.load_cert_chain(creds["cert"], creds["key"])
    ctx.set_alpn_protocols(["h2"])
    host, port = fed.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=15) as sock:
        with ctx.wrap_socket(sock, server_hostname="localhost") as tls:
            der = tls.getpeercert(binary_form=True)
    return format(x509.load_der_x509_certificate(der).serial_number, "x")


def _pki(*args) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", "fedclinic.cli", "pki", *map(str, args)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run


def _log_records(fed, name: str) -> list[dict]:
    out = []
    for line in fed.log_text(name).splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _streams_open(fed) -> set[str]:
    return {r.get("site") for r in _log_records(fed, "aggregator") if r.get("event") == "work stream opened"}


def test_certificates_rotated_mid_task_without_restarting_the_aggregator(federation_factory):
    fed = federation_factory(3, start=False)
    fed.make_pki()
    fed.start_aggregator()
    fed.start_agent("site-a")
    fed.start_agent("site-b")  # site-c comes later: round 1 stays open (min_sites=3) across the rotation
    aggregator = fed.aggregator
    agg_cert, site_cert = fed.creds("aggregator")["cert"], fed.creds("site-a")["cert"]
    old_agg, old_site = _serial(agg_cert), _serial(site_cert)
    with fed.client() as client:
        st = client.submit(make_task(num_rounds=2, min_sites=3, round_timeout_s=300), package=tiny_package())
        wait_until(lambda: len(client.status(st.task_id).rounds[0].reports) == 2, 120, "two round-1 updates")
        assert served_serial(fed) == old_agg

        _pki("renew", "--ca-dir", fed.ca_dir, "--cert", agg_cert, "--days", 7)
        _pki("renew", "--ca-dir", fed.ca_dir, "--cert", site_cert, "--days", 7)
        new_agg, new_site = _serial(agg_cert), _serial(site_cert)
        assert new_agg != old_agg and new_site != old_site

        # SIGHUP makes the aggregator read its files now; the next handshake then gets the new certificate
        aggregator.send_signal(signal.SIGHUP)
        wait_until(lambda: any(r.get("event") == "reload requested" and r.get("serial") == new_agg
                               for r in _log_records(fed, "aggregator")), 30, "the aggregator to log the reload")
        assert served_serial(fed) == new_agg
        # the agent notices its renewed files by itself and moves its calls and work stream to them
        wait_until(lambda: "renewed certificate in use" in fed.log_text("agent-site-a"), 30,
                   "site-a to switch to its renewed certificate")
        # nobody needs the old site certificate any more: revoking it must not disturb the task
        _pki("revoke", "--ca-dir", fed.ca_dir, "--serial", old_site, "--reason", "superseded")
        fed.start_agent("site-c")  # connects with the new aggregator certificate; rounds 1 and 2 need all three
        final = client.wait(st.task_id, timeout=300, progress=False)
    assert state_name(final.state) == "completed", final.error
    assert [sorted(r.site_id for r in rnd.reports) for rnd in final.rounds] == [["site-a", "site-b", "site-c"]] * 2
    assert [rnd.attempt for rnd in final.rounds] == [1, 1]  # the round open during the rotation was not redone
    assert aggregator.poll() is None and fed.aggregator is aggregator  # the same process all along
    reloads = [r for r in _log_records(fed, "agent-site-a") if r.get("event") == "TLS credentials reloaded"]
    assert [(r["previous_serial"], r["serial"]) for r in reloads] == [(old_site, new_site)]


def _hello(fed, site: str):
    c = fed.creds(site)
    with secure_channel(fed.address, TlsFiles(c["cert"], c["key"], c["ca"]), server_name="localhost") as ch:
        return agent_pb2_grpc.AgentServiceStub(ch).Hello(agent_pb2.HelloRequest(protocol_version=1), timeout=15)


def test_a_revoked_agent_is_cut_off_while_the_others_go_on(federation_factory):
    fed = federation_factory(3, start=False)
    fed.sites["site-c"].policy = {"approval": "manual"}  # site-c holds round 1 open, connected, until revoked
    fed.start()
    aggregator = fed.aggregator
    wait_until(lambda: _streams_open(fed) == {"site-a", "site-b", "site-c"}, 120, "three agents' work streams")
    with fed.client() as client:
        st = client.submit(make_task(num_rounds=2, min_sites=2, round_timeout_s=20), package=tiny_package())
        wait_until(lambda: len(client.status(st.task_id).rounds[0].reports) == 2 and
                   "task awaiting approval" in fed.log_text("agent-site-c"), 120,
                   "sites a and b to report round 1 while site-c holds it")
        _pki("revoke", "--ca-dir", fed.ca_dir, "--cert", fed.creds("site-c")["cert"], "--reason", "key-compromise")

        # its open work stream is ended (at its next heartbeat) and its reconnection is refused
        def cut_off() -> bool:
            records = _log_records(fed, "aggregator")
            ended = any(r.get("event") == "call refused" and r.get("peer") == "site-c" and
                        "revoked while this call was open" in r.get("reason", "") for r in records)
            closed = any(r.get("event") == "work stream closed" and r.get("site") == "site-c" for r in records)
            return ended and closed and "has been revoked" in fed.log_text("agent-site-c")
        wait_until(cut_off, 60, "site-c's stream to be cut and its reconnection refused")
        # the operator can see in the log that the new list is in use
        assert any(r.get("event") == "revocation list reloaded" and r.get("revoked") == 1
                   for r in _log_records(fed, "aggregator"))
        with pytest.raises(grpc.RpcError) as exc:  # any new call with that certificate, e.g. an update upload
            c = fed.creds("site-c")
            with secure_channel(fed.address, TlsFiles(c["cert"], c["key"], c["ca"]), server_name="localhost") as ch:
                header = agent_pb2.UpdateHeader(task_id=st.task_id, round=1, idempotency_key="late-site-c")
                agent_pb2_grpc.AgentServiceStub(ch).SubmitUpdate(iter([agent_pb2.UpdateChunk(header=header)]),
                                                                timeout=15)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in exc.value.details()
        assert _hello(fed, "site-a").site_id == "site-a"  # the others are unaffected
        final = client.wait(st.task_id, timeout=300, progress=False)
    assert state_name(final.state) == "completed", final.error
    assert [sorted(r.site_id for r in rnd.reports) for rnd in final.rounds] == [["site-a", "site-b"]] * 2
    assert aggregator.poll() is None and fed.aggregator is aggregator  # never restarted
    assert fed.agents["site-c"].poll() is None  # the revoked agent keeps running (and retrying), it did not crash
    audit = [json.loads(line) for line in (fed.root / "aggregator-state" / "audit.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "auth.refused" and r["actor"] == "site-c" and "revoked" in r["details"]["reason"]
               for r in audit)
