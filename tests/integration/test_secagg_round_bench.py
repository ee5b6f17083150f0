"""The secure-round bench (bench/secagg_round.py) end to end in its --smoke mode: a plain and a secure task over the
real services, and the RESULT line the full run prints."""

from __future__ import annotations

import json

import pytest

from tests.helpers.benches import load_bench

pytestmark = pytest.mark.integration


def test_secagg_round_bench_smoke(tmp_path, capsys):
    bench = load_bench("secagg_round")
    out = tmp_path / "figures.json"
    assert bench.main(["--smoke", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert len(figures["times"]["plain"]) == 2 and len(figures["times"]["secure"]) == 2
    assert all(t > 0 for ts in figures["times"].values() for t in ts)
    printed = capsys.readouterr().out
    result = [line for line in printed.splitlines() if line.startswith("RESULT secagg_round ")]
    assert len(result) == 1 and "target=<=1.3 met=" in result[0], printed
