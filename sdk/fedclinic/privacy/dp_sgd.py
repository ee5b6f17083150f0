"""Sample-level DP-SGD for a site's local training (Opacus per-sample gradients, clipping and noise).

One round of local DP-SGD runs ``steps`` steps; each step (Abadi et al. 2016)::

    B   = Poisson sample of the site's examples, each kept with probability q
    g_i = grad of loss(x_i) for i in B                       (per-sample gradients, Opacus hooks)
    g   = ( sum_{i in B} g_i * min(1, C / ||g_i||) + N(0, (sigma C)^2 I) ) / (q n)
    w  <- optimizer step with g

``q n`` is the *expected* batch size, so the step does not depend on the realised batch size; an empty
sample is a noise-only step (the analysed mechanism releases noise then too: skipping the step would tell
an observer that the sample was empty, an event whose probability depends on the dataset). The accountant
(:mod:`fedclinic.privacy.accounting`) charges ``(sigma, q, steps)`` per round.

Randomness: the Poisson sampling and the Gaussian noise come from a generator seeded from the operating
system's entropy every round, never from the task's seed (the data scientist knows that seed; noise they
could regenerate would protect nothing). It is torch's Mersenne-Twister generator, not a cryptographic one:
Opacus' ``secure_mode`` needs torchcsprng, which is not installed; SECURITY.md states the gap.

Which models
------------
Per family, the privacy unit and the per-example loss are those of :mod:`fedclinic.privacy.per_example`
(one text, one feature row, one sentence/review, one question/answer pair). Supported (:data:`SUPPORTED`):
``text-classification`` transformers, ``feature-classification`` logistic regression, ``token-classification``
transformers with a linear head or a CRF, ``question-answering`` causal LMs (GPT-2, Llama; tied output
embeddings included). Opacus has grad samplers for their layers (Linear, Embedding, LayerNorm); layers without
one (GPT-2's ``Conv1D``, Llama's RMSNorm) get exact per-sample gradients from Opacus' functorch fallback
(``vmap`` of the layer's own gradient), the CRF from per-sequence parameter copies. Refused with the reason
and the alternative (:func:`check_supported`, :data:`REFUSED`): models with LSTMs (torch's cuDNN
``nn.LSTM`` over packed sequences has no per-sample gradients; Opacus' ``DPLSTM`` is a different module),
the bag-of-tokens text logreg, and the ResNet + BiLSTM image-text model (batch normalisation mixes the
examples of a batch). Those use client-level DP (strategy ``dp-fedavg``) instead.

Clipping modes: ``"hooks"`` materialises each example's gradient (Opacus' GradSampleModule); ``"ghost"``
(fast gradient clipping) computes the per-example norms layer by layer without them. Ghost clipping sums
squared per-layer norms, which is the squared norm of the example's gradient only when no parameter is used
by two layers, and needs one classification loss per example: it is used for single-label text and feature
classification only (``mode="auto"``) and refused elsewhere.

BERT-family models
------------------
A plain ``make_private`` on ``BertForSequenceClassification`` fails in ``clip_and_accumulate``: the model
builds ``position_ids`` and ``token_type_ids`` from buffers of batch size 1 that broadcast over the batch,
so the embedding layers' per-sample gradients come out with batch dimension 1 and cannot be stacked with
the others. :func:`explicit_ids_hook` gives every Hugging Face model (outer and base models: the causal LM's
objective calls its base model directly) explicit per-example ids of shape ``[batch, L]``, exactly the values
the model would have used for right-padded input: ``position_ids = 0..L-1`` for the model types in
:data:`ARANGE_POSITIONS` (RoBERTa derives its positions per example from the padding already and gets none),
and ``token_type_ids = 0`` for models with token-type embeddings (``type_vocab_size``; GPT-2 has none and
would add ``wte(0)`` to every position if given them). Nothing is frozen; a test checks that the hook leaves
every allowed model type's outputs unchanged.
"""

from __future__ import annotations

import inspect
import math
import secrets
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection

from fedclinic.errors import ConfigError, DatasetError, IntegrityError

if TYPE_CHECKING:
    import torch

    from fedclinic.training import TrainConfig, TrainResult

#: family -> architectures with sample-level DP-SGD
SUPPORTED = {"text-classification": ("transformer",), "feature-classification": ("logreg",),
             "token-classification": ("transformer", "transformer-crf"), "question-answering": ("causal-lm",)}
_LSTM = ("its LSTM is torch's nn.LSTM over packed sequences, for which Opacus computes no per-sample gradients "
         "(Opacus' DPLSTM is a different module with other tensors, not the architecture the task declared)")
#: (family, architecture) -> why sample-level DP-SGD is refused for it
REFUSED = {
    ("text-classification", "lstm"): _LSTM,
    ("text-classification", "logreg"): ("the bag-of-tokens logistic regression keeps its bias outside any layer "
                                         "Opacus knows and reads two inputs per token"),
    ("token-classification", "cnn-bilstm-crf"): _LSTM,
    ("image-text-classification", "resnet-bilstm"): (
        "the ResNet's batch normalisation mixes the examples of a batch in training (each example's gradient "
        "depends on the others, so clipping it bounds nothing), and " + _LSTM),
}
#: families whose loss is one classification loss per example: ghost clipping is sound for them
GHOST_FAMILIES = ("text-classification", "feature-classification")
#: HF model types whose default position ids are 0..L-1 for right-padded input (see the module docstring)
ARANGE_POSITIONS = ("bert", "distilbert", "electra", "gpt2", "llama")
ALTERNATIVE = 'use client-level DP instead (privacy level "client" / strategy "dp-fedavg")'


@dataclass(frozen=True)
class DPSGD:
    """The DP-SGD settings of one round: noise multiplier sigma, clip norm C, sampling rate q, steps."""

    noise_multiplier: float
    max_grad_norm: float
    sample_rate: float
    steps: int

    def __post_init__(self) -> None:
        if not (self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier)):
            raise ConfigError(f"DP-SGD noise_multiplier must be positive, got {self.noise_multiplier}")
        if not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            raise ConfigError(f"DP-SGD max_grad_norm (the per-example clip C) must be positive, got {self.max_grad_norm}")
        if not 0 < self.sample_rate <= 1:
            raise ConfigError(f"DP-SGD sample rate must be in (0, 1], got {self.sample_rate}")
        if self.steps <= 0:
            raise ConfigError(f"DP-SGD needs at least one step, got {self.steps}")


def check_supported(family: str, architecture: str) -> None:
    """ConfigError with the reason and the alternative unless sample-level DP-SGD is available for the model."""
    if architecture in SUPPORTED.get(family, ()):
        return
    supported = "; ".join(f"{f}: {', '.join(a)}" for f, a in SUPPORTED.items())
    reason = REFUSED.get((family, architecture), "fedclinic has no per-example objective for it")
    raise ConfigError(f"sample-level DP-SGD is not available for {family} / {architecture}: {reason}; "
                      f"{ALTERNATIVE} (DP-SGD supports {supported})")


def explicit_ids_hook(module: "torch.nn.Module") -> list:
    """Give each Hugging Face model inside ``module`` explicit ``[batch, L]`` position and token-type ids when
    the caller passes ``input_ids`` without them (see the module docstring). Returns the hook handles (call
    ``.remove()`` on each when done)."""
    import torch

    handles = []

    def hook(mod, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None or ids.dim() != 2:
            return args, kwargs
        b, length = ids.shape
        fill = fills[id(mod)]
        if "position_ids" in fill and kwargs.get("position_ids") is None:
            kwargs["position_ids"] = torch.arange(length, device=ids.device).unsqueeze(0).repeat(b, 1)
        if "token_type_ids" in fill and kwargs.get("token_type_ids") is None:
            kwargs["token_type_ids"] = torch.zeros_like(ids)
        return args, kwargs

    fills: dict[int, set[str]] = {}
    for sub in module.modules():
        if not _is_hf_model(sub):
            continue
        params = inspect.signature(sub.forward).parameters
        config = sub.config
        fill = set()
        if "position_ids" in params and getattr(config, "model_type", None) in ARANGE_POSITIONS:
            fill.add("position_ids")
        if "token_type_ids" in params and int(getattr(config, "type_vocab_size", 0) or 0) > 0:
            fill.add("token_type_ids")
        fills[id(sub)] = fill
        handles.append(sub.register_forward_pre_hook(hook, with_kwargs=True))
    return handles


def _is_hf_model(module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a train dependency
        return False
    return isinstance(module, PreTrainedModel)


def train_local_private(loaded, data, cfg: "TrainConfig", dp: DPSGD, *, trainable: Collection[str],
                        progress: Callable[[int, int, float], None] | None = None,
                        mode: str = "auto", step_hook: Callable[[Any], None] | None = None) -> "TrainResult":
    """Train ``loaded.module`` in place with DP-SGD (``dp.steps`` Poisson-sampled steps); only ``trainable``
    tensors change. Same contract as :func:`fedclinic.training.train_local` otherwise; optimizer state is
    not kept across rounds (it would be a function of earlier noisy gradients only, but the simpler contract
    is the one stated here), and AMP, FedProx and the gradient-change measure are refused.

    The objective is the batch mean of per-example losses (:class:`~fedclinic.privacy.per_example.PerExampleObjective`).
    ``mode``: ``"hooks"`` materialises one gradient per example and trained tensor (Opacus' GradSampleModule);
    ``"ghost"`` computes the per-example norms without them (ghost clipping, Li et al. 2022 / Bu et al. 2023:
    a second backward pass of the loss reweighted by min(1, C/||g_i||)), so memory stays near non-private
    training; ``"auto"`` (default) uses ghost clipping for single-label text and feature classification and
    hooks otherwise. Both compute the same clipped sum (tested). ``step_hook(optimizer)`` is called after the
    noise of every step is drawn (Opacus' accountant hook fits: the caller can account what actually ran)."""
    if mode not in ("auto", "hooks", "ghost"):
        raise ConfigError(f"DP-SGD mode must be auto, hooks or ghost, got {mode!r}")
    if mode == "ghost" and (data.multi_label or loaded.family not in GHOST_FAMILIES):
        raise ConfigError("ghost clipping needs one classification loss per example and no parameter shared by two "
                          f"layers (single-label {' or '.join(GHOST_FAMILIES)}); use mode 'hooks' for this task")
    import torch
    from opacus import GradSampleModule
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    from fedclinic.optimizers import make_optimizer
    from fedclinic.privacy.per_example import PerExampleObjective
    from fedclinic.training import TrainResult, select_device

    cfg.validate()
    check_supported(loaded.family, loaded.architecture)
    if loaded.meta.get("lora") is not None:
        raise ConfigError("sample-level DP-SGD is not available for a model with LoRA adapters (Opacus computes "
                          "per-sample gradients of a linear's own weight and bias only); " + ALTERNATIVE +
                          " or a model without adapters")
    if cfg.mixed_precision or cfg.proximal_mu > 0 or cfg.measure_gradient_change:
        raise ConfigError("DP-SGD runs in float32 without a proximal term or the gradient-change measure; turn off "
                          "mixed_precision, proximal_mu and measure_gradient_change for a private task")
    n = len(data)
    if n == 0:
        raise DatasetError("no training examples; the site's dataset is empty")
    device = select_device(cfg.device)
    module = loaded.module.to(device)
    wanted = set(trainable)
    named_train = [(name, p) for name, p in module.named_parameters() if name in wanted]
    if not named_train:
        raise ConfigError("none of the trainable names is a parameter of the model; nothing to train")
    train_params = [p for _, p in named_train]
    for name, p in module.named_parameters():
        p.requires_grad_(name in wanted)
    seed = secrets.randbits(63)
    sampler = torch.Generator().manual_seed(seed)
    noise = torch.Generator(device=device).manual_seed(seed ^ 0x5DEECE66D)
    optimizer = make_optimizer(cfg.optimizer, train_params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    expected = max(1, round(dp.sample_rate * n))
    ghost = mode == "ghost" or (mode == "auto" and not data.multi_label and loaded.family in GHOST_FAMILIES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Opacus' notes about secure_mode and full backward hooks
        if ghost:
            gsm = GradSampleModuleFastGradientClipping(module, batch_first=True, loss_reduction="mean",
                                                       max_grad_norm=dp.max_grad_norm, use_ghost_clipping=True)
            dp_optimizer = DPOptimizerFastGradientClipping(
                optimizer, noise_multiplier=dp.noise_multiplier, max_grad_norm=dp.max_grad_norm,
                expected_batch_size=expected, loss_reduction="mean", generator=noise)
        else:
            gsm = GradSampleModule(module, batch_first=True, loss_reduction="mean", strict=True)
            dp_optimizer = DPOptimizer(optimizer, noise_multiplier=dp.noise_multiplier,
                                       max_grad_norm=dp.max_grad_norm, expected_batch_size=expected,
                                       loss_reduction="mean", generator=noise)
    if step_hook is not None:
        dp_optimizer.attach_step_hook(step_hook)
    handles = explicit_ids_hook(module)
    original = loaded.module
    loaded.module = gsm  # loaded.logits(...) now runs through the per-sample gradient hooks
    objective = PerExampleObjective(loaded, module, data.multi_label)
    if ghost:
        # single-label classification only: softmax cross-entropy per example, the objective of that family
        criterion = DPLossFastGradientClipping(gsm, dp_optimizer, torch.nn.CrossEntropyLoss(reduction="mean"), "mean")
        loss_fn = lambda inputs, y: criterion(loaded.logits(*inputs).float(), y)  # noqa: E731
    else:
        loss_fn = objective
    loss_sum, seen = 0.0, 0
    try:
        module.train()
        for step in range(1, dp.steps + 1):
            idx = (torch.rand(n, generator=sampler) < dp.sample_rate).nonzero().flatten()
            dp_optimizer.zero_grad(set_to_none=True)
            if len(idx) == 0:
                _empty_sample(train_params, ghost)  # a noise-only step, as the accountant assumes
            else:
                inputs, y = data.batch(idx, device)
                loss = loss_fn(inputs, y)
                with warnings.catch_warnings():
                    # frozen embeddings feed the first trained layer: torch notes that the full backward hooks
                    # then fire on module outputs only, which is all Opacus' per-sample gradients need
                    warnings.filterwarnings("ignore", message="Full backward hook is firing")
                    loss.backward()
                if not ghost:
                    objective.after_backward()
                loss_sum += float(loss.detach()) * len(idx)
                seen += len(idx)
            dp_optimizer.step()
            if progress is not None:
                progress(step, dp.steps, loss_sum / max(seen, 1))
    finally:
        for h in handles:
            h.remove()
        loaded.module = original
        gsm._close()
        for p in module.parameters():
            p.requires_grad_(True)
            p.grad = None
        module.eval()
    if not math.isfinite(loss_sum):
        raise IntegrityError("private training diverged (loss is NaN/Inf); lower the learning rate")
    return TrainResult(num_samples=n, steps=dp.steps, loss=loss_sum / max(seen, 1))


def _empty_sample(params: list, ghost: bool) -> None:
    """Per-sample gradients of an empty batch: the optimizer's clipped sum is zero and only noise is added."""
    import torch

    for p in params:
        if ghost:
            p.grad = torch.zeros_like(p)
        else:
            p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
