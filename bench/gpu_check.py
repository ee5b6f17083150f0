"""GPU check (issue 21 item 5): every model family trained for one local round on a GPU, against the CPU path.

Each family's round runs through the one implementation of a site's round,
:func:`fedclinic.federation.site_round.run_site_round` (the trainer :func:`fedclinic.training.trainer.train_local`;
DP-SGD through :func:`fedclinic.privacy.dp_sgd.train_local_private`), on synthetic data made here, in these rows:

``cpu``   the CPU path: float32 on the CPU (the baseline of the ``vs cpu`` column)
``fp32``  the accelerator, float32 (the baseline of the ``vs fp32`` column)
``bf16``  bf16 autocast (``TrainConfig(mixed_precision=True, autocast_dtype="bf16")``)
``fp16``  fp16 autocast with loss scaling (``autocast_dtype="fp16"``, torch's GradScaler)
``dp``    DP-SGD (sigma 1, C 1, Poisson rate batch/n), float32: ghost clipping for text and feature classification;
          for the other families the exact mode ``auto`` picks (Opacus' hooks, or each example alone: ``loop``)

Families (random-initialised models of realistic size; the installed MiniLM-L6 where ``fedclinic.assets`` has it):
text classification (MiniLM-L6: 6 x 384), token classification with a CRF (BERT-base shape: 12 x 768) and FedNER
(CNN-BiLSTM-CRF, paper defaults), question answering (a causal LM of SmolLM2-135M's shape: 30 x 576, vocabulary
49152), image + text (ResNet-50-shaped, 224 x 224, with a BiLSTM report branch) and feature classification
(logistic regression over 1024 features). Sequences are 128 tokens.

Per row: each round has a warm-up round first (kernels, cuBLAS/cuDNN plans), then a timed round of a fixed number
of optimiser steps. ``train ex/s`` is the steady state: the examples of steps 2..S over the time between the end
of step 1 and the end of step S, read from the round's progress callback (as the agent reports progress; the
trainer synchronises the device there). ``round s`` is the whole ``run_site_round`` call (training, the update's
delta and its encoding). ``tok/s`` = train ex/s x mean tokens per example (text families). ``peak GiB`` is
``torch.cuda.max_memory_allocated`` over the timed round (the model's weights included). Ratios are against the
``cpu`` and ``fp32`` rows of the same run. Multi-GPU (DDP) runs through the site's distributed launcher and is
reported by :func:`measure_ddp` (not measured here yet).

Usage::

    python bench/gpu_check.py [--json gpu.json]        # on a CUDA machine; without CUDA it says so and exits 0
    python bench/gpu_check.py --device cpu --smoke     # the same code path on the CPU, tiny models, few steps

Ends with ``RESULT gpu_check families=N ... target=every family trains on GPU in fp32/bf16/fp16 and DP met=yes|no``.
Exit status: 0 (also without CUDA), 2 when a package it needs is missing.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT, ROOT / "sdk"):  # run from a plain checkout: `python3 bench/gpu_check.py`
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

#: import name -> pip name of what this check imports (the repo's own training path included)
REQUIRED = {"torch": "torch", "transformers": "transformers", "tokenizers": "tokenizers", "numpy": "numpy",
            "opacus": "opacus", "safetensors": "safetensors", "scipy": "scipy", "google.protobuf": "protobuf",
            "grpc": "grpcio", "cryptography": "cryptography"}
MODES = ("fp32", "bf16", "fp16", "dp", "cpu")
ACCEL_MODES = MODES[:4]
TARGET = "every family trains on GPU in fp32/bf16/fp16 and DP"
LABELS = ["a", "b", "c", "d"]
SEQ = 128


def say(msg: str) -> None:
    print(f"[gpu_check] {msg}", flush=True)


def missing_packages() -> list[str]:
    """The pip names of :data:`REQUIRED` packages that cannot be imported here."""
    out = []
    for mod, pip in REQUIRED.items():
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(pip)
    return out


# ------------------------------------------------------------------------------------------------------------
# workloads: one model and its synthetic data per family


@dataclass
class Workload:
    family: str
    describe: str
    loaded: Any
    data: Any
    trainable: list[str]
    batch: int
    tokens_per_example: float | None = None  # None: no tokens (features, images)
    params: int = 0


def _tok(words: int, extra: tuple[str, ...] = ()) -> bytes:
    from fedclinic.models import wordlevel_tokenizer_json

    return wordlevel_tokenizer_json([*extra, *(f"w{i}" for i in range(words))])


def _texts(rng, n: int, words: int, length: int) -> list[str]:
    return [" ".join(f"w{j}" for j in rng.integers(0, words, size=length)) for _ in range(n)]


def _finish(family: str, describe: str, loaded, data, batch: int, tokens: bool) -> Workload:
    names = [n for n, p in loaded.module.named_parameters()]
    tpe = float(data.attention_mask.sum()) / len(data) if tokens else None
    params = sum(p.numel() for p in loaded.module.parameters())
    return Workload(family, f"{describe}, {params / 1e6:.1f} M params", loaded, data, names, batch, tpe, params)


def text_classification(steps: int, smoke: bool, rng) -> Workload:
    from fedclinic.data.text import Example
    from fedclinic.errors import ConfigError
    from fedclinic.models import build_model, package_from_config, package_pretrained
    from fedclinic.training.trainer import encode

    seq, batch = (32, 8) if smoke else (SEQ, 32)
    n = batch * steps
    pkg, what = None, "tiny BERT (2 x 32)"
    if not smoke:
        try:
            from fedclinic.assets.drugreview import minilm_path

            pkg, what = package_pretrained(minilm_path(), labels=LABELS, max_length=seq), "MiniLM-L6 (installed asset)"
        except ConfigError:
            what = "MiniLM-L6 shape, random init (asset not installed)"
    if pkg is None:
        shape = (dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64) if smoke else
                 dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536))
        pkg = package_from_config(architecture="transformer", labels=LABELS, tokenizer_json=_tok(200 if smoke else 30518),
                                  config={"model_type": "bert", "max_position_embeddings": 512, **shape},
                                  max_length=seq)
    loaded = build_model(pkg)
    words = 200 if smoke else 20000
    examples = [Example(t, (LABELS[i % 4],)) for i, t in enumerate(_texts(rng, n, words, 2 * seq))]
    return _finish("text-classification", what, loaded, encode(examples, loaded, max_length=seq), batch, True)


def _ner(steps: int, smoke: bool, rng, architecture: str, config: dict, describe: str) -> Workload:
    from fedclinic.data.ner import EntitySpan, NerExample
    from fedclinic.models import build_model
    from fedclinic.models.token_classification import package_ner_from_config
    from fedclinic.training.trainer import encode

    seq, words, batch = (32, 200, 8) if smoke else (SEQ, 30518, 32)
    n = batch * steps
    pkg = package_ner_from_config(labels=["DRUG", "CONDITION"], tokenizer_json=_tok(words), config=config,
                                  architecture=architecture, max_length=seq)
    loaded = build_model(pkg)
    examples = []
    for text in _texts(rng, n, words, seq):
        first = text.split(" ", 1)[0]
        examples.append(NerExample(text, (EntitySpan(0, len(first), "DRUG"),)))
    return _finish(f"token-classification/{architecture}", describe, loaded, encode(examples, loaded, max_length=seq),
                   batch, True)


def token_crf(steps: int, smoke: bool, rng) -> Workload:
    shape = (dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64) if smoke else
             dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072))
    return _ner(steps, smoke, rng, "transformer-crf", {"model_type": "bert", "max_position_embeddings": 512, **shape},
                "tiny BERT + CRF" if smoke else "BERT-base shape + CRF, random init")


def fedner(steps: int, smoke: bool, rng) -> Workload:
    tiny = {"embedding_dim": 16, "char_dim": 8, "char_filters": 16, "word_filters": 16, "lstm_hidden": 16}
    return _ner(steps, smoke, rng, "cnn-bilstm-crf", tiny if smoke else {},
                "tiny FedNER" if smoke else "FedNER CNN-BiLSTM-CRF (paper defaults), random init")


def question_answering(steps: int, smoke: bool, rng) -> Workload:
    from fedclinic.data.qa import QAExample
    from fedclinic.models import build_model
    from fedclinic.models.causal_lm import package_qa_from_config
    from fedclinic.training.trainer import encode

    seq, words, batch = (32, 200, 8) if smoke else (SEQ, 49147, 16)
    n = batch * steps
    shape = (dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1) if smoke else
             dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, rope_theta=100000.0, rms_norm_eps=1e-5))
    pkg = package_qa_from_config(tokenizer_json=_tok(words, ("<eos>",)), max_length=seq,
                                 config={"model_type": "llama", "max_position_embeddings": 2048,
                                         "tie_word_embeddings": True, **shape})
    loaded = build_model(pkg)
    qs, answers = _texts(rng, n, words, seq), _texts(rng, n, words, seq // 4)
    examples = [QAExample(q, a) for q, a in zip(qs, answers)]
    return _finish("question-answering", "tiny Llama" if smoke else "SmolLM2-135M shape (Llama), random init",
                   loaded, encode(examples, loaded, max_length=seq), batch, True)


def image_text(steps: int, smoke: bool, rng) -> Workload:
    import torch

    from fedclinic.models import build_model
    from fedclinic.models.base import encode_texts
    from fedclinic.models.image_text import ImageTextData, package_image_text_from_config

    tiny = {"image_size": 32, "resnet_embedding_size": 8, "resnet_hidden_sizes": [8, 16], "resnet_depths": [1, 1],
            "resnet_layer_type": "basic", "embedding_dim": 16, "lstm_hidden": 16, "branch_hidden": 16,
            "branch_dim": 8, "fusion_hidden": 16}
    seq, batch = (16, 8) if smoke else (64, 32)
    n = batch * steps
    pkg = package_image_text_from_config(labels=LABELS, tokenizer_json=_tok(2000), config=tiny if smoke else {},
                                         max_length=seq)
    loaded = build_model(pkg)
    ids, mask = encode_texts(loaded.tokenizer, _texts(rng, n, 2000, seq), max_length=seq, pad_id=loaded.pad_id)
    size = loaded.image_size
    data = ImageTextData(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                         labels=torch.from_numpy((rng.random((n, len(LABELS))) < 0.3).astype("float32")),
                         multi_label=True, num_labels=len(LABELS),
                         pixel_values=torch.from_numpy(rng.standard_normal((n, 1, size, size), dtype="float32")))
    return _finish("image-text-classification", f"ResNet + BiLSTM, {size} x {size} images, random init", loaded, data,
                   batch, False)


def feature_classification(steps: int, smoke: bool, rng) -> Workload:
    from fedclinic.models import build_model
    from fedclinic.models.feature_classification import encode_features, package_feature_model

    width, batch = (16, 8) if smoke else (1024, 256)
    n = batch * steps
    loaded = build_model(package_feature_model(num_features=width, labels=LABELS))
    data = encode_features(rng.standard_normal((n, width)).astype("float32"), rng.integers(0, 4, size=n), loaded)
    return _finish("feature-classification", f"logistic regression over {width} features", loaded, data, batch, False)


FAMILIES: dict[str, Callable[[int, bool, Any], Workload]] = {
    "text-classification": text_classification, "token-classification/transformer-crf": token_crf,
    "token-classification/cnn-bilstm-crf": fedner, "question-answering": question_answering,
    "image-text-classification": image_text, "feature-classification": feature_classification}


# ------------------------------------------------------------------------------------------------------------
# one row: a warm-up round and a timed round through run_site_round


@dataclass
class Steps:
    warm: int
    timed: int


def plan(smoke: bool, mode: str) -> Steps:
    """Warm-up and timed optimiser steps of a row (small on the CPU and for DP-SGD, whose steps cost more)."""
    if smoke:
        return Steps(0, 2)  # no warm-up round: a check of the code path, not a measurement
    return {"cpu": Steps(1, 3), "dp": Steps(1, 4)}.get(mode, Steps(3, 20))


@dataclass
class Row:
    family: str
    mode: str
    device: str
    status: str = "ok"
    steps: int = 0
    batch: int = 0
    train_ex_s: float | None = None
    tokens_s: float | None = None
    round_s: float | None = None
    peak_gib: float | None = None
    dp_mode: str | None = None
    vs_cpu: float | None = None
    vs_fp32: float | None = None
    extra: dict = field(default_factory=dict)


def _dp_mode(w: Workload) -> str:
    """The exact DP-SGD mode ``auto`` picks for this model (ghost, hooks or loop)."""
    from fedclinic.privacy import dp_sgd
    from fedclinic.privacy.ghost import unsupported_parameters

    params = [p for n, p in w.loaded.module.named_parameters() if n in set(w.trainable)]
    return dp_sgd._run_class("auto", w.loaded, unsupported_parameters(w.loaded.module, params)).__name__.strip(
        "_").removesuffix("Run").lower().replace("opacus", "hooks")


def _round(w: Workload, mode: str, device: str, steps: int, progress) -> Any:
    from fedclinic.federation.site_round import SiteRoundInput, run_site_round
    from fedclinic.privacy.dp_sgd import DPSGD
    from fedclinic.training.trainer import TrainConfig

    dev = "cpu" if mode == "cpu" else device
    mixed = mode in ("bf16", "fp16")
    cfg = TrainConfig(batch_size=w.batch, learning_rate=1e-5, max_steps=steps, mixed_precision=mixed,
                      autocast_dtype=mode if mixed else "auto", device=dev)
    dp = DPSGD(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=w.batch / len(w.data), steps=steps) \
        if mode == "dp" else None
    inp = SiteRoundInput(task_id="gpu-check", site="site-0", round=1, send=w.trainable, train=cfg, dp=dp,
                         progress=progress)
    return run_site_round(w.loaded, w.data, inp)


def measure(w: Workload, mode: str, device: str, smoke: bool) -> Row:
    """One row: a warm-up round, then a timed round (see the module docstring for the figures)."""
    import torch

    dev = "cpu" if mode == "cpu" else device
    row = Row(w.family, mode, dev, batch=w.batch)
    steps = plan(smoke, mode)
    cuda = dev.startswith("cuda")
    if mode == "dp":
        row.dp_mode = _dp_mode(w)
    if steps.warm:
        _round(w, mode, device, steps.warm, None)
    stamps: list[float] = []

    def progress(step: int, total: int, loss: float) -> None:
        if cuda:
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = _round(w, mode, device, steps.timed, progress)
    if cuda:
        torch.cuda.synchronize()
    row.round_s = time.perf_counter() - t0
    row.steps = result.train.steps
    if len(stamps) >= 2 and stamps[-1] > stamps[0]:
        row.train_ex_s = (len(stamps) - 1) * w.batch / (stamps[-1] - stamps[0])
        if w.tokens_per_example is not None:
            row.tokens_s = row.train_ex_s * w.tokens_per_example
    if cuda:
        row.peak_gib = torch.cuda.max_memory_allocated() / 2**30
    row.extra["loss"] = result.train.loss
    return row


def measure_ddp(gpu_count: int) -> dict[str, Any]:
    """The multi-GPU (DDP) row: distributed training at a site (issue 21 item 1) runs through the site's
    distributed launcher, which this check does not drive yet; returns a ``not measured: <reason>`` record."""
    return {"mode": "ddp", "gpus": gpu_count,
            "status": "not measured: multi-GPU training runs through the site's distributed launcher "
                      "(issue 21 item 1), not wired into this check yet"}


# ------------------------------------------------------------------------------------------------------------
# the run


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _line(r: Row) -> str:
    if r.status != "ok":
        return f"{r.family:38s} {r.mode:5s} {r.device:7s} {r.status}"
    dp = f" ({r.dp_mode})" if r.dp_mode else ""
    return (f"{r.family:38s} {r.mode:5s} {r.device:7s} {_fmt(r.train_ex_s):>10s} {_fmt(r.tokens_s, '.0f'):>10s} "
            f"{_fmt(r.vs_cpu, '.2f'):>7s} {_fmt(r.vs_fp32, '.2f'):>7s} {_fmt(r.round_s, '.2f'):>8s} "
            f"{_fmt(r.peak_gib, '.2f'):>8s}{dp}")


HEADER = (f"{'family':38s} {'mode':5s} {'device':7s} {'ex/s':>10s} {'tok/s':>10s} {'vs cpu':>7s} {'vs fp32':>7s} "
          f"{'round s':>8s} {'peak GiB':>8s}")


def _geomean(values: list[float]) -> float | None:
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def run(device: str, smoke: bool, families: list[str], budget_s: float, json_path: str | None) -> int:
    import numpy as np
    import torch

    started = time.perf_counter()
    report: dict[str, Any] = {"torch": torch.__version__, "device": device, "smoke": smoke,
                              "cpu_threads": torch.get_num_threads(), "rows": [], "workloads": {}}
    if device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(0)
        report["bf16_supported"] = torch.cuda.is_bf16_supported()
    say(f"torch {torch.__version__}, device {device}{' (' + report.get('gpu', '') + ')' if 'gpu' in report else ''}, "
        f"{torch.get_num_threads()} CPU threads, {'smoke' if smoke else 'full'} run")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    report["ddp"] = measure_ddp(gpus)
    say(f"{gpus} GPU(s) visible; the multi-GPU (DDP) measurement runs through the site's distributed launcher: "
        f"{report['ddp']['status']}")

    def save() -> None:
        if json_path:
            Path(json_path).write_text(json.dumps(report, indent=2))

    rows: list[Row] = []
    for name in families:
        if time.perf_counter() - started > budget_s:
            rows += [Row(name, m, device, status="skipped: time budget spent") for m in MODES]
            continue
        longest = max(max(plan(smoke, m).warm, plan(smoke, m).timed) for m in MODES)
        try:
            t = time.perf_counter()
            w = FAMILIES[name](longest, smoke, np.random.default_rng(0))
            say(f"{name}: {w.describe}; batch {w.batch}, {len(w.data)} examples"
                + (f", {w.tokens_per_example:.0f} tokens/example" if w.tokens_per_example else "")
                + f" (built in {time.perf_counter() - t:.1f} s)")
            report["workloads"][name] = {"model": w.describe, "params": w.params, "batch": w.batch,
                                         "tokens_per_example": w.tokens_per_example}
        except Exception as exc:  # noqa: BLE001 - a family that cannot be built is reported, the others still run
            rows += [Row(name, m, device, status=f"error building: {type(exc).__name__}: {exc}") for m in MODES]
            say(f"{name}: could not be built: {type(exc).__name__}: {exc}")
            continue
        fam_rows: dict[str, Row] = {}
        for mode in MODES:
            if time.perf_counter() - started > budget_s:
                fam_rows[mode] = Row(name, mode, device, status="skipped: time budget spent")
                continue
            try:
                fam_rows[mode] = measure(w, mode, device, smoke)
            except Exception as exc:  # noqa: BLE001 - one failing row is reported; the others still run
                fam_rows[mode] = Row(name, mode, device, status=f"error: {type(exc).__name__}: {str(exc)[:300]}")
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()
            say(_line(fam_rows[mode]))
        for r in fam_rows.values():
            for base, attr in (("cpu", "vs_cpu"), ("fp32", "vs_fp32")):
                b = fam_rows.get(base)
                if r.train_ex_s and b is not None and b.train_ex_s:
                    setattr(r, attr, r.train_ex_s / b.train_ex_s)
        rows += list(fam_rows.values())
        report["rows"] = [vars(r) for r in rows]
        save()
        del w
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()

    print(HEADER)
    for r in rows:
        print(_line(r))
    ok_families = [f for f in families if all(any(r.family == f and r.mode == m and r.status == "ok" for r in rows)
                                              for m in ACCEL_MODES)]
    vs_cpu = _geomean([r.vs_cpu for r in rows if r.mode == "bf16" and r.vs_cpu])
    vs_fp32 = _geomean([r.vs_fp32 for r in rows if r.mode == "bf16" and r.vs_fp32])
    met = device.startswith("cuda") and len(ok_families) == len(FAMILIES)
    report["rows"] = [vars(r) for r in rows]
    report["result"] = {"families": len(ok_families), "gpu_bf16_speedup_vs_cpu": vs_cpu,
                        "gpu_bf16_speedup_vs_fp32": vs_fp32, "met": met,
                        "seconds": time.perf_counter() - started}
    save()
    say(f"done in {time.perf_counter() - started:.0f} s")
    print(f"RESULT gpu_check families={len(ok_families)} device={device.split(':')[0]} "
          f"gpu_bf16_speedup_vs_cpu={_fmt(vs_cpu, '.2f')}x gpu_bf16_speedup_vs_fp32={_fmt(vs_fp32, '.2f')}x "
          f"target={TARGET} met={'yes' if met else 'no'}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="the accelerator rows' device: cuda (default), cuda:N, or cpu "
                                                    "(the CPU stands in for the GPU: a check of this script)")
    p.add_argument("--smoke", action="store_true", help="tiny models, 2 steps per row and no warm-up round")
    p.add_argument("--family", action="append", choices=sorted(FAMILIES), help="only these families (repeatable)")
    p.add_argument("--budget-s", type=float, default=360.0,
                   help="stop starting new rows after this many seconds (default 360); skipped rows say so")
    p.add_argument("--json", help="write every figure to this JSON file (rewritten after each family)")
    args = p.parse_args(argv)
    missing = missing_packages()
    if missing:
        say(f"missing Python packages: {', '.join(missing)}; install them (versions in constraints.txt), e.g. "
            f"pip install -c constraints.txt {' '.join(missing)}")
        if "torch" in missing:
            say("torch is not installed: no CUDA check is possible here")
        print(f"RESULT gpu_check families=0 missing={','.join(missing)} target={TARGET} met=no", flush=True)
        return 2
    import torch

    if args.device != "cpu":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            say(f"no CUDA: torch {torch.__version__} ({build}) sees no GPU here, so nothing was measured; "
                "run this on a CUDA machine, or `--device cpu --smoke` to check the script on the CPU")
            print(f"RESULT gpu_check families=0 cuda=no target={TARGET} met=no", flush=True)
            return 0
        from fedclinic.training.trainer import select_device

        select_device(args.device)  # a clear error for cuda:N beyond the visible GPUs
    return run(args.device, args.smoke, args.family or list(FAMILIES), args.budget_s, args.json)


if __name__ == "__main__":
    sys.exit(main())
