"""Revocation cannot be rolled back or silently absent (issue 16, item 6), over real processes.

An older, validly signed CRL copied over the current one is refused (the revoked agent stays refused, the log names
both CRL numbers), also across a restart; an aggregator without a CRL refuses to start unless the development
switch ``[tls] allow_no_crl = true`` is set, and then warns.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import grpc
import pytest

from fedclinic.errors import FedclinicError
from fedclinic.federation.local_federation import to_toml, wait_until
from fedclinic.proto import agent_pb2, agent_pb2_grpc
from fedclinic.transport.rpc import TlsFiles, secure_channel

pytestmark = pytest.mark.integration


def _hello(fed, site: str):
    a = fed.creds(site)
    with secure_channel(fed.address, TlsFiles(a["cert"], a["key"], a["ca"]), server_name="localhost") as ch:
        return agent_pb2_grpc.AgentServiceStub(ch).Hello(agent_pb2.HelloRequest(protocol_version=1), timeout=15)


def _refused_as_revoked(fed, site: str) -> None:
    with pytest.raises(grpc.RpcError) as exc:
        _hello(fed, site)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in exc.value.details()


def _pki(fed, *args: str) -> None:
    run = subprocess.run([sys.executable, "-m", "fedclinic.cli", "pki", *args, "--ca-dir", str(fed.ca_dir)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def _put(src, dst) -> None:
    tmp = dst.with_name(dst.name + ".incoming")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _events(fed, name: str) -> list[dict]:
    out = []
    for line in fed.log_text("aggregator").splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get("event") == name:
            out.append(doc)
    return out


def test_an_older_crl_copied_over_the_current_one_does_not_readmit_a_revoked_agent(federation_factory, tmp_path):
    fed = federation_factory(1, start=False)
    fed.make_pki()
    crl = fed.ca_dir / "crl.pem"
    old = tmp_path / "crl-before-revocation.pem"
    shutil.copyfile(crl, old)  # validly signed by the CA, CRL number 1, revokes nothing
    fed.start_aggregator()
    assert _hello(fed, "site-a").site_id == "site-a"

    _pki(fed, "revoke", "--cert", fed.creds("site-a")["cert"], "--reason", "keyCompromise")  # CRL number 2
    _refused_as_revoked(fed, "site-a")

    _put(old, crl)  # roll revocation back
    _refused_as_revoked(fed, "site-a")  # every call looks at the file: the older list was seen and refused
    wait_until(lambda: _events(fed, "older revocation list refused"), 30, "the refusal in the aggregator log")
    refusal = _events(fed, "older revocation list refused")[0]
    assert refusal["offered_crl_number"] == 1 and refusal["in_use_crl_number"] == 2 and refusal["revoked"] == 1
    assert [e["revoked"] for e in _events(fed, "revocation list reloaded")] == [1]  # never reloaded to 0 revoked

    # a restart with the old CRL still there is refused too (the state folder remembers CRL number 2)
    assert fed.signal_aggregator() == 0
    with pytest.raises(FedclinicError, match="the aggregator exited with code 2"):
        fed.start_aggregator()
    assert "older than the one already used" in fed.log_text("aggregator")
    assert "CRL number 1" in fed.log_text("aggregator") and "CRL number 2" in fed.log_text("aggregator")

    _pki(fed, "refresh-crl")  # the operator issues the current list again: number 3, site-a still revoked
    fed.start_aggregator()
    _refused_as_revoked(fed, "site-a")


def _write_config(fed, tmp_path, **tls_extra) -> tuple:
    state = tmp_path / "no-crl-state"
    state.mkdir(exist_ok=True)
    path = tmp_path / "aggregator-no-crl.toml"
    path.write_text(to_toml({"listen": "127.0.0.1:0", "state_dir": str(state), **fed.aggregator_state(state),
                             "tls": {**fed.creds("aggregator"), **tls_extra}}))
    return path, state


def test_an_aggregator_without_a_crl_refuses_to_start_unless_the_dev_switch_is_set(federation_factory, tmp_path):
    fed = federation_factory(1, start=False)
    fed.make_pki()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("FEDCLINIC_AGGREGATOR_TLS__ALLOW_NO_CRL", None)
    path, state = _write_config(fed, tmp_path)
    run = subprocess.run([sys.executable, "-m", "aggregator_service.cli", "serve", "--config", str(path)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 2
    assert "no revocation list configured" in run.stderr and "refusing to start" in run.stderr
    assert "[tls] crl" in run.stderr and "allow_no_crl = true" in run.stderr
    assert not (state / "aggregator.addr").exists()

    path, state = _write_config(fed, tmp_path, allow_no_crl=True)
    log_path = tmp_path / "aggregator-no-crl.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "aggregator_service.cli", "serve", "--config", str(path)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        def alive() -> None:
            assert proc.poll() is None, log_path.read_text(errors="replace")

        wait_until((state / "aggregator.addr").exists, 60, "the dev-mode aggregator to listen", check=alive)
        text = log_path.read_text(errors="replace")
        assert "NO REVOCATION LIST" in text and "revoked certificates are accepted" in text
    finally:
        proc.terminate()
        proc.wait(30)
