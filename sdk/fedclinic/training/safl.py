"""SAFL: attention-selected transformer layers (Li & Zhang, "Selective Attention Federated Learning", 2025).

Each round every site profiles the global model's attention on a seeded sample of its own training rows, keeps
the ``top_k`` layers that attend most to task-relevant tokens, trains those layers and the task head, freezes
everything else and sends only what it trained. The aggregator averages each tensor over the sites that sent it.

Score of layer l (the paper's Eq. 1, normalised per example as the spec suggests). For one example x with N real
(non-padding) tokens, H heads and post-softmax attention alpha^l_{h,i,j} from query i to key j::

    A_l(x) = 1/(H N) * sum_h sum_{i real} sum_{j in T(x)} alpha^l_{h,i,j}        in [0, 1]
    A_l    = mean of A_l(x) over the profiled rows P (|P| = min(profile_samples, rows at the site))

T(x), the task-relevant key tokens (``token``):

- ``"cls"``: position 0 ([CLS] of an encoder, BOS of a decoder that has one); the encoder default;
- ``"last"``: the last real token (the pooled token of a causal LM, whose rows see it only from itself); the
  question-answering default;
- ``"entities"``: the tokens inside gold entity spans (token-classification only; the spec's default for
  concept extraction, where every token is classified and [CLS] means little).

Selection: ``S = top_k`` of the *candidate* layers (layers with at least one tensor the task's static patterns
train and send) by A_l, ties to the lower index. The site trains and sends the candidate tensors of the layers in
S plus the task head (:data:`HEAD_PATTERNS`: classifier, pooler, CRF; the final norm of a causal LM). Other
tensors (embeddings, embedding norms) stay frozen, as the spec suggests. The static patterns still apply first:
a frozen tensor never trains, a private one never leaves.

Layer names come from tensor names alone (:func:`layer_of`, no torch), so the aggregator checks updates with the
same code: an update may carry tensors of at most ``top_k`` layers.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.spec.safl_settings import (  # noqa: F401  (the task settings, re-exported)
    ATTENTION_ARCHITECTURES,
    DEFAULT_PROFILE_SAMPLES,
    SAFL,
    SELECTIONS,
    TOKENS,
    SaflConfig,
    composition_problems,
    config_problems,
    default_token,
)
from fedclinic.spec.safl_settings import (  # noqa: F401  (the name rules of layer selection, re-exported)
    HEAD_PATTERNS,
    model_problems,
    layer_of,
    candidate_layers,
    is_head,
    sendable,
    selected_tensors,
    layers_in_update,
    check_update_layers,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

# ---------------------------------------------------------------------------------------------------------------
# profiling


def profile_seed(train_seed: int, round_: int, site: str) -> int:
    """The seed of a site's profiling sample in a round (the agent and the simulator derive it alike)."""
    site_key = int.from_bytes(hashlib.sha256(site.encode()).digest()[:4], "big")
    return int(np.random.SeedSequence([int(train_seed) & 0xFFFFFFFF, int(round_), site_key]).generate_state(1)[0])


def profile_indices(n: int, samples: int, seed: int) -> np.ndarray:
    """Rows profiled: all of them when ``samples >= n``, else a seeded sample without replacement (ascending)."""
    if samples >= n:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=samples, replace=False))


def _relevant_keys(token: str, mask: "torch.Tensor", targets: "torch.Tensor") -> "torch.Tensor":
    """``[B, N]`` float indicator of the task-relevant key positions T(x)."""
    import torch

    rel = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if token == "cls":
        rel[:, 0] = 1.0
    elif token == "last":
        positions = torch.arange(mask.shape[1], device=mask.device)
        last = (mask.long() * positions).argmax(dim=1)
        rel[torch.arange(mask.shape[0], device=mask.device), last] = 1.0
    elif token == "entities":
        if targets.dim() != 2 or targets.shape != mask.shape:
            raise ConfigError("safl_token \"entities\" needs per-token tags (a token-classification dataset)")
        rel = ((targets > 0) & (mask > 0)).float()  # tag 0 is "O"; padding is ignored
    else:
        raise ConfigError(f"safl_token {token!r} is unknown; use one of {', '.join(TOKENS)}")
    return rel * mask.float()


def attention_scores(loaded: Any, data: Any, indices: Sequence[int], token: str, *, batch_size: int = 16) -> np.ndarray:
    """A_l for every transformer layer of ``loaded.module`` (see the module docstring), float64 ``[L]``.

    The module runs in eval mode under eager attention (SDPA returns no weights) without gradients; its attention
    implementation and training mode are restored afterwards.
    """
    import torch

    module = loaded.module
    if not hasattr(module, "set_attn_implementation"):
        raise ConfigError(f"SAFL needs a transformer with attention; {type(module).__name__} has none")
    if len(indices) == 0:
        raise ConfigError("SAFL has no rows to profile; the site's dataset is empty")
    device = next(module.parameters()).device
    previous = module.config._attn_implementation
    was_training = module.training
    totals: "torch.Tensor | None" = None
    module.eval()
    module.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            order = torch.as_tensor(np.asarray(indices), dtype=torch.long)
            for start in range(0, len(order), batch_size):
                (ids, mask, *_), targets = data.batch(order[start:start + batch_size], device)
                att = module(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
                if not att:
                    raise ConfigError(f"{type(module).__name__} returned no attention weights; SAFL cannot profile it")
                keys = _relevant_keys(token, mask, targets)
                queries = mask.float()
                n_real = queries.sum(dim=1).clamp(min=1.0)
                per = torch.stack([torch.einsum("bhij,bi,bj->b", a.float(), queries, keys) / (a.shape[1] * n_real)
                                   for a in att])                     # [L, B]
                batch_sum = per.sum(dim=1).double()
                totals = batch_sum if totals is None else totals + batch_sum
    finally:
        module.set_attn_implementation(previous)
        module.train(was_training)
    assert totals is not None
    return (totals / len(indices)).cpu().numpy()


@dataclass
class LayerSelection:
    """One site's SAFL choice in one round."""

    layers: list[int]                                   # selected layer indices, ascending
    scores: dict[int, float]                            # A_l of every candidate layer
    tensors: list[str] = field(default_factory=list)    # trained and sent this round: selected layers + head

    def metrics(self) -> dict[str, float]:
        """What the site reports with its update: ``safl_score_<l>`` per candidate layer."""
        return {f"safl_score_{layer}": float(s) for layer, s in self.scores.items()}


def top_layers(scores: dict[int, float], k: int) -> list[int]:
    """The ``k`` layers with the highest score, ties to the lower index; returned ascending."""
    if not 1 <= k <= len(scores):
        raise ConfigError(f"safl_top_k must be in 1..{len(scores)} (the candidate layers), got {k}")
    return sorted(sorted(scores, key=lambda layer: (-scores[layer], layer))[:k])


def select_layers(loaded: Any, data: Any, config: SaflConfig, names: Sequence[str], *, seed: int) -> LayerSelection:
    """Profile ``loaded`` (the round's global model) on a seeded sample of ``data`` and choose the layers.

    ``names``: the tensors the task may train and send (the static selection, or an Assignment's send list).
    """
    family = loaded.family
    layers = candidate_layers(names)
    problems = model_problems(names, family, config.top_k)
    if problems:
        raise ConfigError("; ".join(problems))
    scores = attention_scores(loaded, data, profile_indices(len(data), config.profile_samples, seed), config.token)
    if max(layers) >= len(scores):
        raise IntegrityError(f"the model returned attention for {len(scores)} layers but its tensors name layer "
                             f"{max(layers)}")
    candidate = {layer: float(scores[layer]) for layer in layers}
    chosen = top_layers(candidate, config.top_k)
    return LayerSelection(layers=chosen, scores=candidate, tensors=selected_tensors(names, family, chosen))


__all__ = ["ATTENTION_ARCHITECTURES", "HEAD_PATTERNS", "LayerSelection", "SAFL", "SELECTIONS", "SaflConfig", "TOKENS",
           "attention_scores", "candidate_layers", "check_update_layers", "composition_problems", "config_problems",
           "default_token", "is_head", "layer_of", "layers_in_update", "model_problems", "profile_indices",
           "profile_seed", "select_layers", "selected_tensors", "sendable", "top_layers"]
