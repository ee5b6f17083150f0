"""IU-CXR (CS59-2) reproduction: dynamic weighting by update magnitude vs sample-weighted FedAvg (issue #4).

**The data is a stand-in, not chest X-rays**: :mod:`fedclinic.assets.imaging_standin` (augmented CT/MR slices
from pydicom's bundled test files with template reports; labels ``ct``/``mr``/``marker``). No chest X-ray set is
available offline. Numbers here say how the aggregation rules compare on a small multi-label image + text task,
not how a model reads X-rays.

Setting (every algorithm gets the same data, model initialisation and per-site training seeds):

* 3 sites; their examples are split non-IID by a Dirichlet label skew over the label combinations
  (``ct``, ``ct+marker``, ``mr``, ``mr+marker``), so site sizes and label mixes differ; each site keeps 20 % of
  its examples as its own validation split (the notebook's per-client 80/20 split);
* a held-out test set drawn with another seed (no site trains on it);
* the image-text family (ResNet branch + BiLSTM text branch, late fusion, sigmoid per label), sized for a CPU;
* Adam lr 1e-3, batch 8, no clipping (the notebook's Keras settings), fresh optimizer every round.

Algorithms: ``fedavg`` (w <- w + sum n_k d_k / sum n_k), ``dynamic-report`` (the report's c_k = sum of
per-tensor L2 norms of the delta), ``dynamic-code`` (the notebook's gradient change rate, measured by each site).

Evaluated after every round:

* the **global** model on the held-out test set (``test/...``) and on the pooled site validation splits
  (``val/...``, what the notebook computed but the report did not show);
* each **client** model (after local training, before aggregation) on its own validation split, averaged over
  the sites without weights (``client/...``): the report's protocol (its Figs. 7.1-7.3 and table).

Run: ``.venv/bin/python experiments/iucxr_dynamic.py`` (defaults = the study in docs/results/iucxr.md).
Writes ``OUT/results.json`` (per run, per round: every metric and each site's aggregation weight) and, with
``--plots DIR``, ``iucxr-*.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from strategy_probe import RecordingStrategy, registered

MODEL = {"image_size": 64, "resnet_embedding_size": 16, "resnet_hidden_sizes": [16, 32, 64], "resnet_depths": [1, 1, 1],
         "resnet_layer_type": "basic", "embedding_dim": 32, "lstm_hidden": 32, "branch_hidden": 32, "branch_dim": 16,
         "fusion_hidden": 32, "dropout": 0.5}
ALGORITHMS = {
    "fedavg": ("fedavg", {}, False),
    "dynamic-report": ("dynamic-weighting", {"definition": "report"}, False),
    "dynamic-code": ("dynamic-weighting", {"definition": "code"}, True),
}
PROBE = "iucxr-recording"


def combo(labels) -> str:
    return "+".join(labels)


def weighted_f1(metrics: Mapping[str, float], support: Mapping[str, int], prefix: str = "") -> float:
    """sum_j support_j F1_j / sum_j support_j (the notebook's sklearn ``average='weighted'``)."""
    total = sum(support.values())
    return sum(support[lab] * metrics[f"{prefix}f1/{lab}"] for lab in support) / total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--local-epochs", type=int, default=2)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--train-examples", type=int, default=480, help="examples over all sites (before the 80/20 split)")
    ap.add_argument("--test-examples", type=int, default=300)
    ap.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration of the label skew")
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--learning-rate", type=float, default=1e-3)
    ap.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    ap.add_argument("--out", default="experiments/out/iucxr")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    ap.add_argument("--verbose", action="store_true", help="print every round's wall time")
    ap.add_argument("--plots", help="folder for the PNG plots (e.g. docs/results/img)")
    args = ap.parse_args()

    import torch

    from fedclinic.data.text import read_dataset
    from fedclinic.assets.imaging_standin import STANDIN_LABELS, standin_tokenizer_json, write_standin
    from fedclinic.models import build_model, load_tensors
    from fedclinic.models.image_text import FAMILY, package_image_text_from_config
    from fedclinic.data.partition import dirichlet_label_skew
    from fedclinic.federation.simulate import simulate
    from fedclinic.strategies import make_strategy
    from fedclinic.training.trainer import TrainConfig, encode, evaluate

    torch.set_num_threads(args.threads)
    labels = list(STANDIN_LABELS)
    started = time.perf_counter()
    results: dict[str, Any] = {"args": vars(args), "model": MODEL, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="iucxr-standin-") as tmp:
        for seed in args.seeds:
            folder = Path(tmp) / f"s{seed}"
            train_manifest = write_standin(folder, n=args.train_examples, seed=1000 + seed, name="train")
            test_manifest = write_standin(folder, n=args.test_examples, seed=2000 + seed, name="test")
            pool = read_dataset(FAMILY, train_manifest, label_set=labels, label_field="labels")
            test = read_dataset(FAMILY, test_manifest, label_set=labels, label_field="labels")
            shards = dirichlet_label_skew([combo(ex.labels) for ex in pool], args.sites, args.alpha, seed,
                                          min_per_site=20)
            rng = np.random.default_rng(seed)
            site_train, site_val = [], []
            for idx in shards:
                idx = list(rng.permutation(idx))
                n_val = max(4, len(idx) // 5)
                site_val.append([pool[i] for i in idx[:n_val]])
                site_train.append([pool[i] for i in idx[n_val:]])
            pooled_val = [ex for v in site_val for ex in v]
            mix = [{c: sum(1 for ex in rows if combo(ex.labels) == c) for c in ("ct", "ct+marker", "mr", "mr+marker")}
                   for rows in site_train]
            support = {lab: sum(1 for ex in test if lab in ex.labels) for lab in labels}
            val_support = {lab: sum(1 for ex in pooled_val if lab in ex.labels) for lab in labels}
            site_support = [{lab: sum(1 for ex in v if lab in ex.labels) for lab in labels} for v in site_val]
            print(f"seed {seed}: sites " + "; ".join(f"site-{k} {len(t)} train / {len(v)} val {m}" for k, (t, v, m)
                                                      in enumerate(zip(site_train, site_val, mix)))
                  + f"; test {len(test)} {support}", flush=True)
            package = package_image_text_from_config(labels=labels, tokenizer_json=standin_tokenizer_json(),
                                                     config=MODEL, max_length=16, seed=seed)
            probe_model = build_model(package)
            val_encoded = [encode(v, probe_model) for v in site_val]
            for algo in args.algorithms:
                strategy, params, measure = ALGORITHMS[algo]

                def client_model(site: str, tensors: dict, update: Mapping[str, Any]) -> dict:
                    load_tensors(probe_model.module, tensors)
                    m = evaluate(probe_model, val_encoded[int(site.split("-")[1])])
                    norms = {n: float(np.linalg.norm(d)) for n, d in update.items()}
                    m["bn_stat_share"] = sum(v for n, v in norms.items() if ".running_" in n) / sum(norms.values())
                    return m

                recorders: list[RecordingStrategy] = []

                def factory(**p) -> RecordingStrategy:
                    recorders.append(RecordingStrategy(make_strategy(strategy, p), on_update=client_model))
                    return recorders[-1]

                cfg = TrainConfig(local_epochs=args.local_epochs, batch_size=8, learning_rate=args.learning_rate,
                                  optimizer="adam", max_grad_norm=0.0, measure_gradient_change=measure, max_length=16,
                                  seed=seed, device="cpu")
                t0 = time.perf_counter()
                with registered(PROBE, factory):
                    run = simulate(package, site_train, rounds=args.rounds, train=cfg, strategy=PROBE,
                                   strategy_params=params, eval_data={"test": test, "val": pooled_val}, seed=seed,
                                   progress=lambda rec: print(f"    round {rec.round}: {rec.seconds:.1f} s", flush=True)
                                   if args.verbose else None)
                log = recorders[0].rounds
                seconds = time.perf_counter() - t0
                rounds = []
                for r, rec in enumerate(run.rounds):
                    m = dict(rec.metrics)
                    clients = log[r]["clients"]
                    keys = [k for k in next(iter(clients.values())) if k != "n"]
                    m.update({f"client/{k}": float(np.nanmean([c[k] for c in clients.values()])) for k in keys})
                    m["client/weighted_f1"] = float(np.mean([weighted_f1(c, site_support[int(s[5:])])
                                                             for s, c in clients.items()]))
                    m["test/weighted_f1"] = weighted_f1(m, support, "test/")
                    m["val/weighted_f1"] = weighted_f1(m, val_support, "val/")
                    rounds.append({"round": rec.round, "seconds": rec.seconds, "omega": log[r]["omega"], **m})
                init = dict(run.initial_metrics)
                load_tensors(probe_model.module, package.tensors)  # round 0: the untrained model at every site
                first = [evaluate(probe_model, v) for v in val_encoded]
                init.update({f"client/{k}": float(np.nanmean([c[k] for c in first])) for k in first[0] if k != "n"})
                init["test/weighted_f1"] = weighted_f1(init, support, "test/")
                results["runs"][f"{algo}__seed{seed}"] = {
                    "algorithm": algo, "seed": seed, "seconds": seconds, "initial": init, "rounds": rounds,
                    "sites": [{"train": len(t), "val": len(v), "mix": m} for t, v, m in zip(site_train, site_val, mix)]}
                last = rounds[-1]
                print(f"  {algo} seed {seed} ({seconds:.0f} s): global test macro F1 {last['test/macro_f1']:.3f} AUC "
                      f"{last['test/macro_auc']:.3f} loss {last['test/loss']:.3f}; client-model macro F1 "
                      f"{last['client/macro_f1']:.3f}; omega {[round(v, 3) for v in last['omega'].values()]}",
                      flush=True)
    results["seconds"] = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(summary_table(results, labels))
    if args.plots:
        for path in plot(results, labels, Path(args.plots)):
            print(f"wrote {path}")
    print(f"\n{results['seconds']:.0f} s in all; results in {out / 'results.json'}")
    return 0


def _mean_std(xs: list[float]) -> str:
    xs = [x for x in xs if not math.isnan(x)]
    m = float(np.mean(xs))
    s = float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0
    return f"{m:.3f} ± {s:.3f}"


def summary_table(results: Mapping[str, Any], labels: list[str]) -> str:
    """Markdown: final-round metrics per algorithm, mean ± std over seeds."""
    algos = list(dict.fromkeys(r["algorithm"] for r in results["runs"].values()))
    cols = ([("test/macro_f1", "global macro F1"), ("test/macro_auc", "global macro AUC"),
             ("test/weighted_f1", "global weighted F1"), ("test/label_accuracy", "global label acc."),
             ("test/loss", "global loss")]
            + [(f"test/f1/{lab}", f"F1 {lab}") for lab in labels]
            + [(f"test/auc/{lab}", f"AUC {lab}") for lab in labels]
            + [("client/macro_f1", "client macro F1"), ("client/weighted_f1", "client weighted F1"),
               ("client/label_accuracy", "client label acc."), ("client/loss", "client loss")])
    lines = ["| algorithm | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for a in algos:
        runs = [r for r in results["runs"].values() if r["algorithm"] == a]
        lines.append(f"| {a} | " + " | ".join(_mean_std([r["rounds"][-1][k] for r in runs]) for k, _ in cols) + " |")
    return "\n".join(lines)


def plot(results: Mapping[str, Any], labels: list[str], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    algos = list(dict.fromkeys(r["algorithm"] for r in results["runs"].values()))
    written = []
    panels = [("test/macro_f1", "global model: test macro F1"), ("test/macro_auc", "global model: test macro AUC"),
              ("test/loss", "global model: test loss (BCE)"),
              ("client/macro_f1", "client models: own-val macro F1 (report's protocol)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (key, title) in zip(axes, panels):
        for a in algos:
            runs = [r for r in results["runs"].values() if r["algorithm"] == a]
            xs = [0] + [x["round"] for x in runs[0]["rounds"]]
            vals = np.array([[r["initial"].get(key, np.nan)] + [x[key] for x in r["rounds"]] for r in runs])
            mean = np.nanmean(vals, axis=0)
            line, = ax.plot(xs, mean, label=a, linewidth=1.3)
            ax.fill_between(xs, np.nanmin(vals, axis=0), np.nanmax(vals, axis=0), color=line.get_color(), alpha=0.15)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("STAND-IN data (CT/MR slices + template reports, NOT chest X-rays): mean over seeds, band = min..max",
                 fontsize=9)
    fig.tight_layout()
    path = folder / "iucxr-curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    fig, axes = plt.subplots(1, len(algos), figsize=(5 * len(algos), 3.6), sharey=True)
    for ax, a in zip(np.atleast_1d(axes), algos):
        run = next(r for r in results["runs"].values() if r["algorithm"] == a)
        sites = list(run["rounds"][0]["omega"])
        for s in sites:
            ax.plot([x["round"] for x in run["rounds"]], [x["omega"][s] for x in run["rounds"]], marker="o", ms=3,
                    label=f"{s} (n={run['sites'][int(s[5:])]['train']})")
        ax.set_title(f"{a}: aggregation weight per site (seed {run['seed']})", fontsize=9)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = folder / "iucxr-weights.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


if __name__ == "__main__":
    raise SystemExit(main())
