"""Crash safety: SIGKILLed aggregator resumes its round; a crashed agent never double-counts its update."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from fedclinic.client import state_name
from fedclinic.federation.local_federation import wait_until

from tests.helpers.federation import keep_aggregator_address
from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package

pytestmark = pytest.mark.integration


def _reports(client, task_id, rnd):
    st = client.status(task_id)
    return [r for r in st.rounds if r.round == rnd][0].reports if len(st.rounds) >= rnd else []


def test_aggregator_sigkill_mid_round_resumes_with_exact_counts(federation_factory):
    fed = federation_factory(3, start=False)
    fed.make_pki()
    fed.start_aggregator()
    keep_aggregator_address(fed)  # agents reconnect to the same address
    fed.start_agent("site-a")
    fed.start_agent("site-b")
    with fed.client() as client:
        st = client.submit(make_task(num_rounds=2, min_sites=3, round_timeout_s=300), package=tiny_package())
        wait_until(lambda: len(_reports(client, st.task_id, 1)) == 2, 120, "two durable round-1 updates")
    assert fed.signal_aggregator(signal.SIGKILL) == -signal.SIGKILL
    fed.start_aggregator()
    fed.start_agent("site-c")
    with fed.client() as client:
        final = client.wait(st.task_id, timeout=300, progress=False)
    assert state_name(final.state) == "completed", final.error
    assert [sorted(r.site_id for r in rnd.reports) for rnd in final.rounds] == [["site-a", "site-b", "site-c"]] * 2
    assert "round recovered" in fed.log_text("aggregator")


# the kill after the receipt (the resend acknowledged as a duplicate, not re-counted) is the next test's, with the
# top-k codec whose error feedback it also checks: one federation for both
@pytest.mark.parametrize("failpoint", ["agent.upload.chunk:2"])
def test_agent_killed_during_upload_never_duplicates(federation_factory, failpoint, monkeypatch):
    fed = federation_factory(2, start=False)
    fed.make_pki()
    fed.start_aggregator()
    fed.start_agent("site-a")
    monkeypatch.setenv("FEDCLINIC_FAILPOINTS", failpoint)
    crashing = fed.start_agent("site-b")
    monkeypatch.delenv("FEDCLINIC_FAILPOINTS")
    with fed.client() as client:
        st = client.submit(make_task(num_rounds=1, min_sites=2, round_timeout_s=300), package=tiny_package())
        assert crashing.wait(120) == 97  # died at the failpoint, mid-upload or before clearing its outbox
        fed.start_agent("site-b")         # restarts and resends what its outbox still holds
        final = client.wait(st.task_id, timeout=300, progress=False)
    assert state_name(final.state) == "completed", final.error
    assert sorted(r.site_id for r in final.rounds[0].reports) == ["site-a", "site-b"]


def test_agent_killed_after_receipt_commits_its_error_feedback_on_resend(federation_factory, monkeypatch):
    """An agent killed after the aggregator's receipt never duplicates its update: the resend is acknowledged as a
    duplicate, not re-counted. And top-k keeps what it did not send: staged before the upload, committed only once
    the aggregator's receipt is in. An agent killed between receipt and commit resends, gets a duplicate receipt,
    then commits."""
    from fedclinic.codecs import ErrorFeedback

    fed = federation_factory(2, start=False)
    fed.make_pki()
    fed.start_aggregator()
    fed.start_agent("site-a")
    monkeypatch.setenv("FEDCLINIC_FAILPOINTS", "agent.after-receipt")
    crashing = fed.start_agent("site-b")
    monkeypatch.delenv("FEDCLINIC_FAILPOINTS")
    with fed.client() as client:
        st = client.submit(make_task(num_rounds=1, min_sites=2, round_timeout_s=300, codec="topk:0.1"),
                           package=tiny_package())
        assert crashing.wait(120) == 97
        path = fed.root / "agent-site-b" / "codec-state" / f"{st.task_id}.error-feedback.safetensors"
        staged = ErrorFeedback.load(path)
        assert staged.pending and not staged.names  # acknowledged, not yet committed when it died
        fed.start_agent("site-b")
        final = client.wait(st.task_id, timeout=300, progress=False)
    assert state_name(final.state) == "completed", final.error
    assert sorted(r.site_id for r in final.rounds[0].reports) == ["site-a", "site-b"]  # site-b counted once
    # the agent commits, then logs the duplicate receipt: wait for the later line, then check both happened
    wait_until(lambda: '"duplicate": true' in fed.log_text("agent-site-b"), 60, "the duplicate receipt")
    assert "error-feedback residual committed" in fed.log_text("agent-site-b")
    committed = ErrorFeedback.load(path)
    assert committed.pending == () and committed.names == staged.pending
    for name in staged.pending:
        assert np.count_nonzero(committed.residual(name)) > 0  # what top-10 % left out, kept for the next round
