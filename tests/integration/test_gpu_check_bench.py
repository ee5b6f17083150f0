"""The GPU check (bench/gpu_check.py): without CUDA its default invocation says so and exits 0; with ``--device cpu
--smoke`` the same code path (every row through run_site_round: fp32, bf16 and fp16 autocast, DP-SGD, the CPU path)
runs here on tiny models, prints the table and the RESULT line, and writes the figures as JSON."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.benches import load_bench

pytestmark = pytest.mark.integration


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the no-CUDA message is not printed")
def test_without_cuda_it_says_so_and_exits_0(capsys):
    bench = load_bench("gpu_check")
    assert bench.main([]) == 0
    out = capsys.readouterr().out
    assert "no CUDA: torch" in out and "nothing was measured" in out
    assert out.strip().splitlines()[-1].startswith("RESULT gpu_check families=0 cuda=no ")
    assert out.strip().endswith("met=no")


def test_cpu_smoke_runs_every_mode_through_the_site_round(tmp_path, capsys):
    bench = load_bench("gpu_check")
    out = tmp_path / "gpu.json"
    families = ["text-classification", "feature-classification"]
    argv = ["--device", "cpu", "--smoke", "--json", str(out)]
    for f in families:
        argv += ["--family", f]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    rows = {(r["family"], r["mode"]): r for r in report["rows"]}
    assert set(rows) == {(f, m) for f in families for m in bench.MODES}
    for (family, mode), r in rows.items():
        assert r["status"] == "ok", r
        assert r["steps"] == 2 and r["train_ex_s"] > 0 and r["round_s"] > 0
        assert r["vs_cpu"] == pytest.approx(r["train_ex_s"] / rows[(family, "cpu")]["train_ex_s"])
        assert r["vs_fp32"] == pytest.approx(r["train_ex_s"] / rows[(family, "fp32")]["train_ex_s"])
        assert (r["tokens_s"] is not None) == (family == "text-classification")
    assert rows[("text-classification", "dp")]["dp_mode"] == "ghost"
    assert rows[("feature-classification", "dp")]["dp_mode"] == "ghost"
    assert report["ddp"]["status"].startswith("not measured: ")
    assert report["result"]["families"] == 2 and report["result"]["met"] is False
    printed = capsys.readouterr().out
    assert "GPU(s) visible; the multi-GPU (DDP) measurement runs through the site's distributed launcher" in printed
    result = [line for line in printed.splitlines() if line.startswith("RESULT gpu_check ")]
    assert len(result) == 1 and result[0].startswith("RESULT gpu_check families=2 device=cpu ")
    assert "target=every family trains on GPU in fp32/bf16/fp16 and DP met=no" in result[0]
