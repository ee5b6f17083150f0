"""Aggregation throughput and memory of the aggregator's streaming FedAvg accumulator.

Workload: 10 sites x 100 MB fp32 updates (25 M parameters), laid out as the aggregator stores them (spill
files on disk, read block by block) and folded with the same FedAvg code the service runs, then finalized
against a global model blob. Baseline, measured in the same run: the physical floor of an in-memory
running sum ``np.add(acc, u, out=acc)`` over the same sizes. The fold runs in a child process so its peak
RSS is its own.

Prints ns per parameter per site (fold), the ratio to the floor, and peak RSS / model size.
Target (issue #2): <= 1.3 ns/param/site and peak RSS <= 2x model size.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

P = 25_000_000
N = 10


def vm_hwm() -> int:
    """Peak resident set of this address space (ru_maxrss would include the parent's, inherited over exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(folder: Path) -> None:
    from fedclinic.strategies import FedAvg
    from fedclinic.strategies.tensorsource import FileTensor

    rss_start = vm_hwm()
    s = FedAvg()
    s.begin({"w": FileTensor(folder / "global.bin", 0, "float32", (P,))})
    t0 = time.perf_counter()
    for i in range(N):
        s.accept({"w": FileTensor(folder / f"u{i}.bin", 0, "float32", (P,))}, float(i + 1), site=f"s{i}")
    fold = time.perf_counter() - t0
    t1 = time.perf_counter()
    out = s.finalize()["w"]
    fin = time.perf_counter() - t1
    assert np.isfinite(out[:1000]).all()
    peak = vm_hwm()
    print(json.dumps({"fold_s": fold, "finalize_s": fin, "peak_rss": peak, "rss_at_start": rss_start}))


def floor() -> float:
    rng = np.random.default_rng(0)
    acc = np.zeros(P, np.float32)
    u = rng.standard_normal(P, dtype=np.float32)
    np.add(acc, u, out=acc)  # touch
    t0 = time.perf_counter()
    for _ in range(N):
        np.add(acc, u, out=acc)
    return (time.perf_counter() - t0) / (N * P) * 1e9


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        child(Path(args.child))
        return 0
    model_bytes = P * 4
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent.parent) as tmp:
        folder = Path(tmp)
        rng = np.random.default_rng(1)
        block = rng.standard_normal(P, dtype=np.float32)
        for name in ["global", *[f"u{i}" for i in range(N)]]:
            block.tofile(folder / f"{name}.bin")  # written just now: in the page cache, as fresh uploads are
        del block
        floor_ns = floor()
        res = json.loads(subprocess.run([sys.executable, __file__, "--child", str(folder)], check=True,
                                        capture_output=True, text=True).stdout)
    ns = res["fold_s"] / (N * P) * 1e9
    rss_ratio = res["peak_rss"] / model_bytes
    print(f"workload: {N} sites x {model_bytes / 1e6:.0f} MB fp32 updates, streaming FedAvg from spill files")
    print(f"floor (in-memory np.add running sum): {floor_ns:.3f} ns/param/site")
    print(f"fedclinic fold:                       {ns:.3f} ns/param/site ({ns / floor_ns:.2f}x floor)")
    print(f"finalize (scale + add global blob):   {res['finalize_s'] * 1e3:.0f} ms")
    print(f"peak RSS of the fold process:         {res['peak_rss'] / 1e6:.0f} MB = {rss_ratio:.2f}x model size "
          f"(interpreter + numpy at start: {res['rss_at_start'] / 1e6:.0f} MB)")
    met = ns <= 1.3 and rss_ratio <= 2.0
    print(f"RESULT aggregation ns_per_param_site={ns:.3f} floor_ns={floor_ns:.3f} ratio_vs_floor={ns / floor_ns:.2f} "
          f"peak_rss_x_model={rss_ratio:.2f} target=ns<=1.3,rss<=2.0x met={'yes' if met else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
