"""FedNER's decomposition study (issue #4), in the simulator, on the silver drug-review NER data.

Three hospitals annotate differently, as in FedNER's setting: site A marks only DRUG mentions, site B only
CONDITION mentions, site C both. A site's unannotated type is ``O`` in its data, so the sites' supervision
conflicts on the shared tag set. Each site evaluates its own model on the held-out test reviews annotated
*its* way (the test spans filtered to its entity types), so predicting a type the site does not annotate
counts against it.

Configurations (the same FedNER CNN-BiLSTM-CRF, seed and data in each):

* ``local``      every site trains alone for the same number of epochs (share nothing);
* ``share-all``  FedAvg over every tensor;
* ``split``      FedAvg over the paper's shared modules (embeddings, char CNN, word CNN); each site keeps its
                 private Bi-LSTM, emission layer and CRF (``PAPER_PRIVATE_PATTERNS``), which never leave it.

Run: ``.venv/bin/python experiments/fedner_decomposition.py [--rounds 10] [--out experiments/out/fedner]``.
Prints a Markdown table (per-site and mean entity strict F1, relaxed F1) and writes ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import replace
from pathlib import Path

SMALL_DIMS = {"embedding_dim": 100, "char_dim": 30, "char_filters": 50, "word_filters": 100, "lstm_hidden": 100}
SITE_TYPES = {"site-A": ("DRUG",), "site-B": ("CONDITION",), "site-C": ("DRUG", "CONDITION")}


def annotated_as(examples, types):
    """The examples as a site annotating only ``types`` would hold them (other spans become O)."""
    return [replace(ex, entities=tuple(e for e in ex.entities if e.label in types)) for ex in examples]


def review_tokenizer(texts, min_count: int = 2) -> bytes:
    """A word-level tokenizer over the training reviews (lower-cased words seen ``min_count`` times), the
    role GloVe's vocabulary plays in the paper; unseen words are [UNK] and rely on the character CNN."""
    from collections import Counter

    from fedclinic.models import wordlevel_tokenizer_json

    counts = Counter(w for t in texts for w in re.findall(r"\w+|[^\w\s]", t.lower()))
    return wordlevel_tokenizer_json(sorted(w for w, c in counts.items() if c >= min_count))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--learning-rate", type=float, default=5e-3)
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dims", choices=("small", "paper"), default="small",
                    help="small: embedding 100, char CNN 30->50, word CNN 100, LSTM 100 (CPU-sized); paper: the "
                         "paper's 300/100->200/200/200")
    ap.add_argument("--test-reviews", type=int, default=379, help="evaluate on the first N test reviews")
    ap.add_argument("--out", default="experiments/out/fedner")
    args = ap.parse_args()

    import numpy as np

    from fedclinic.assets.silver_ner import NER_LABELS, silver_ner
    from fedclinic.models.fedner import PAPER_PRIVATE_PATTERNS
    from fedclinic.models.token_classification import package_ner_from_config
    from fedclinic.data.partition import iid
    from fedclinic.federation.simulate import simulate
    from fedclinic.training.trainer import TrainConfig

    train, test = silver_ner("train"), silver_ner("test")[:args.test_reviews]
    shards = iid(len(train), len(SITE_TYPES), args.seed)
    sites = {name: annotated_as([train[i] for i in idx], types) for (name, types), idx in zip(SITE_TYPES.items(), shards)}
    site_tests = [annotated_as(test, types) for types in SITE_TYPES.values()]
    tokenizer = review_tokenizer([ex.text for ex in train])
    dims = {} if args.dims == "paper" else SMALL_DIMS
    package = package_ner_from_config(labels=list(NER_LABELS), tokenizer_json=tokenizer, config=dims,
                                      architecture="cnn-bilstm-crf", max_length=args.max_length, seed=args.seed)
    cfg = TrainConfig(local_epochs=args.local_epochs, batch_size=16, learning_rate=args.learning_rate,
                      optimizer="adam", max_length=args.max_length, seed=args.seed)
    print(f"{len(train)} training reviews over {len(sites)} sites "
          + ", ".join(f"{n} ({'+'.join(SITE_TYPES[n])}: {sum(len(e.entities) for e in ex)} spans)"
                      for n, ex in sites.items())
          + f"; {len(test)} test reviews; {len(package.tensors)} tensors, "
          f"{sum(a.size for a in package.tensors.values()):,} parameters", flush=True)

    results: dict[str, dict] = {}
    names = list(sites)

    def record(config: str, per_site: list[dict]) -> None:
        results[config] = {"sites": {n: m for n, m in zip(names, per_site)},
                           "mean_strict_f1": float(np.mean([m["strict_f1"] for m in per_site])),
                           "mean_relaxed_f1": float(np.mean([m["relaxed_f1"] for m in per_site]))}
        print(f"{config}: " + ", ".join(f"{n} {m['strict_f1']:.3f}" for n, m in zip(names, per_site))
              + f"; mean strict F1 {results[config]['mean_strict_f1']:.3f}", flush=True)

    def site_metrics(run, k: int) -> dict:
        final = run.rounds[-1].metrics
        return {key: final[f"site-{k}/{key}"] for key in ("strict_f1", "relaxed_f1", "token_accuracy")}

    t0 = time.perf_counter()
    local = []
    for i, name in enumerate(names):
        run = simulate(package, [sites[name]], rounds=args.rounds, train=cfg, site_eval_data=[site_tests[i]],
                       seed=args.seed)
        local.append(site_metrics(run, 0))
    record("local", local)
    run = simulate(package, list(sites.values()), rounds=args.rounds, train=cfg, site_eval_data=site_tests,
                   seed=args.seed)
    record("share-all", [site_metrics(run, i) for i in range(len(names))])
    run = simulate(package, list(sites.values()), rounds=args.rounds, train=cfg, site_eval_data=site_tests,
                   private_patterns=PAPER_PRIVATE_PATTERNS, seed=args.seed)
    record("split", [site_metrics(run, i) for i in range(len(names))])
    seconds = time.perf_counter() - t0

    print("\n| configuration | " + " | ".join(f"{n} ({'+'.join(SITE_TYPES[n])})" for n in names)
          + " | mean strict F1 | mean relaxed F1 |")
    print("|---" * (len(names) + 3) + "|")
    for config, r in results.items():
        print(f"| {config} | " + " | ".join(f"{r['sites'][n]['strict_f1']:.3f}" for n in names)
              + f" | {r['mean_strict_f1']:.3f} | {r['mean_relaxed_f1']:.3f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"args": vars(args), "seconds": seconds, "results": results},
                                                 indent=2) + "\n")
    print(f"\n{seconds:.0f} s; results in {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
