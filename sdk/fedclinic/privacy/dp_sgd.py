"""Sample-level DP-SGD for a site's local training (Opacus per-sample gradients, clipping and noise).

One round of local DP-SGD runs ``steps`` steps; each step (Abadi et al. 2016)::

    B   = Poisson sample of the site's examples, each kept with probability q
    g_i = grad of loss(x_i) for i in B                       (per-sample gradients, Opacus hooks)
    g   = ( sum_{i in B} g_i * min(1, C / ||g_i||) + N(0, (sigma C)^2 I) ) / (q n)
    w  <- optimizer step with g

``q n`` is the *expected* batch size, so the step does not depend on the realised batch size; an empty
sample is a step that releases nothing. The accountant (:mod:`fedclinic.privacy.accounting`) charges
``(sigma, q, steps)`` per round.

Randomness: the Poisson sampling and the Gaussian noise come from a generator seeded from the operating
system's entropy every round, never from the task's seed (the data scientist knows that seed; noise they
could regenerate would protect nothing). It is torch's Mersenne-Twister generator, not a cryptographic one:
Opacus' ``secure_mode`` needs torchcsprng, which is not installed; SECURITY.md states the gap.

Which models
------------
Opacus computes per-sample gradients for the layers it knows (Linear, Embedding, LayerNorm, Conv, ...), so
DP-SGD runs for ``text-classification`` transformers and ``feature-classification`` logistic regression,
whose loss is the mean of per-example losses. Refused with the reason (:func:`check_supported`): LSTM
models (our packed-sequence LSTMs are not Opacus' DPLSTM), the bag-of-tokens text logreg (a bias held
outside any layer Opacus knows, over two inputs), CRF layers, NER, QA and image+text (per-token,
per-answer-token or fused losses are not per-example means, so the per-example sensitivity bound would not
hold as stated); those tasks can use client-level DP (strategy ``dp-fedavg``) instead.

BERT-family models
------------------
A plain ``make_private`` on ``BertForSequenceClassification`` fails in ``clip_and_accumulate``: the model
builds ``position_ids`` and ``token_type_ids`` from buffers of batch size 1 that broadcast over the batch,
so the embedding layers' per-sample gradients come out with batch dimension 1 and cannot be stacked with
the others. :func:`explicit_ids_hook` gives every Hugging Face model that accepts them explicit per-example
``position_ids`` (``0..L-1``) and ``token_type_ids`` (zeros) of shape ``[batch, L]`` — exactly the values the
model would have used — so every embedding sees a real batch dimension. Nothing is frozen.
"""

from __future__ import annotations

import inspect
import math
import secrets
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Collection

from fedclinic.errors import ConfigError, DatasetError, IntegrityError

if TYPE_CHECKING:
    import torch

    from fedclinic.training import TrainConfig, TrainResult

SUPPORTED = {"text-classification": ("transformer",), "feature-classification": ("logreg",)}


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
    """ConfigError (with the alternative) unless sample-level DP-SGD is available for this model."""
    if architecture not in SUPPORTED.get(family, ()):
        supported = "; ".join(f"{f}: {', '.join(a)}" for f, a in SUPPORTED.items())
        raise ConfigError(
            f"sample-level DP-SGD is not available for {family} / {architecture} (supported: {supported}). "
            "LSTM and CRF layers have no per-sample gradients in Opacus here, and per-token or per-answer-token "
            "losses break the per-example bound; use client-level DP instead (privacy level \"client\" / "
            "strategy \"dp-fedavg\")")


def explicit_ids_hook(module: "torch.nn.Module") -> list:
    """Give each outermost Hugging Face model inside ``module`` explicit ``[batch, L]`` position and token-type
    ids when the caller passes ``input_ids`` without them (see the module docstring). Returns the hook
    handles (call ``.remove()`` on each when done)."""
    import torch

    handles = []

    def hook(mod, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is None or ids.dim() != 2:
            return args, kwargs
        b, length = ids.shape
        if accepts.get(id(mod), {}).get("position_ids") and kwargs.get("position_ids") is None:
            kwargs["position_ids"] = torch.arange(length, device=ids.device).unsqueeze(0).repeat(b, 1)
        if accepts.get(id(mod), {}).get("token_type_ids") and kwargs.get("token_type_ids") is None:
            kwargs["token_type_ids"] = torch.zeros_like(ids)
        return args, kwargs

    accepts: dict[int, dict[str, bool]] = {}
    taken: list = []
    for name, sub in module.named_modules():
        if not _is_hf_model(sub) or any(name.startswith(t + ".") or t == "" for t in taken):
            continue
        params = inspect.signature(sub.forward).parameters
        accepts[id(sub)] = {"position_ids": "position_ids" in params, "token_type_ids": "token_type_ids" in params}
        handles.append(sub.register_forward_pre_hook(hook, with_kwargs=True))
        taken.append(name)
    return handles


def _is_hf_model(module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a train dependency
        return False
    return isinstance(module, PreTrainedModel)


def train_local_private(loaded, data, cfg: "TrainConfig", dp: DPSGD, *, trainable: Collection[str],
                        progress: Callable[[int, int, float], None] | None = None,
                        mode: str = "auto") -> "TrainResult":
    """Train ``loaded.module`` in place with DP-SGD (``dp.steps`` Poisson-sampled steps); only ``trainable``
    tensors change. Same contract as :func:`fedclinic.training.train_local` otherwise; optimizer state is
    not kept across rounds (it would be a function of earlier noisy gradients only, but the simpler contract
    is the one stated here), and AMP, FedProx and the gradient-change measure are refused.

    ``mode``: ``"hooks"`` materialises one gradient per example and trained tensor (Opacus' GradSampleModule);
    ``"ghost"`` computes the per-example norms without them (ghost clipping, Li et al. 2022 / Bu et al. 2023:
    a second backward pass of the loss reweighted by min(1, C/||g_i||)), so memory stays near non-private
    training; ``"auto"`` (default) uses ghost clipping for single-label classification and hooks otherwise.
    Both compute the same clipped sum (tested)."""
    if mode not in ("auto", "hooks", "ghost"):
        raise ConfigError(f"DP-SGD mode must be auto, hooks or ghost, got {mode!r}")
    if mode == "ghost" and data.multi_label:
        raise ConfigError("ghost clipping needs one loss per example; multi-label tasks use mode 'hooks'")
    import torch
    from opacus import GradSampleModule
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    from fedclinic.optimizers import make_optimizer
    from fedclinic.training import TrainResult, _batch_loss, select_device

    cfg.validate()
    check_supported(loaded.family, loaded.architecture)
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
    for name, p in module.named_parameters():
        p.requires_grad_(name in wanted)
    seed = secrets.randbits(63)
    sampler = torch.Generator().manual_seed(seed)
    noise = torch.Generator(device=device).manual_seed(seed ^ 0x5DEECE66D)
    optimizer = make_optimizer(cfg.optimizer, [p for _, p in named_train], lr=cfg.learning_rate,
                               weight_decay=cfg.weight_decay)
    expected = max(1, round(dp.sample_rate * n))
    ghost = mode == "ghost" or (mode == "auto" and not data.multi_label)
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
    handles = explicit_ids_hook(module)
    original = loaded.module
    loaded.module = gsm  # loaded.logits(...) now runs through the per-sample gradient hooks
    if ghost:
        criterion = DPLossFastGradientClipping(gsm, dp_optimizer, torch.nn.CrossEntropyLoss(reduction="mean"), "mean")
        loss_fn = lambda inputs, y: criterion(loaded.logits(*inputs).float(), y)  # noqa: E731
    else:
        loss_fn = _batch_loss(loaded, data.multi_label)
    loss_sum, seen, step = 0.0, 0, 0
    try:
        module.train()
        for step in range(1, dp.steps + 1):
            idx = (torch.rand(n, generator=sampler) < dp.sample_rate).nonzero().flatten()
            dp_optimizer.zero_grad(set_to_none=True)
            if len(idx) == 0:
                continue  # an empty Poisson sample releases nothing; the accountant still counts the step
            inputs, y = data.batch(idx, device)
            loss = loss_fn(inputs, y)
            with warnings.catch_warnings():
                # frozen embeddings feed the first trained layer: torch notes that the full backward hooks then
                # fire on module outputs only, which is all Opacus' per-sample gradients need
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                loss.backward()
            dp_optimizer.step()
            loss_sum += float(loss.detach()) * len(idx)
            seen += len(idx)
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
