"""Backups and upgrades (issue #7 item 8) over real processes: a backup taken mid-task while the aggregator
runs restores into a new folder, and an aggregator started there completes the task with the agents."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys

import pytest

from fedclinic.client import state_name
from fedclinic.federation.local_federation import wait_until

from tests.helpers.federation import keep_aggregator_address
from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package

pytestmark = [pytest.mark.integration, pytest.mark.sqlite_state]


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aggregator_service.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=120)


def test_backup_mid_task_restores_into_a_new_folder_and_the_task_completes(federation_factory, tmp_path):
    fed = federation_factory(3, start=False)
    fed.make_pki()
    fed.start_aggregator()
    keep_aggregator_address(fed)  # the restored aggregator takes the same address
    fed.start_agent("site-a")
    fed.start_agent("site-b")  # site-c comes later: round 1 stays open (min_sites=3) while the backup runs
    with fed.client() as client:
        st = client.submit(make_task(num_rounds=2, min_sites=3, round_timeout_s=300), package=tiny_package())
        wait_until(lambda: len(client.status(st.task_id).rounds[0].reports) == 2, 120, "two durable round-1 updates")
        run = _cli("backup", "--config", fed.root / "aggregator.toml", tmp_path / "backup")
        assert run.returncode == 0, run.stderr
        assert fed.aggregator.poll() is None  # taken online
    manifest = json.loads((tmp_path / "backup" / "manifest.json").read_text())
    assert len([f for f in manifest["files"] if f["path"].startswith("updates/")]) == 2  # round 1's two updates
    run = _cli("verify-backup", tmp_path / "backup")
    assert run.returncode == 0 and "complete and intact" in run.stdout

    assert fed.signal_aggregator(signal.SIGTERM) == 0
    restored = tmp_path / "restored-state"
    run = _cli("restore", tmp_path / "backup", restored)
    assert run.returncode == 0, run.stderr
    fed.aggregator_settings["state_dir"] = str(restored)
    fed.start_aggregator()  # the same address; sites a and b reconnect to it by themselves
    fed.start_agent("site-c")
    with fed.client() as client:
        final = client.wait(st.task_id, timeout=300, progress=False)
    assert state_name(final.state) == "completed", final.error
    assert [sorted(r.site_id for r in rnd.reports) for rnd in final.rounds] == [["site-a", "site-b", "site-c"]] * 2
    records = [json.loads(line) for line in fed.log_text("aggregator").splitlines() if line.startswith("{")]
    assert any(r["event"] == "round recovered" and r["updates"] == 2 for r in records)  # folded from restored files
    db = sqlite3.connect(restored / "aggregator.sqlite")
    assert all(p.startswith(str(restored / "updates")) for (p,) in db.execute("SELECT spill_path FROM updates"))
    db.close()
    # round 1's updates from a and b came from the backup, not resent: their agents had their receipts
    for site in ("site-a", "site-b"):
        assert '"duplicate": true' not in fed.log_text(f"agent-{site}")
