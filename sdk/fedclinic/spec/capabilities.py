"""What each model family and architecture supports, as torch-free tables the task spec checks against.

The task spec (:mod:`fedclinic.spec.task`), the aggregator and the sites consult the same tables, so a task is
refused with the same reason everywhere, before any model is built:

- sample-level DP-SGD (:func:`check_supported`; the mechanism is :mod:`fedclinic.privacy.dp_sgd`);
- the local optimizers and their state policies (:func:`check_optimizer_settings`; the optimizers are
  :mod:`fedclinic.training.optimizers`);
- the pooling forms of a text-classification transformer (:func:`pooling_problem`; the module is
  :mod:`fedclinic.models.mean_pooling`).
"""

from __future__ import annotations

from typing import Any

from fedclinic.errors import ConfigError

#: family -> architectures with sample-level DP-SGD (every built-in model: transformers by ghost clipping or
#: Opacus' grad samplers, the LSTM, bag-of-tokens, CNN-BiLSTM-CRF and ResNet + BiLSTM models by differentiating
#: each example alone, with batch normalisation in inference mode; LoRA adapters on any of them)
SUPPORTED = {"text-classification": ("transformer", "lstm", "logreg"), "feature-classification": ("logreg",),
             "token-classification": ("transformer", "transformer-crf", "cnn-bilstm-crf"),
             "question-answering": ("causal-lm",), "image-text-classification": ("resnet-bilstm",)}
#: (family, architecture) -> why sample-level DP-SGD is refused for it (none of the built-in models is: what once
#: stood here -- LSTMs without grad samplers, batch norm mixing the examples of a batch -- is handled exactly by
#: fedclinic.privacy.per_example_clipping and a batch norm frozen in inference mode)
REFUSED: dict[tuple[str, str], str] = {}
ALTERNATIVE = 'use client-level DP instead (privacy level "client" / strategy "dp-fedavg")'
#: (family, architecture) whose private rounds run the per-example loop (fedclinic.privacy.per_example_clipping,
#: picked by DP-SGD's ``auto`` mode): LSTMs over packed sequences, EmbeddingBag with per-token weights, a ResNet
#: whose BatchNorm runs in inference mode. The loop clips each row as it differentiates it, so it cannot clip a
#: patient's summed rows: per-patient DP (privacy.unit = "patient") is refused for these models.
LOOP_MODELS = (("text-classification", "lstm"), ("text-classification", "logreg"),
               ("token-classification", "cnn-bilstm-crf"), ("image-text-classification", "resnet-bilstm"))


def check_supported(family: str, architecture: str) -> None:
    """ConfigError with the reason and the alternative unless sample-level DP-SGD is available for the model."""
    if architecture in SUPPORTED.get(family, ()):
        return
    supported = "; ".join(f"{f}: {', '.join(a)}" for f, a in SUPPORTED.items())
    reason = REFUSED.get((family, architecture), "fedclinic has no per-example objective for it")
    raise ConfigError(f"sample-level DP-SGD is not available for {family} / {architecture}: {reason}; "
                      f"{ALTERNATIVE} (DP-SGD supports {supported})")


#: pooling forms of the ``transformer`` architecture: ``cls`` = Hugging Face's pooler + head, ``mean`` = fedclinic.models.mean_pooling
POOLINGS = ("cls", "mean")


def pooling_problem(pooling: Any) -> str | None:
    """Why ``pooling`` is not a pooling form (None when it is one of :data:`POOLINGS`)."""
    if pooling not in POOLINGS:
        return f"pooling must be one of {list(POOLINGS)}, got {pooling!r}"
    return None


#: local optimizer names, as a task's ``optimizer`` field takes them (built by fedclinic.training.optimizers)
OPTIMIZERS = ("adamw", "adam", "sgd", "self_adam", "padam")
#: what happens to optimizer state between rounds
OPTIMIZER_STATE_POLICIES = ("reset", "keep")


def check_optimizer_settings(optimizer: str, state_policy: str) -> list[str]:
    """Problems with an optimizer name and state policy, as sentences (empty when both are valid)."""
    problems = []
    if optimizer not in OPTIMIZERS:
        problems.append(f"optimizer {optimizer!r} is unknown; choose one of {', '.join(OPTIMIZERS)}")
    if state_policy not in OPTIMIZER_STATE_POLICIES:
        problems.append(f"optimizer_state {state_policy!r} is unknown; choose one of "
                        f"{', '.join(OPTIMIZER_STATE_POLICIES)}")
    return problems


def step_in_backward_problems(step_in_backward: bool, *, max_grad_norm: float, proximal_mu: float,
                              optimizer_state: str, private: bool = False) -> list[str]:
    """Problems with ``step_in_backward`` (each parameter's optimizer step taken in the backward pass, as soon as
    its gradient is accumulated, then the gradient freed; fedclinic.training.fused_step), as one sentence.

    The fused step is the ordinary step only when a parameter's update needs nothing but its own gradient:
    global-norm clipping (``max_grad_norm`` > 0) needs every gradient first, the proximal term and a kept optimizer
    state are applied around the ordinary step, and DP-SGD clips and noises per example. Those settings conflict.
    The trainer refuses the rest at a site (several devices, fp16 loss scaling), where they are chosen.
    """
    if not step_in_backward:
        return []
    conflicts = []
    if max_grad_norm > 0:
        conflicts.append(f"max_grad_norm = {max_grad_norm:g} (set 0: clipping needs every gradient first)")
    if proximal_mu > 0:
        conflicts.append(f"proximal_mu = {proximal_mu:g} (set 0)")
    if optimizer_state == "keep":
        conflicts.append('optimizer_state = "keep" (use "reset")')
    if private:
        conflicts.append('privacy level = "sample" (DP-SGD clips each example\'s gradient)')
    if not conflicts:
        return []
    return ["step_in_backward (the optimizer step fused into the backward pass) cannot be combined with "
            + "; ".join(conflicts) + "; change those settings or set step_in_backward = false"]
