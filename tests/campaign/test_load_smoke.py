"""Smoke of the load part (campaign.load): 3 agent processes x 3 rounds; every site's update counted in every
round, the aggregator's RSS and open files sampled at each round close."""

from __future__ import annotations

import json

import pytest

from campaign import load

pytestmark = pytest.mark.integration


def test_load_smoke(tmp_path):
    out = tmp_path / "load.json"
    rc = load.main(["--smoke", "--out", str(out)])
    frag = json.loads(out.read_text())
    assert rc == 0 and frag["ok"], frag["findings"]
    assert frag["figures"]["updates_counted"] == frag["figures"]["updates_expected"] == 9
