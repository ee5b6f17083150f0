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
