"""Stored data is verified when it is read back (issue 16, item 3), over real processes.

A model blob edited on disk between rounds is never aggregated from, streamed or re-published: the task fails
with "stored copy damaged ..., restore from backup" (never "transit"). An acknowledged update whose spill file
was overwritten with NaN before the aggregator was SIGKILLed is refused at recovery, and no model of the task
becomes non-finite.
"""

from __future__ import annotations

import os
import signal
import stat

import numpy as np
import pytest

from fedclinic.client import state_name
from fedclinic.federation.local_federation import wait_until

from tests.helpers.federation import keep_aggregator_address
from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package

pytestmark = pytest.mark.integration


def _reports(client, task_id: str, rnd: int) -> int:
    rounds = [r for r in client.status(task_id).rounds if r.round == rnd]
    return len(rounds[0].reports) if rounds else 0


def _overwrite(path, data: bytes) -> None:
    os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
    with open(path, "r+b") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _models_finite(client, status) -> None:
    """Every model the task published (initial and each round's) is finite."""
    for rnd in [-1, *(r.round for r in status.rounds if r.model_hash)]:
        package = client.fetch_package(status.task_id, round=rnd)
        for name, arr in package.tensors.items():
            assert np.isfinite(arr).all(), f"round {rnd}: tensor {name} is not finite"


def test_a_model_blob_edited_between_rounds_fails_the_task_and_nothing_is_republished(federation_factory,
                                                                                       monkeypatch):
    fed = federation_factory(2, start=False)
    fed.make_pki()
    fed.start_aggregator()
    fed.start_agent("site-a")
    monkeypatch.setenv("FEDCLINIC_FAILPOINTS", "agent.after-receipt")  # site-b stops after its round-1 receipt
    crashing = fed.start_agent("site-b")
    monkeypatch.delenv("FEDCLINIC_FAILPOINTS")
    with fed.client() as client:
        st = client.submit(make_task(num_rounds=3, min_sites=2, sites=["site-a", "site-b"], round_timeout_s=300),
                           package=tiny_package())
        assert crashing.wait(120) == 97
        wait_until(lambda: _reports(client, st.task_id, 2) == 1, 120, "site-a's round-2 update")
        round1 = client.status(st.task_id).rounds[0].model_hash
        initial = {t.sha256 for t in client.fetch_package(st.task_id, round=-1).manifest().tensors}
        changed = [t for t in client.fetch_package(st.task_id, round=1).manifest().tensors if t.sha256 not in initial]
        assert changed, "round 1 changed no tensor"
        blob = fed.root / "aggregator-state" / "blobs" / changed[0].sha256[:2] / changed[0].sha256[2:]
        _overwrite(blob, b"\x7f" * 8)  # someone edits the round-1 model on the aggregator's disk
        fed.start_agent("site-b")      # resends its round-1 update, then needs the round-1 model for round 2
        final = client.wait(st.task_id, timeout=120, progress=False)
    assert state_name(final.state) == "failed", final.error
    assert "stored copy damaged" in final.error and "restore from backup" in final.error, final.error
    assert changed[0].name in final.error and "transit" not in final.error
    assert str(fed.root) not in final.error                          # no server path reaches the scientist
    assert [r.model_hash for r in final.rounds] == [round1, ""]      # nothing was published after round 1
    log = fed.log_text("aggregator")
    assert "stored copy damaged" in log and str(blob) in log          # the operator's log names the file
    # the agent says whose copy is damaged (it logs after the aggregator failed the task), and does not blame transit
    wait_until(lambda: "the aggregator's stored copy of model" in fed.log_text("agent-site-b"), 60,
               "site-b to report the aggregator's damaged copy")
    assert "(corrupted in transit)" not in fed.log_text("agent-site-b")


def test_a_spill_file_overwritten_with_nan_before_a_sigkill_is_refused_at_recovery(federation_factory):
    fed = federation_factory(2, start=False)
    fed.make_pki()
    fed.start_aggregator()
    keep_aggregator_address(fed)  # agents reconnect to the same address
    fed.start_agent("site-a")
    with fed.client() as client:
        st = client.submit(make_task(num_rounds=1, min_sites=2, sites=["site-a", "site-b"], round_timeout_s=300),
                           package=tiny_package())
        wait_until(lambda: _reports(client, st.task_id, 1) == 1, 120, "site-a's acknowledged round-1 update")
    spills = [p for p in (fed.root / "aggregator-state" / "updates" / st.task_id / "1").iterdir() if p.is_file()]
    assert len(spills) == 1
    size = spills[0].stat().st_size
    _overwrite(spills[0], np.full(size // 4, np.nan, np.float32).tobytes())
    assert fed.signal_aggregator(signal.SIGKILL) == -signal.SIGKILL
    fed.start_aggregator()
    fed.start_agent("site-b")  # would complete the round with the recovered (NaN) update before the fix
    with fed.client() as client:
        final = client.wait(st.task_id, timeout=120, progress=False)
        assert state_name(final.state) == "failed", final.error
        assert "stored copy damaged" in final.error and "site-a" in final.error, final.error
        assert "restore from backup" in final.error and str(fed.root) not in final.error
        _models_finite(client, final)
    log = fed.log_text("aggregator")
    assert "round not recovered: stored copy damaged" in log and str(spills[0]) in log
