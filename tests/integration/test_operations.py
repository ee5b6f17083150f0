"""Operations paths: quorum policies, graceful SIGTERM, check-config, and the CLI against a live aggregator."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from fedclinic.client import state_name
from fedclinic.federation.local_federation import wait_until

from tests.helpers.federation import streams_open
from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package

pytestmark = pytest.mark.integration


def test_quorum_retry_then_fail_says_which(federation_factory):
    fed = federation_factory(1)
    wait_until(lambda: "site-a" in streams_open(fed), 60, "the agent's work stream")  # asked from the first attempt
    with fed.client() as client:
        # the deadline must pass (one site can never make quorum), but leave the one site ample time to
        # deliver its update inside each attempt, even on a loaded 2-core runner
        st = client.submit(make_task(num_rounds=1, min_sites=2, round_timeout_s=12, on_quorum_miss="retry",
                                 max_round_retries=1), package=tiny_package())
        final = client.wait(st.task_id, timeout=120, progress=False)
        events = [e.message for e in client.watch(st.task_id)]
    assert state_name(final.state) == "failed"
    assert "got 1 of the 2 update(s)" in final.error and "retries are used up" in final.error
    assert any("quorum policy is 'retry': reopening" in m for m in events)
    assert final.rounds[0].attempt == 2


def test_quorum_retry_recovers_when_a_site_arrives(federation_factory):
    fed = federation_factory(2, start=False)
    fed.make_pki()
    fed.start_aggregator()
    fed.start_agent("site-a")
    with fed.client() as client:
        st = client.submit(make_task(num_rounds=1, min_sites=2, round_timeout_s=4, on_quorum_miss="retry",
                                 max_round_retries=20), package=tiny_package())
        wait_until(lambda: client.status(st.task_id).rounds[0].attempt >= 2, 60, "the round to be reopened")
        fed.start_agent("site-b")
        final = client.wait(st.task_id, timeout=120, progress=False)
    assert state_name(final.state) == "completed", final.error
    assert sorted(r.site_id for r in final.rounds[0].reports) == ["site-a", "site-b"]


def test_sigterm_stops_both_services_gracefully_and_state_survives(federation_factory):
    fed = federation_factory(2)
    with fed.client() as client:
        st = client.submit(make_task(num_rounds=1, min_sites=2), package=tiny_package())
        client.wait(st.task_id, timeout=120, progress=False)
    assert fed.signal_agent("site-a", signal.SIGTERM) == 0
    assert fed.signal_aggregator(signal.SIGTERM) == 0
    assert "aggregator stopped" in fed.log_text("aggregator")
    assert "agent stopped" in fed.log_text("agent-site-a")
    fed.start_aggregator()
    with fed.client() as client:
        assert state_name(client.status(st.task_id).state) == "completed"


def test_check_config_reports_what_to_fix(federation_factory, tmp_path):
    fed = federation_factory(1, start=False)
    fed.make_pki()
    fed.address = "127.0.0.1:1"
    good = fed.write_agent_config("site-a")
    run = subprocess.run([sys.executable, "-m", "hospital_agent.cli", "check-config", "--config", str(good)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "configuration OK" in run.stdout and "site 'site-a'" in run.stdout
    os.chmod(fed.creds("site-a")["key"], 0o644)
    bad = tmp_path / "bad.toml"
    bad.write_text(good.read_text().replace('path = "', 'path = "/nonexistent'))
    run = subprocess.run([sys.executable, "-m", "hospital_agent.cli", "check-config", "--config", str(bad)],
                         capture_output=True, text=True)
    assert run.returncode == 1
    assert "chmod 600" in run.stderr and "does not exist" in run.stderr


def test_cli_submit_status_download(federation_factory, tmp_path):
    fed = federation_factory(2)
    tiny_package().save(tmp_path / "model")  # a local model folder: the logreg family takes its tokenizer
    (tmp_path / "task.toml").write_text("""
name = "cli-task"
dataset = "notes"
labels = ["cardio", "neuro"]
architecture = "logreg"
model = "model"
[training]
optimizer = "sgd"
learning_rate = 0.05
max_length = 16
[rounds]
num_rounds = 1
min_sites = 2
round_timeout_s = 120
on_quorum_miss = "fail"
""")
    c = fed.creds("scientist")
    env = {**os.environ, "FEDCLINIC_ADDRESS": fed.address, "FEDCLINIC_CERT": c["cert"], "FEDCLINIC_KEY": c["key"],
           "FEDCLINIC_CA": c["ca"]}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "fedclinic.cli", *args], capture_output=True, text=True, env=env,
                              timeout=300)

    run = cli("task", "submit", str(tmp_path / "task.toml"), "--wait")
    assert run.returncode == 0, run.stderr
    task_id = run.stdout.split()[1]
    assert task_id.startswith("t-") and "completed" in run.stdout
    run = cli("task", "status", task_id)
    assert run.returncode == 0, run.stderr
    assert "completed" in run.stdout and "round 1: 2/2 sites" in run.stdout
    run = cli("task", "status", task_id, "--json")  # 64-bit fields as JSON numbers, not json_format's strings
    doc = json.loads(run.stdout)
    assert doc["task_id"] == task_id and type(doc["created_unix_ms"]) is int and doc["created_unix_ms"] > 0
    assert type(doc["rounds"][0]["uplink_bytes"]) is int and doc["rounds"][0]["uplink_bytes"] > 0
    assert {type(r["num_samples"]) for r in doc["rounds"][0]["reports"]} == {int}
    run = cli("task", "list", "--all", "--json")  # one JSON document
    assert [d["task_id"] for d in json.loads(run.stdout)] == [task_id], run.stdout
    run = cli("task", "download", task_id, str(tmp_path / "out"))
    assert run.returncode == 0 and (tmp_path / "out" / "model.safetensors").exists()
    run = cli("task", "list")  # nothing running: said in words, not an empty screen
    assert run.returncode == 0 and run.stdout.strip() == "no queued or running tasks (--all lists finished ones too)"
    run = cli("task", "status", "t-missing")
    assert run.returncode == 2 and "no task 't-missing'" in run.stderr
    run = cli("task", "cancel", task_id)
    assert run.returncode == 2 and "already ended" in run.stderr
    run = subprocess.run([sys.executable, "-m", "fedclinic.cli", "task", "list"], capture_output=True, text=True,
                         env={k: v for k, v in env.items() if not k.startswith("FEDCLINIC_")})
    assert run.returncode == 2 and "missing connection setting" in run.stderr


def test_an_aggregator_certificate_without_the_dialled_host_is_explained(federation_factory):
    """The first thing a new operator hits: the aggregator's certificate names only its public DNS name, and
    a client dials 127.0.0.1. The error says it is the name, and how to fix it, not "is it running?"."""
    from fedclinic import pki
    from fedclinic.client import connect
    from fedclinic.errors import FedclinicError

    fed = federation_factory(0, start=False)
    fed.make_pki()
    fed.start_aggregator()
    c = fed.creds("scientist")
    with connect(fed.address, cert=c["cert"], key=c["key"], ca=c["ca"]) as client:
        assert client.list() == []  # the default aggregator certificate names 127.0.0.1 (and localhost)
    # reissued naming only its public name, as `pki issue --dns aggregator.example.org` does; the running
    # aggregator follows its files and presents it at the next handshake
    pki.issue(fed.ca_dir, role="aggregator", name="aggregator", out_dir=fed.pki_dir / "aggregator",
              dns=["aggregator.example.org"], days=7)
    host = fed.address.rsplit(":", 1)[0]
    with connect(fed.address, cert=c["cert"], key=c["key"], ca=c["ca"]) as client:
        def refused() -> str:
            try:
                client.list()
            except FedclinicError as exc:
                return str(exc)
            return ""  # still the old certificate on a connection made before

        wait_until(lambda: "does not name" in refused(), 30, "the renamed certificate to be presented")
        message = refused()
    assert f"does not name {host!r}" in message and "--dns NAME --ip IP" in message
    assert "is it running" not in message
    with connect(fed.address, cert=c["cert"], key=c["key"], ca=c["ca"], server_name="aggregator.example.org") as ok:
        assert ok.list() == []  # the name it lists works
