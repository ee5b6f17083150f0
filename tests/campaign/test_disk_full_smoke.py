"""Smoke of the disk-full part (campaign.disk_full): the aggregator's disk fills up during a task (a real tmpfs
where the run may mount one, else the injected ENOSPC); clear errors, nothing corrupted, the task completes once
space is back. The agent's side runs in `make campaign`; in `make test` it is tests/integration/
test_agent_disk_full.py (the same path over real processes), so the smoke runs the aggregator's side only."""

from __future__ import annotations

import json

import pytest

from campaign import disk_full

pytestmark = pytest.mark.integration


def test_disk_full_smoke(tmp_path):
    out = tmp_path / "disk_full.json"
    rc = disk_full.main(["--smoke", "--sides", "aggregator", "--out", str(out)])
    frag = json.loads(out.read_text())
    assert rc == 0 and frag["ok"], frag["findings"]
    rows = dict(frag["rows"])
    assert rows["aggregator: task after space came back"].startswith("completed")
