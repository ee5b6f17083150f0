"""SAFL's task settings and tensor-name rules, torch-free: which selections and tokens a task may ask for, its
parsed config, the checks of both, and which tensors belong to which transformer layer (the rules a site's
selection and the aggregator's update check share). :mod:`fedclinic.training.safl` profiles and selects the
layers at a site; the method is described there.

The task spec, the model card and the aggregator read these; none of them needs torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from fedclinic.errors import IntegrityError

SAFL = "safl"
#: ``[update] selection`` values: the static patterns alone ("" or "static"), or SAFL on top of them
SELECTIONS = ("", "static", SAFL)
TOKENS = ("cls", "last", "entities")
DEFAULT_PROFILE_SAMPLES = 64
#: families and architectures with attention layers SAFL can profile (Hugging Face modules)
ATTENTION_ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "text-classification": ("transformer",),
    "token-classification": ("transformer", "transformer-crf"),
    "question-answering": ("causal-lm",),
}


@dataclass(frozen=True)
class SaflConfig:
    """A task's SAFL settings (``[update] selection = "safl"``)."""

    top_k: int
    profile_samples: int = DEFAULT_PROFILE_SAMPLES
    token: str = "cls"

    @classmethod
    def from_spec(cls, spec: Any) -> "SaflConfig | None":
        """From a ``TaskSpec`` proto: None unless its update selection is "safl"; defaults filled in."""
        u = spec.update
        if u.selection != SAFL:
            return None
        return cls(top_k=int(u.select_top_k_layers), profile_samples=int(u.safl_profile_samples or
                                                                        DEFAULT_PROFILE_SAMPLES),
                   token=u.safl_token or default_token(spec.family))


def default_token(family: str) -> str:
    """"last" for causal LMs (no [CLS]; the last token is the pooled one), "cls" for encoders."""
    return "last" if family == "question-answering" else "cls"


def config_problems(selection: str, top_k: int, profile_samples: int, token: str, family: str,
                    architecture: str) -> list[str]:
    """What is wrong with a task's selection settings, each with what to do (empty when nothing)."""
    if selection not in SELECTIONS:
        return [f"update selection {selection!r} is unknown; use \"static\" (the trainable/frozen patterns) or "
                "\"safl\" (attention-selected layers)"]
    if selection != SAFL:
        if top_k or profile_samples or token:
            return ["safl_top_k / safl_profile_samples / safl_token apply only with [update] selection = \"safl\""]
        return []
    p = []
    if architecture not in ATTENTION_ARCHITECTURES.get(family, ()):
        usable = "; ".join(f"{f}: {', '.join(a)}" for f, a in ATTENTION_ARCHITECTURES.items())
        p.append(f"SAFL selects transformer layers by their attention, and {family} / {architecture} has no attention "
                 f"layers to profile; use static trainable/frozen patterns instead, or an architecture with "
                 f"attention ({usable})")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        p.append(f"safl_top_k must be an integer >= 1 (the layers each site trains per round), got {top_k!r}")
    if isinstance(profile_samples, bool) or not isinstance(profile_samples, int) or profile_samples < 0:
        p.append(f"safl_profile_samples must be an integer >= 1 (0 = {DEFAULT_PROFILE_SAMPLES}), got "
                 f"{profile_samples!r}")
    if token and token not in TOKENS:
        p.append(f"safl_token {token!r} is unknown; use one of {', '.join(TOKENS)}")
    elif token == "entities" and family != "token-classification":
        p.append("safl_token \"entities\" needs gold entity spans: it applies to token-classification only; use "
                 "\"cls\" or \"last\"")
    return p


def composition_problems(strategy: Any, secure_aggregation: bool) -> list[str]:
    """Why SAFL cannot run with this strategy object (empty when it can). Under secure aggregation SAFL runs
    with one weight slot per tensor (fedclinic.secagg.vector_layout): a site sends zeros and weight 0 for the
    layers it did not select, so the sum gives each layer's sum and weight."""
    p = []
    reason = strategy.partial_updates_problem()
    if reason:
        p.append(f"SAFL sites send different layers, and {reason}; use fedavg (or fedavgm, fedadam, fedyogi, "
                 "fedadagrad, median, trimmed-mean, norm-bounded, fedatt per_layer)")
    return p


# tensor-name rules of layer selection (torch-free: the aggregator checks updates with them)

#: the task head of each family: always trained and sent under SAFL (when the static patterns allow it)
HEAD_PATTERNS: dict[str, tuple[str, ...]] = {
    "text-classification": (r"classifier\..*", r"pre_classifier\..*", r"[A-Za-z_]\w*\.pooler\..*"),
    "token-classification": (r"classifier\..*", r"crf\..*"),
    "question-answering": (r"model\.norm\..*", r"transformer\.ln_f\..*"),
}
#: ``<prefix>.<block list>.<index>.``: BERT/RoBERTa/ELECTRA ``encoder.layer``, DistilBERT ``transformer.layer``,
#: GPT-2 ``transformer.h``, Llama-style ``model.layers``
_LAYER = re.compile(r"^(?:[A-Za-z_]\w*\.)?(?:encoder\.layer|transformer\.layer|transformer\.h|h|layers)\.(\d+)\.")


def model_problems(names: Sequence[str], family: str, top_k: int) -> list[str]:
    """Problems of SAFL with a concrete model whose statically selected (trained and sent) tensors are ``names``."""
    layers = candidate_layers(names)
    if not layers:
        return ["SAFL found no transformer layer among the tensors the task trains and sends (names like "
                "'bert.encoder.layer.0.…' or 'model.layers.0.…'); check the trainable/frozen patterns"]
    if top_k > len(layers):
        return [f"safl_top_k is {top_k} but only {len(layers)} layer(s) can be trained ({_fmt_layers(layers)}); "
                f"choose 1..{len(layers)}"]
    return []


def _fmt_layers(layers: Iterable[int]) -> str:
    return "layers " + ", ".join(str(i) for i in sorted(layers))


def layer_of(name: str) -> int | None:
    """The transformer block index a tensor belongs to, or None (embeddings, head, final norm)."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else None


def candidate_layers(names: Iterable[str]) -> dict[int, list[str]]:
    """Layer index -> its tensors among ``names`` (in the given order)."""
    out: dict[int, list[str]] = {}
    for n in names:
        idx = layer_of(n)
        if idx is not None:
            out.setdefault(idx, []).append(n)
    return dict(sorted(out.items()))


def is_head(name: str, family: str) -> bool:
    return any(re.fullmatch(p, name) for p in HEAD_PATTERNS.get(family, ()))


def sendable(names: Sequence[str], family: str) -> list[str]:
    """The tensors a SAFL site may train and send, from the statically selected ``names``: layer tensors and
    the head (what an Assignment offers; each round a site sends the head and its selected layers' tensors)."""
    return [n for n in names if layer_of(n) is not None or is_head(n, family)]


def selected_tensors(names: Sequence[str], family: str, layers: Iterable[int]) -> list[str]:
    """The tensors of ``layers`` plus the head, among ``names`` (order kept)."""
    chosen = set(layers)
    return [n for n in names if layer_of(n) in chosen or is_head(n, family)]


def layers_in_update(names: Iterable[str]) -> list[int]:
    """The layers an update's tensor names touch (ascending)."""
    return sorted({i for i in (layer_of(n) for n in names) if i is not None})


def check_update_layers(names: Iterable[str], top_k: int) -> None:
    """IntegrityError when an update carries tensors of more than ``top_k`` layers."""
    layers = layers_in_update(names)
    if len(layers) > top_k:
        raise IntegrityError(f"the update carries tensors of {len(layers)} layers ({_fmt_layers(layers)}), but the "
                             f"task's SAFL selection sends at most {top_k} per site and round")
