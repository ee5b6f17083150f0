"""The fuzz part of the campaign (campaign/fuzz.py) in small: 120 cases per service (two batches, checked after
each) against a real aggregator, real agents running a real task and a real ``fedclinic serve``; the part must
find no crash, hang or broken invariant, and must fail when one is planted."""

from __future__ import annotations

import json

import pytest

from campaign import fuzz

pytestmark = pytest.mark.integration


def test_fuzz_smoke_finds_nothing(tmp_path):
    out = tmp_path / "fuzz.json"
    rc = fuzz.main(["--smoke", "--out", str(out)])
    frag = json.loads(out.read_text())
    assert rc == 0 and frag["ok"], frag["findings"]
    for service in fuzz.SERVICES:
        assert frag["figures"][f"cases_{service}"] >= 120
    assert frag["figures"]["crashes"] == 0
