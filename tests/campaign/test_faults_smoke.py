"""Smoke run of the campaign's network-fault part (campaign.faults --smoke): real aggregator and agents behind
fault proxies, a cut fetch, a cut upload and a black hole; the part's own checks must hold (every task ended
within its deadlines, nothing lost or counted twice, every cut transfer resumed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedclinic.federation.local_federation import LocalFederation

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_faults_smoke_holds_its_checks(tmp_path):
    out = tmp_path / "faults.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "sdk"), str(ROOT)])}
    # the part runs in a process of its own: it gets the suite's store (SQLite or PostgreSQL) from here
    state = LocalFederation(tmp_path / "fed", []).aggregator_state(tmp_path / "faults-state")
    store = ["--aggregator-state", json.dumps(state["state"])] if state else []
    proc = subprocess.run([sys.executable, "-m", "campaign.faults", "--smoke", "--out", str(out), *store], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    frag = json.loads(out.read_text())
    assert proc.returncode == 0 and frag["ok"], json.dumps(frag, indent=1) + proc.stderr[-3000:]
    fig = frag["figures"]
    assert fig["lost"] == 0 and fig["double_counted"] == 0
    assert fig["resets"] >= 2 and fig["resumed_transfers"] >= fig["resets"]  # every cut transfer resumed
    assert fig["saved_mb"] > fig["resent_mb"]
    assert fig["completed"] + fig["failed_with_reason"] == fig["tasks"]
