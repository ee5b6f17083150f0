"""Smoke of the disk-full part (campaign.disk_full): the aggregator's and an agent's disk fill up during a task
(a real tmpfs where the run may mount one, else the injected ENOSPC); clear errors, nothing corrupted, the task
completes once space is back."""

from __future__ import annotations

import json

import pytest

from campaign import disk_full

pytestmark = pytest.mark.integration


def test_disk_full_smoke(tmp_path):
    out = tmp_path / "disk_full.json"
    rc = disk_full.main(["--smoke", "--out", str(out)])
    frag = json.loads(out.read_text())
    assert rc == 0 and frag["ok"], frag["findings"]
    rows = dict(frag["rows"])
    assert rows["aggregator: task after space came back"].startswith("completed")
    assert rows["agent: task after space came back"].startswith("completed")
