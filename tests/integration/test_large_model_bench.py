"""The large-model bench (bench/large_model.py) end to end in its --smoke mode: a tiny Llama submitted, trained for
one round by a real agent with an update covering every tensor, folded and downloaded over mTLS, each process's
peak resident set read per phase, and the RESULT line the 1.1 B run prints."""

from __future__ import annotations

import json

import pytest

from tests.helpers.benches import load_bench

pytestmark = pytest.mark.integration


def test_large_model_bench_smoke(tmp_path, capsys):
    bench = load_bench("large_model")
    out = tmp_path / "figures.json"
    assert bench.main(["--smoke", "--out", str(tmp_path), "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["params"] == bench.parameters(bench.SMOKE) and figures["model_bytes"] == 4 * figures["params"]
    assert figures["uplink_bytes"] == figures["model_bytes"]  # a full-size update: every tensor, raw float32
    assert set(figures["peaks"]) == {"submit", "round", "download"}
    assert "agent" in figures["peaks"]["round"] and set(figures["client"]) == {"submit", "download"}
    for phase in figures["peaks"].values():
        assert phase["aggregator"] >= figures["idle"]["aggregator"] > 0
    printed = capsys.readouterr().out
    result = [line for line in printed.splitlines() if line.startswith("RESULT large_model ")]
    assert len(result) == 1 and "target=aggregator<=1GB,agent<=model+1GB met=" in result[0], printed
