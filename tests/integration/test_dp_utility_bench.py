"""The DP-utility bench (bench/dp_utility.py) end to end in its --smoke mode: a non-private task and the planner's
proposals for two target epsilons over the real services (tiny transformer), the sites' charged epsilon within the
target, and the RESULT line the full run prints."""

from __future__ import annotations

import json

import pytest

from tests.helpers.benches import load_bench

pytestmark = pytest.mark.integration


def test_dp_utility_bench_smoke(tmp_path, capsys):
    bench = load_bench("dp_utility")
    out = tmp_path / "figures.json"
    assert bench.main(["--smoke", "--out", str(tmp_path / "work"), "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    runs = figures["runs"]
    assert set(runs) == {"nonprivate", "eps8", "eps3"}
    for eps in (8, 3):
        spent = runs[f"eps{eps}"]["epsilon_spent"]
        assert 0 < spent <= eps + 1e-6, runs  # what the sites' ledgers charged, within the planned target
        assert runs[f"eps{eps}"]["config"] == "head, full sampling"
    assert all(0.0 <= r["figure"] <= 1.0 for r in runs.values())
    printed = capsys.readouterr().out
    result = [line for line in printed.splitlines() if line.startswith("RESULT dp_utility ")]
    assert len(result) == 1 and "target=eps8>=nonprivate-0.10,eps3>=majority+0.08 met=" in result[0], printed
