"""An agent whose disk fills up declines the round for now (its own resource ran out), not for good as if the
task were at fault, and takes the task again once space is back (issue 16, found by the disk-full campaign: the
agent's SQLite 'database or disk is full' was declined for good with 'the task's spec or model cannot be handled
here', so the task could never finish)."""

from __future__ import annotations

import pytest

from fedclinic.client import state_name
from fedclinic.federation.local_federation import wait_until

from campaign.full_disk import FullDisk, can_mount
from campaign.task_watch import TERMINAL, poll_status, submit
from campaign.testbed import make_federation, start_pinned
from tests.helpers.tasks import make_task

pytestmark = pytest.mark.integration


@pytest.mark.skipif(not can_mount(), reason="a real full disk (SQLite included) needs root to mount a small tmpfs")
def test_agent_on_a_full_disk_declines_for_now_and_takes_the_task_once_space_is_back(tmp_path):
    fed = make_federation(tmp_path, 2)
    disk = FullDisk(fed.root / "agent-site-b", real=True, size_mib=8)
    try:
        with fed:
            start_pinned(fed)
            wait_until(lambda: all('"event": "connected"' in fed.log_text(f"agent-{s}") for s in fed.sites), 120,
                       "both agents to connect")
            disk.fill()
            task_id = submit(fed, make_task(num_rounds=1, min_sites=2, round_timeout_s=10, on_quorum_miss="retry",
                                            max_round_retries=6))
            wait_until(lambda: "disk is full" in fed.log_text("agent-site-b"), 60, "site-b to meet its full disk")
            disk.free()
            wait_until(lambda: (st := poll_status(fed, task_id)) is not None and st.state in TERMINAL, 150,
                       "the task to end")
            final = poll_status(fed, task_id)
            with fed.client() as client:
                events = [e.message for e in client.watch(task_id)]
    finally:
        disk.close()
    assert fed.agents["site-b"].returncode in (0, -15)  # it was stopped at the end, never exited on its own
    assert state_name(final.state) == "completed", final.error
    assert sorted(r.site_id for r in final.rounds[0].reports) == ["site-a", "site-b"]
    declined = [m for m in events if "site-b" in m and "declined" in m]
    assert declined and all("spec or model" not in m for m in declined), declined
