"""The local trainer shared by the hospital agent and the simulator (one implementation of a round's work).

Flow of one round at a site::

    data = encode(examples, loaded, max_length=cfg.max_length)       # once per task; kept warm
    before = module_tensors(loaded.module, names)                       # the global weights
    result = train_local(loaded, data, cfg, trainable=names)
    delta = compute_delta(before, module_tensors(loaded.module, names), names)

Objective per mini-batch B (mean over its examples)::

    single-label:  L = CE(logits, y)                        (softmax cross-entropy)
    multi-label:   L = BCEWithLogits(logits, y_multi_hot)   (mean over examples and labels; with ``pos_weight``
                   w_c, each positive's term of label c is multiplied by w_c: -[w_c y log s(z) + (1-y) log(1-s(z))])
    FedProx:       L + mu/2 * sum_{p trainable} ||p - p_round_start||^2   (added to the gradient as mu (p - p_0))

Only tensors named in ``trainable`` get gradients. The optimiser (:mod:`fedclinic.training.optimizers`) is created
fresh each call; with ``optimizer_state = "keep"`` its moments are carried over from the previous round.
Batches are trimmed to their longest sequence, so short texts cost less.
Randomness (shuffling, dropout) is seeded from ``cfg.seed`` inside a forked RNG, so the caller's global
RNG state is left as it was. Inside a data-parallel group (:mod:`fedclinic.training.data_parallel`, several
processes) each rank trains its shard of every global batch and the gradients are summed with weights that make
them the global batch's mean gradient: the same steps as one process.
"""

from __future__ import annotations

import contextlib
import math
import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Callable, Collection, Iterable, Mapping, MutableMapping, Sequence

import numpy as np

from fedclinic.evaluation.multilabel import multilabel_evaluation
from fedclinic.models.base import EncodedData, encode_texts
from fedclinic.runtime.array_blocks import flat_blocks
from fedclinic.training import data_parallel, eager_optimizers
from fedclinic.training.fused_step import BackwardStepper, fused_conflicts
from fedclinic.training.optimizers import OPTIMIZERS, add_proximal_gradient, check_optimizer_settings, make_optimizer
from fedclinic.training.precision import autocast_for, check_autocast_dtype
from fedclinic.spec.capabilities import step_in_backward_problems
from fedclinic.spec.selection import select_names
from fedclinic.errors import ConfigError, DatasetError, IntegrityError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from fedclinic.data.text import Example
    from fedclinic.models import LoadedModel


@dataclass
class TrainConfig:
    """Local training settings for one round at one site."""

    local_epochs: int = 1
    batch_size: int = 16
    learning_rate: float = 5e-5
    optimizer: str = "adamw"         # see fedclinic.training.optimizers: adamw, adam, sgd, self_adam, padam
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0       # 0 = no clipping
    max_steps: int = 0               # 0 = no cap on optimiser steps
    mixed_precision: bool = False    # bf16 autocast on CUDA (fp16 + loss scaling where bf16 is missing)
    #: with mixed_precision: "auto" (as above), "bf16" or "fp16" (+ loss scaling); see fedclinic.training.precision
    autocast_dtype: str = "auto"
    proximal_mu: float = 0.0         # FedProx / PGD / PAdam perturbation; 0 = off
    optimizer_state: str = "reset"   # "reset": fresh moments every round; "keep": they persist at the site
    measure_gradient_change: bool = False  # compute TrainResult.gradient_change_rate (two extra data passes)
    #: each parameter's step in the backward pass, its gradient freed at once (fedclinic.training.fused_step)
    step_in_backward: bool = False
    max_length: int = 128
    seed: int = 0
    device: str = "auto"
    #: multi-label BCE weight of each label's positives (label order); () = unweighted
    pos_weight: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ConfigError listing every invalid field."""
        p: list[str] = []
        for name in ("local_epochs", "batch_size", "max_length"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (2 if name == "max_length" else 1):
                p.append(f"{name} must be an integer >= {2 if name == 'max_length' else 1}, got {v!r}")
        if not isinstance(self.max_steps, int) or self.max_steps < 0:
            p.append(f"max_steps must be an integer >= 0 (0 = no cap), got {self.max_steps!r}")
        if not (isinstance(self.learning_rate, (int, float)) and math.isfinite(self.learning_rate)
                and self.learning_rate > 0):
            p.append(f"learning_rate must be a finite number > 0, got {self.learning_rate!r}")
        for name in ("weight_decay", "max_grad_norm", "proximal_mu"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                p.append(f"{name} must be a finite number >= 0, got {v!r}")
        p.extend(check_optimizer_settings(self.optimizer, self.optimizer_state))
        p.extend(step_in_backward_problems(self.step_in_backward, max_grad_norm=self.max_grad_norm,
                                           proximal_mu=self.proximal_mu, optimizer_state=self.optimizer_state))
        if not all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w > 0
                   for w in self.pos_weight):
            p.append(f"pos_weight values must be positive finite numbers, got {list(self.pos_weight)!r}")
        p.extend(check_autocast_dtype(self.autocast_dtype))
        if not isinstance(self.device, str) or not self.device:
            p.append(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if p:
            raise ConfigError("invalid training config: " + "; ".join(p))

    @classmethod
    def from_proto(cls, msg, *, device: str = "auto") -> "TrainConfig":
        """From ``fedclinic.proto.task_pb2.TrainingConfig``; a zero/empty field means "use the default".

        Exception, as the protocol documents: ``max_grad_norm = 0`` disables clipping (Task always sends its
        value explicitly, default 1.0). ``max_steps``/``proximal_mu``/``weight_decay``/``seed`` default to 0.
        """
        kw = {f.name: f.default for f in fields(cls)}
        for name in ("local_epochs", "batch_size", "learning_rate", "optimizer", "max_length", "optimizer_state"):
            v = getattr(msg, name)
            if v:
                kw[name] = v
        for name in ("weight_decay", "max_grad_norm", "max_steps", "proximal_mu", "seed", "mixed_precision",
                     "measure_gradient_change", "step_in_backward"):
            kw[name] = getattr(msg, name)
        kw["learning_rate"] = float(kw["learning_rate"])
        kw["weight_decay"] = float(kw["weight_decay"])
        kw["max_grad_norm"] = float(kw["max_grad_norm"])
        kw["proximal_mu"] = float(kw["proximal_mu"])
        kw["mixed_precision"] = bool(kw["mixed_precision"])
        kw["measure_gradient_change"] = bool(kw["measure_gradient_change"])
        kw["step_in_backward"] = bool(kw["step_in_backward"])
        kw["device"] = device
        kw["pos_weight"] = tuple(float(w) for w in msg.pos_weight)
        return cls(**kw)


@dataclass
class TrainResult:
    num_samples: int   # local dataset size (the FedAvg weight)
    steps: int         # optimiser steps taken
    loss: float        # sample-weighted mean task loss over the batches seen (without the proximal term)
    #: the optimizer's per-tensor state after training, by tensor name (only with optimizer_state = "keep")
    optimizer_state: dict | None = None
    #: mean over trained tensors of ||g_after - g_before|| / (||g_before|| + 1e-7) (measure_gradient_change)
    gradient_change_rate: float | None = None

    def reported_metrics(self) -> dict[str, float]:
        """What a site reports with its update (``UpdateHeader.metrics``); strategies may weight by these."""
        out = {"train_loss": float(self.loss), "steps": float(self.steps)}
        if self.gradient_change_rate is not None:
            out["gradient_change_rate"] = float(self.gradient_change_rate)
        return out


# ------------------------------------------------------------------------------------------------------------


def select_device(pref: str = "auto") -> "torch.device":
    """'auto' -> cuda if available else cpu; 'cpu'; 'cuda' / 'cuda:N' (ConfigError if not available)."""
    import torch

    pref = (pref or "auto").strip().lower()
    if pref == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if pref == "cpu":
        return torch.device("cpu")
    m = re.fullmatch(r"cuda(?::(\d+))?", pref)
    if not m:
        raise ConfigError(f"unknown device {pref!r}; use 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if not torch.cuda.is_available():
        raise ConfigError(f"device {pref!r} requested but CUDA is not available here (torch {torch.__version__}, "
                          "no visible GPU or a CPU-only build); use device 'auto' or 'cpu'")
    index = int(m.group(1) or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError(f"device {pref!r} requested but only {count} CUDA device(s) are visible "
                          f"(cuda:0..cuda:{count - 1}); check CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", index)


def select_tensors(names: Iterable[str], trainable_patterns: Sequence[str] = (),
                   frozen_patterns: Sequence[str] = ()) -> list[str]:
    """Names that are trained and sent; see :func:`fedclinic.spec.selection.select_names` (the one implementation)."""
    return select_names(names, trainable_patterns, frozen_patterns)


def encode(examples: Sequence["Example"], loaded: "LoadedModel", *, max_length: int | None = None) -> EncodedData:
    """Tokenize ``examples`` with the task's tokenizer (truncated to ``max_length``) into tensors."""
    import torch

    if hasattr(loaded, "encode"):  # a family with its own encoding (token classification, image + text)
        return loaded.encode(examples, max_length=max_length)
    if max_length is None:
        max_length = loaded.max_length
    if not isinstance(max_length, int) or max_length < 2:
        raise ConfigError(f"max_length must be an integer >= 2, got {max_length!r}")
    if not examples:
        raise DatasetError("no examples to encode; the dataset is empty", rule="the dataset is empty")
    labels = loaded.labels
    index = {lab: i for i, lab in enumerate(labels)}
    multi = loaded.multi_label
    n = len(examples)
    if multi:
        y = torch.zeros((n, len(labels)), dtype=torch.float32)
    else:
        y = torch.empty(n, dtype=torch.int64)
    for i, ex in enumerate(examples):
        bad = [lab for lab in ex.labels if lab not in index]
        if bad or not ex.labels:
            raise DatasetError(f"example {i}: label(s) {list(ex.labels)} not in the model's labels {labels}",
                               rule="an example's label is not in the model's label set")
        if multi:
            y[i, [index[lab] for lab in ex.labels]] = 1.0
        else:
            if len(ex.labels) != 1:
                raise DatasetError(f"example {i}: {len(ex.labels)} labels in a single-label task",
                                   rule="more than one label in a single-label task")
            y[i] = index[ex.labels[0]]

    ids, mask = encode_texts(loaded.tokenizer, [ex.text for ex in examples], max_length=max_length,
                             pad_id=loaded.pad_id)
    return EncodedData(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), labels=y,
                       multi_label=multi, num_labels=len(labels))


def _loss_fn(multi_label: bool, pos_weight: Sequence[float] = ()):
    import torch
    import torch.nn.functional as F

    if multi_label:
        weights = torch.tensor(list(pos_weight), dtype=torch.float32) if pos_weight else None

        def bce(logits, y, reduction="mean"):
            w = None if weights is None else weights.to(logits.device)
            return F.binary_cross_entropy_with_logits(logits, y, reduction=reduction, pos_weight=w)

        return bce
    return lambda logits, y, reduction="mean": F.cross_entropy(logits, y, reduction=reduction)


def _autocast(device: "torch.device", enabled: bool, dtype: str = "auto"):
    """(context, scaler): :func:`fedclinic.training.precision.autocast_for` (bf16 autocast on CUDA by default;
    fp16 + GradScaler if the GPU lacks bf16 or ``dtype`` says fp16)."""
    return autocast_for(device, enabled, dtype)


def train_local(loaded: "LoadedModel", data: EncodedData, cfg: TrainConfig, *, trainable: Collection[str],
                progress: Callable[[int, int, float], None] | None = None,
                optimizer_state: Mapping[str, dict] | None = None) -> TrainResult:
    """Train ``loaded.module`` in place on ``data``; only tensors in ``trainable`` change.

    ``data`` is :class:`EncodedData` or any object with ``len()``, ``batch(idx, device)``, ``multi_label`` and
    ``num_labels`` (e.g. :class:`fedclinic.models.feature_classification.FeatureData`).
    ``progress(step, total_steps, running_mean_loss)`` is called after every optimiser step; an exception
    it raises (e.g. to cancel) stops training and propagates. With ``cfg.optimizer_state == "keep"``, pass
    the previous round's ``TrainResult.optimizer_state`` as ``optimizer_state`` to continue from it.
    """
    import torch

    cfg.validate()
    if len(data) == 0:
        raise DatasetError("no training examples; the site's dataset is empty", rule="the dataset is empty")
    if data.num_labels != len(loaded.labels) or data.multi_label != loaded.multi_label:
        raise ConfigError("the encoded data was made for a different label set; encode() it with this model")
    device = select_device(cfg.device)
    module = loaded.module.to(device)
    state_names = set(module.state_dict())
    wanted = set(trainable)
    unknown = sorted(wanted - state_names)
    if unknown:
        raise ConfigError(f"trainable names unknown to the model: {unknown[:8]}")
    params = [(n, p) for n, p in module.named_parameters()]
    named_train = []
    for n, p in params:
        p.requires_grad_(n in wanted)
        if n in wanted:
            named_train.append((n, p))
    train_params = [p for _, p in named_train]
    if not train_params:
        raise ConfigError("none of the trainable names is a parameter of the model; nothing to train")
    optimizer = (None if cfg.step_in_backward else
                 make_optimizer(cfg.optimizer, train_params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay))
    if cfg.optimizer_state == "keep" and optimizer_state:
        _load_optimizer_state(optimizer, named_train, optimizer_state, device)
    anchor = [p.detach().clone() for p in train_params] if cfg.proximal_mu > 0 else None
    if cfg.pos_weight and (not data.multi_label or len(cfg.pos_weight) != data.num_labels
                           or getattr(loaded, "training_loss", None) is not None):
        raise ConfigError(f"pos_weight ({len(cfg.pos_weight)} values) needs a multi-label text or feature model with "
                          f"one value per label ({data.num_labels} labels here)")
    loss_fn = _batch_loss(loaded, data.multi_label, cfg.pos_weight)
    autocast, scaler = _autocast(device, cfg.mixed_precision, cfg.autocast_dtype)
    group = data_parallel.current()  # several processes: each trains its shard of every global batch
    stepper: BackwardStepper | None = None
    if cfg.step_in_backward:  # the step is taken by each parameter's gradient hook (fedclinic.training.fused_step)
        fused_conflicts(data_parallel=group is not None, loss_scaling=scaler is not None)
        stepper = BackwardStepper(cfg.optimizer, train_params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)

    n = len(data)
    per_epoch = math.ceil(n / cfg.batch_size)
    total = per_epoch * cfg.local_epochs
    if cfg.max_steps:
        total = min(total, cfg.max_steps)
    step = 0
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    seen = 0
    rng_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(int(cfg.seed))
        gen = torch.Generator().manual_seed(int(cfg.seed))
        module.train()
        grads_before = (_full_pass_gradients(loaded, data, train_params, cfg.batch_size, device, loss_fn)
                        if cfg.measure_gradient_change else None)
        with stepper if stepper is not None else contextlib.nullcontext():
            for _epoch in range(cfg.local_epochs):
                if step >= total:
                    break
                order = torch.randperm(n, generator=gen)
                for inputs, y, bs in _global_batches(data, order, cfg.batch_size, device, group):
                    if step >= total:
                        break
                    with autocast():
                        loss = (loss_fn(inputs, y) if group is None
                                else group.weighted_loss(loaded, loss_fn, inputs, y, train_params))
                    if optimizer is None:  # step_in_backward: each parameter's hook steps it and frees its gradient
                        loss.backward()
                    else:
                        optimizer.zero_grad(set_to_none=True)
                        if scaler is not None:
                            scaler.scale(loss).backward()
                        else:
                            loss.backward()
                        if group is not None:  # the global batch's gradient and mean loss on every rank
                            loss = group.all_reduce(train_params, loss)
                        if scaler is not None:
                            scaler.unscale_(optimizer)
                        if anchor is not None:
                            add_proximal_gradient(train_params, anchor, cfg.proximal_mu)
                        if cfg.max_grad_norm > 0:
                            torch.nn.utils.clip_grad_norm_(train_params, cfg.max_grad_norm)
                        if scaler is not None:
                            scaler.step(optimizer)
                            scaler.update()
                        else:
                            eager_optimizers.step(optimizer)
                    step += 1
                    seen += bs
                    loss_sum.add_(loss.detach(), alpha=bs)
                    if progress is not None:
                        progress(step, total, float(loss_sum) / seen)
        rate = None
        if grads_before is not None:
            grads_after = _full_pass_gradients(loaded, data, train_params, cfg.batch_size, device, loss_fn)
            rate = gradient_change_rate(grads_before, grads_after)
    module.eval()
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)  # the last step's gradients (one model-sized copy) are not needed now
    for _, p in params:
        p.requires_grad_(True)
    if not math.isfinite(float(loss_sum)):
        raise IntegrityError("training diverged (loss is NaN/Inf); lower the learning rate or enable clipping")
    kept = _export_optimizer_state(optimizer, named_train) if cfg.optimizer_state == "keep" else None
    return TrainResult(num_samples=n, steps=step, loss=float(loss_sum) / max(seen, 1), optimizer_state=kept,
                       gradient_change_rate=rate)


def _global_batches(data, order, batch_size: int, device, group):
    """``(inputs, targets, rows)`` per global batch of ``order``: the whole batch in one process, this rank's shard
    (:meth:`fedclinic.training.data_parallel.DataParallel.batches`) in a data-parallel group."""
    if group is not None:
        return group.batches(data, order, batch_size, device)
    return ((inputs, y, int(y.shape[0])) for inputs, y in data.batches(order, batch_size, device))


def _batch_loss(loaded, multi_label: bool, pos_weight: Sequence[float] = ()) -> Callable[[tuple, "torch.Tensor"], "torch.Tensor"]:
    """``loss(inputs, targets)`` -> the batch's mean loss: the family's own ``training_loss`` when it has one
    (token classification, image + text), else the classification loss on ``loaded.logits(*inputs)`` (computed in
    float32; multi-label with ``pos_weight`` when given)."""
    own = getattr(loaded, "training_loss", None)
    if own is not None:
        return own
    loss_fn = _loss_fn(multi_label, pos_weight)
    return lambda inputs, y: loss_fn(loaded.logits(*inputs).float(), y)


def _full_pass_gradients(loaded, data, params: list, batch_size: int, device, loss_fn) -> list:
    """sum over batches of the batch-mean loss gradient, divided by the number of examples (the IU-CXR notebook's
    ``compute_gradients``: one pass in order, the module in training mode)."""
    import torch

    total = [torch.zeros_like(p) for p in params]
    order = torch.arange(len(data))
    for inputs, y in data.batches(order, batch_size, device):
        grads = torch.autograd.grad(loss_fn(inputs, y), params, allow_unused=True)
        for acc, g in zip(total, grads):
            if g is not None:
                acc += g
    return [g / len(data) for g in total]


def gradient_change_rate(before: Sequence["torch.Tensor"], after: Sequence["torch.Tensor"]) -> float:
    """mean_i ||after_i - before_i||_2 / (||before_i||_2 + 1e-7): the IU-CXR notebook's contribution measure."""
    if not before or len(before) != len(after):
        raise ValueError("gradient_change_rate needs matching, non-empty gradient lists")
    rates = [float((a - b).norm()) / (float(b.norm()) + 1e-7) for b, a in zip(before, after)]
    return sum(rates) / len(rates)


def _export_optimizer_state(optimizer, named: list) -> dict[str, dict]:
    """The optimizer's state per tensor name, on the CPU (names survive a change of the trainable set)."""
    import torch

    out: dict[str, dict] = {}
    for name, p in named:
        st = optimizer.state.get(p)
        if st:
            out[name] = {k: (v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v)
                         for k, v in st.items()}
    return out


def _load_optimizer_state(optimizer, named: list, saved: Mapping[str, dict], device) -> None:
    """Put ``saved`` (from :func:`_export_optimizer_state`) back; tensors trained for the first time start fresh."""
    import torch

    for name, p in named:
        st = saved.get(name)
        if not st:
            continue
        shapes_ok = all(tuple(v.shape) == tuple(p.shape) for v in st.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0)
        if not shapes_ok:
            raise IntegrityError(f"kept optimizer state for {name!r} does not match the tensor's shape "
                                 f"{tuple(p.shape)}; the model changed, so start with optimizer_state='reset'")
        optimizer.state[p] = {k: (v.to(device, copy=True) if isinstance(v, torch.Tensor) and v.dim() > 0
                                  else v.clone() if isinstance(v, torch.Tensor) else v)
                              for k, v in st.items()}


def evaluate(loaded: "LoadedModel", data: EncodedData, *, batch_size: int = 64) -> dict[str, float]:
    """Metrics of the model on ``data`` (no gradients, eval mode, the module's current device).

    Single-label: ``loss``, ``accuracy`` (argmax == label), ``macro_f1`` (mean over *all* task labels of the
    one-vs-rest F1; a label with no true and no predicted example scores 0, as scikit-learn's ``zero_division=0``)
    and ``n``. Multi-label: :func:`fedclinic.evaluation.multilabel.multilabel_evaluation` (per-label ``f1/<label>``
    and ``auc/<label>``, ``macro_f1``, ``macro_auc``, ``micro_f1``, ``exact_match``, ``label_accuracy``, ``loss``
    (unweighted BCE, whatever the training's ``pos_weight``), ``n`` and the ``count/thr/...`` threshold histograms),
    deciding at probability 0.5.
    """
    import torch

    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if hasattr(loaded, "evaluate"):  # a family with its own metrics (entity-level F1; per-label F1 and AUC)
        return loaded.evaluate(data, batch_size=batch_size)
    if len(data) == 0:
        raise DatasetError("no evaluation examples; the evaluation set is empty",
                           rule="the evaluation set is empty")
    module = loaded.module
    try:
        device = next(module.parameters()).device
    except StopIteration:  # pragma: no cover - every family has parameters
        device = torch.device("cpu")
    loss_fn = _loss_fn(data.multi_label)
    was_training = module.training
    module.eval()
    loss_sum = 0.0
    preds = []
    with torch.no_grad():
        for start in range(0, len(data), batch_size):
            idx = torch.arange(start, min(start + batch_size, len(data)))
            inputs, y = data.batch(idx, device)
            logits = loaded.logits(*inputs).float()
            per = loss_fn(logits, y, reduction="none")
            loss_sum += float(per.sum() / (per.shape[1] if per.dim() == 2 else 1))
            preds.append(logits.cpu() if data.multi_label else logits.argmax(dim=-1).cpu())
    module.train(was_training)
    n = len(data)
    c = data.num_labels
    pred = torch.cat(preds).numpy()
    true = data.labels.numpy()
    if data.multi_label:
        return multilabel_evaluation(true, pred, loaded.labels, loss=loss_sum / n)
    accuracy = float((pred == true).mean())
    p_hot = np.eye(c, dtype=bool)[pred]
    t_hot = np.eye(c, dtype=bool)[true]
    tp = (p_hot & t_hot).sum(axis=0).astype(np.float64)
    fp = (p_hot & ~t_hot).sum(axis=0)
    fn = (~p_hot & t_hot).sum(axis=0)
    denom = 2 * tp + fp + fn
    f1 = np.divide(2 * tp, denom, out=np.zeros(c), where=denom > 0)
    return {"loss": loss_sum / n, "accuracy": accuracy, "macro_f1": float(f1.mean()), "n": float(n)}


def compute_delta(before: Mapping[str, np.ndarray], after: Mapping[str, np.ndarray],
                  names: Iterable[str], *, into: "MutableMapping[str, np.ndarray] | None" = None
                  ) -> "MutableMapping[str, np.ndarray]":
    """``after - before`` as float32 for each name (IntegrityError on a missing name or shape mismatch), stored in
    ``into`` as each is computed or in a new dict; returns where they are.

    Each difference is computed in flat blocks (:func:`fedclinic.runtime.array_blocks.flat_blocks`; elementwise,
    so the same values as one ``np.subtract``), and the blocks already read of a read-only memory-mapped
    ``before``/``after`` (the agent's tensor cache) are released as it goes. Where ``into`` has
    ``put_blocks(name, shape, dtype, blocks)`` (``fedclinic.federation.spilled_tensors.SpilledTensors``) the
    blocks are handed to it as they are computed: with ``after`` a view of the trained module
    (``models.base.ModuleTensorView``), a tensor's update then needs one block of memory, not the tensor's size
    two or three times over (a copy of the trained tensor, the difference, the mapped global tensor)."""
    out: MutableMapping[str, np.ndarray] = {} if into is None else into
    put_blocks = getattr(out, "put_blocks", None)
    for name in names:
        if name not in before or name not in after:
            side = "before" if name not in before else "after"
            raise IntegrityError(f"cannot compute the update: tensor {name!r} is missing from the {side} weights")
        a = np.asarray(after[name])
        b = np.asarray(before[name])
        if a.shape != b.shape:
            raise IntegrityError(f"cannot compute the update: tensor {name!r} changed shape {b.shape} -> {a.shape}")
        if put_blocks is not None:
            put_blocks(name, a.shape, np.float32,
                       (np.subtract(x, y, dtype=np.float32) for x, y in flat_blocks([a, b])))
        else:
            d = np.empty(a.shape, dtype=np.float32)
            for x, y, o in flat_blocks([a, b, d]):
                np.subtract(x, y, out=o, dtype=np.float32)
            out[name] = d
        del a, b
    return out


__all__ = ["EncodedData", "OPTIMIZERS", "TrainConfig", "TrainResult", "compute_delta", "encode", "evaluate",
           "gradient_change_rate",
           "select_device", "select_tensors", "train_local"]
