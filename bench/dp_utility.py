"""What sample-level DP leaves of the demo's accuracy, with the configurations `fedclinic privacy plan` proposes.

Full run (``make bench-dp-utility``): the demo (``fedclinic demo``: 3 hospital agents and the aggregator as separate
processes over mutual TLS, real drug reviews, MiniLM-L6, 5 rounds), run through the demo's own driver
(:func:`fedclinic.federation.demo.run_demo`) several times in one bench run:

1. the non-private demo as it ships (top two layers + pooler + head, AdamW 2e-4): the baseline of this run;
2. for each target epsilon (``--epsilons``, default 8 and 3; delta 1e-5): the proposal of
   :class:`fedclinic.privacy.privacy_planner.PrivacyPlanner` for the demo's sites (their training rows, the
   demo's rounds, epochs and batch; trainable sets counted on the demo's model), run as the demo with that
   trainable set, optimizer and learning rate and the proposal's ``[privacy]`` sampling settings.

The figure is the global model's test accuracy after the last round (``--task ner``: entity-level strict F1) on the
held-out reviews no site trains on; the epsilon is the one the sites charged (the rounds' ``dp_epsilon``, the
largest cumulative spend of any site's ledger). ``--smoke`` runs the same comparison over the real services with
the tests' tiny transformer and two-label data (seconds), for ``make test``
(tests/integration/test_dp_utility_bench.py).

Ends with ``RESULT dp_utility nonprivate=... eps8=... eps3=... majority=... target=eps8>=nonprivate-0.10,
eps3>=majority+0.08 met=yes|no`` (NER: ``RESULT dp_utility_ner ...`` against the same rules, with the strict F1 of
a constant "no entity" tagger, 0, as the floor).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

DELTA = 1e-5
#: eps8 within this of the non-private model; eps3 at least MARGIN above the majority class (issue 18)
GAP, MARGIN = 0.10, 0.08


def _planner(rows: list[int], epsilon: float, rounds: int, epochs: int, batch: int, sets, max_passes: int = 0):
    from fedclinic.privacy.privacy_planner import PrivacyPlanner

    return PrivacyPlanner(epsilon=epsilon, delta=DELTA, rows=rows, rounds=rounds, epochs=epochs, batch_size=batch,
                          sets=sets, max_passes=max_passes)


def _demo_sets(task: str):
    """The candidate trainable sets, counted on the demo's own initial model (mean pooling for classification)."""
    from fedclinic.assets.drugreview import minilm_path
    from fedclinic.assets.silver_ner import NER_LABELS
    from fedclinic.federation import demo
    from fedclinic.models import package_pretrained
    from fedclinic.models.token_classification import package_ner_pretrained
    from fedclinic.privacy.privacy_planner import sets_from_sizes

    if task == "ner":
        package = package_ner_pretrained(minilm_path(), labels=list(NER_LABELS), architecture="transformer-crf",
                                         max_length=96, seed=0)
        named = {"head+crf": (demo.NER_HEAD, "head"), "head+crf+top2": (demo.NER_TRAINABLE, "layers")}
    else:
        from fedclinic.assets.drugreview import condition_classification

        labels = condition_classification(top_k=5, seed=0)[0]
        package = package_pretrained(minilm_path(), labels=labels, max_length=96, seed=0, config={"pooling": "mean"})
        named = {"head": (demo.HEAD_ONLY, "head"),
                 "head+top2": ([p for p in demo.TRAINABLE if p != demo.POOLER], "layers"),
                 "all": ([p for p in demo.ALL_LAYERS if p != demo.POOLER], "layers")}
    sizes = {name: int(t.size) for name, t in package.tensors.items()}
    sets = sets_from_sizes(sizes, named)
    for s in sets:  # the demo trains a mean-pooled classifier for these counts
        object.__setattr__(s, "model_config", (("pooling", "mean"),) if task == "classification" else ())
    return sets


def _run_demo(argv: list[str], out: Path) -> dict[str, Any]:
    from fedclinic.federation.demo import add_demo_arguments, run_demo

    p = argparse.ArgumentParser()
    add_demo_arguments(p)
    report = out.with_suffix(".json")
    args = p.parse_args(argv + ["--out", str(out), "--report", str(report), "--no-baselines", "--no-export"])
    if run_demo(args) != 0:
        raise SystemExit(f"the demo run {' '.join(argv)} failed")
    return json.loads(report.read_text())


def run_full(task: str, epsilons: list[float], out: Path, max_passes: int = 0) -> dict[str, Any]:
    """The non-private demo and one private run per epsilon (each the planner's proposal)."""
    from fedclinic.federation.demo import site_training_rows
    from fedclinic.privacy.privacy_planner import SUGGESTED_OPTIMIZER

    key = "global_strict_f1" if task == "ner" else "global_accuracy"
    rounds, epochs, batch = 5, 1, 16
    rows = site_training_rows(task)
    sets = _demo_sets(task)
    results: dict[str, Any] = {"task": task, "rows": rows, "runs": {}}
    t0 = time.monotonic()
    rep = _run_demo(["--task", task], out / "nonprivate")
    results["runs"]["nonprivate"] = {"figure": rep["rounds"][-1][key], "config": "the demo as it ships",
                                     "per_round": [r[key] for r in rep["rounds"]]}
    print(f"non-private: {results['runs']['nonprivate']['figure']:.3f} ({time.monotonic() - t0:.0f} s)", flush=True)
    for eps in epsilons:
        planner = _planner(rows, eps, rounds, epochs, batch, sets, max_passes)
        best = planner.propose()
        optimizer, lr = SUGGESTED_OPTIMIZER[best.trainable.kind]
        pv = best.privacy
        argv = ["--task", task, "--privacy-epsilon", str(eps), "--optimizer", optimizer, "--learning-rate", str(lr),
                "--privacy-sample-rate", str(pv.get("sample_rate", 0.0)),
                "--privacy-logical-batch", str(pv.get("logical_batch_size", 0)),
                "--privacy-steps", str(pv.get("steps_per_round", 0))]
        argv += [a for p in best.trainable.patterns for a in ("--trainable", p)]
        if dict(best.trainable.model_config).get("pooling") == "mean":
            argv += ["--pooling", "mean"]
        t1 = time.monotonic()
        rep = _run_demo(argv, out / f"eps{eps:g}")
        results["runs"][f"eps{eps:g}"] = {
            "figure": rep["rounds"][-1][key], "per_round": [r[key] for r in rep["rounds"]],
            "epsilon_spent": rep["privacy"]["epsilon_spent"], "site_plans": rep["privacy"]["site_plans"],
            "config": f"{best.trainable.name} (d={best.trainable.parameters:,}), {best.sampling} sampling, "
                      f"{optimizer} lr {lr:g}", "snr": best.snr, "argv": argv}
        print(f"eps {eps:g}: {results['runs'][f'eps{eps:g}']['figure']:.3f} ({time.monotonic() - t1:.0f} s)",
              flush=True)
    if task == "ner":
        results["majority"] = 0.0  # a tagger that finds no entity has strict F1 0
    else:
        from fedclinic.assets.drugreview import condition_classification

        _, _, test = condition_classification(top_k=5, seed=0)
        labels = [ex.labels[0] for ex in test]
        results["majority"] = max(labels.count(c) for c in set(labels)) / len(labels)
    return results


def run_smoke(epsilons: list[float], out: Path) -> dict[str, Any]:
    """The same comparison over the real services with the tests' tiny transformer (2 sites, 1 round each: a
    smoke of the wiring for `make test`, not a measurement)."""
    from fedclinic.client import state_name
    from fedclinic.federation.local_federation import LocalFederation, SiteSetup
    from fedclinic.models import build_model
    from fedclinic.privacy.privacy_planner import SUGGESTED_OPTIMIZER, sets_from_sizes
    from fedclinic.data.text import Example
    from fedclinic.training import trainer as training
    from tests.helpers.tasks import make_task
    from tests.helpers.text_models import make_examples, tiny_package

    package = tiny_package("transformer", seed=0)
    sizes = {name: int(t.size) for name, t in package.tensors.items()}
    sets = sets_from_sizes(sizes, {"head": ([r"classifier\..*"], "head"), "all": ([r"(?!.*embeddings).*"], "layers")})
    rows, setups = [24, 24], []
    for i, n in enumerate(rows):
        name = f"hospital-{chr(ord('a') + i)}"
        (out / "data" / name).mkdir(parents=True, exist_ok=True)
        path = out / "data" / name / "train.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in make_examples(n, seed=i)))
        setups.append(SiteSetup(name, datasets={"notes": {"path": str(path), "format": "jsonl",
                                                          "privacy_epsilon": 100.0, "privacy_delta": 1e-3}}))
    test = [Example(r["text"], (r["label"],)) for r in make_examples(40, seed=99)]
    results: dict[str, Any] = {"task": "smoke", "rows": rows, "runs": {}}
    with LocalFederation(out / "federation", setups, agent_threads=1) as fed:
        fed.start()
        with fed.client() as client:
            def accuracy(task) -> float:
                st = client.submit(task, package=package)
                final = client.wait(st.task_id, timeout=300, progress=False)
                if state_name(final.state) != "completed":
                    raise SystemExit(f"the smoke task ended {state_name(final.state)}: {final.error}")
                loaded = build_model(client.fetch_package(st.task_id, round=final.rounds[-1].round))
                results["last_dp_epsilon"] = final.rounds[-1].metrics.get("dp_epsilon")
                return training.evaluate(loaded, training.encode(test, loaded, max_length=16))["accuracy"]

            common = dict(architecture="transformer", num_rounds=1, min_sites=len(rows), local_epochs=1, batch_size=8,
                          round_timeout_s=120)
            results["runs"]["nonprivate"] = {"figure": accuracy(make_task(**common, trainable=[r"(?!.*embeddings).*"],
                                                                          learning_rate=0.05)), "config": "all, sgd"}
            for eps in epsilons:
                best = _planner(rows, eps, 1, 1, 8, sets).propose()
                optimizer, lr = SUGGESTED_OPTIMIZER[best.trainable.kind]
                fig = accuracy(make_task(**common, trainable=list(best.trainable.patterns), optimizer=optimizer,
                                         learning_rate=lr, privacy=best.privacy))
                results["runs"][f"eps{eps:g}"] = {"figure": fig, "epsilon_spent": results.pop("last_dp_epsilon"),
                                                  "config": f"{best.trainable.name}, {best.sampling} sampling",
                                                  "site_plans": {}}
    results["majority"] = 0.5
    return results


def verdict(results: dict[str, Any], epsilons: list[float]) -> tuple[bool, str]:
    runs, base = results["runs"], results["runs"]["nonprivate"]["figure"]
    hi, lo = f"eps{max(epsilons):g}", f"eps{min(epsilons):g}"
    met = runs[hi]["figure"] >= base - GAP and runs[lo]["figure"] >= results["majority"] + MARGIN
    figs = " ".join(f"{k}={v['figure']:.3f}" for k, v in runs.items())
    name = "dp_utility_ner" if results["task"] == "ner" else "dp_utility"
    return met, (f"RESULT {name} {figs} majority={results['majority']:.3f} target={hi}>=nonprivate-{GAP:.2f},"
                 f"{lo}>=majority+{MARGIN:.2f} met={'yes' if met else 'no'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=("classification", "ner"), default="classification")
    ap.add_argument("--epsilons", default="8,3", help="target epsilons, comma-separated (default: %(default)s)")
    ap.add_argument("--max-passes", type=int, default=None, help="the planner's compute cap for full batches (passes "
                    "over the rows per epoch; default: none for classification, 5 for ner)")
    ap.add_argument("--smoke", action="store_true", help="tiny transformer over the real services (seconds)")
    ap.add_argument("--out", type=Path, help="working folder (default: a temporary one)")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args(argv)
    epsilons = [float(e) for e in args.epsilons.split(",") if e.strip()]
    if not epsilons:
        raise SystemExit("--epsilons needs at least one value")
    with tempfile.TemporaryDirectory(prefix="dp-utility-") as tmp:
        out = args.out or Path(tmp)
        results = run_smoke(epsilons, out) if args.smoke else run_full(
            args.task, epsilons, out, args.max_passes if args.max_passes is not None else 5 if args.task == "ner" else 0)
    what = "strict F1" if results["task"] == "ner" else "accuracy"
    print(f"\n| run | configuration | sigma (per site) | q | steps/round | epsilon spent | {what} |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results["runs"].items():
        plans = list(r.get("site_plans", {}).values())
        sig = ", ".join(f"{p['noise_multiplier']:.3f}" for p in plans) or "-"
        q = ", ".join(sorted({f"{p['sample_rate']:.3g}" for p in plans})) or "-"
        steps = ", ".join(sorted({str(p["steps_per_round"]) for p in plans})) or "-"
        spent = f"{r['epsilon_spent']:.3f}" if r.get("epsilon_spent") is not None else "-"
        print(f"| {name} | {r['config']} | {sig} | {q} | {steps} | {spent} | {r['figure']:.3f} |")
    met, line = verdict(results, epsilons)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
