"""Prompt building and the batch layout of answer generation, shared by PyTorch and onnxruntime (numpy only).

The question-answering family generates answers in two places: :class:`fedclinic.models.causal_lm.CausalLMModel`
(PyTorch: training-time evaluation, the export's reference) and :mod:`fedclinic.serving.generate` (onnxruntime:
serving, which must not need torch). Both take every step that decides *which tokens the model sees* from
here, so an exported model is queried exactly as it was trained and evaluated:

- :func:`fill_prompt`: the package's ``prompt`` settings -> the prompt text (one substitution pass);
- :func:`prompt_token_ids` / :func:`truncate_prompts`: ``[bos] + tok(prompt)`` (no special-token template),
  cut from the left to :func:`prompt_budget` tokens;
- :func:`left_pad`: a batch of prompts, left-padded so every prompt ends at the same column, with the attention
  mask and the position ids ``max(cumsum(mask) - 1, 0)`` (padding does not shift positions);
- :func:`generation_steps`: how many tokens may be generated (``max_new_tokens``, never past the model's
  position limit);
- :func:`cut_at_eos` and :func:`decode_answers`: generated ids -> answer text.

Each decoding step after the prompt feeds the chosen token with position ``sum(mask)`` (the count of real
tokens so far) and appends a 1 to the mask, also for rows that already ended (they are fed the padding id).

Nothing here imports torch or transformers.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from fedclinic.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import tokenizers

_PLACEHOLDER = re.compile(r"\{(question|context)\}")


def fill_prompt(prompt_meta: Mapping[str, Any], question: str, context: str = "") -> str:
    """The prompt text for ``question`` (and ``context``) under a package's ``prompt`` settings."""
    template = prompt_meta["context_template"] if context else prompt_meta["template"]
    values = {"question": question, "context": context}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def prompt_budget(max_length: int) -> int:
    """Most prompt tokens a sequence of ``max_length`` keeps (the rest is room for the answer)."""
    return max_length - max(1, max_length // 4)


def text_token_ids(tokenizer: "tokenizers.Tokenizer", texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, without the tokenizer's special-token template (no [CLS], no BOS)."""
    tokenizer.no_truncation()
    return [list(e.ids) for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]


def prompt_token_ids(tokenizer: "tokenizers.Tokenizer", prompt_meta: Mapping[str, Any], bos_id: int | None,
                     questions: Sequence[str], contexts: Sequence[str] | None = None) -> list[list[int]]:
    """``[bos] + tok(fill_prompt(q, c))`` per question, *not* truncated (see :func:`truncate_prompts`).

    ``contexts`` (default: none) must have one entry per question; "" means no context."""
    if isinstance(questions, str):
        raise ConfigError("questions must be a list of strings, not one string")
    contexts = [""] * len(questions) if contexts is None else list(contexts)
    if len(contexts) != len(questions):
        raise ConfigError(f"{len(contexts)} contexts for {len(questions)} questions; give one context per question "
                          "(\"\" for none)")
    bos = [] if bos_id is None else [int(bos_id)]
    texts = [fill_prompt(prompt_meta, q, c) for q, c in zip(questions, contexts)]
    return [bos + ids for ids in text_token_ids(tokenizer, texts)]


def truncate_prompts(prompts: Sequence[Sequence[int]], max_length: int) -> list[list[int]]:
    """Each prompt cut from the left to :func:`prompt_budget` of ``max_length`` tokens (the generation cue at the
    end of the prompt survives)."""
    budget = prompt_budget(max_length)
    return [list(p)[-budget:] for p in prompts]


def check_generation_args(prompts: Sequence[Sequence[int]], *, max_new_tokens: Any, do_sample: bool,
                          temperature: Any, top_p: Any, batch_size: Any) -> None:
    """ConfigError naming the bad argument of a generation call (same rules for PyTorch and onnxruntime)."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if do_sample:
        if not (isinstance(temperature, (int, float)) and temperature > 0):
            raise ConfigError(f"temperature must be > 0 when sampling, got {temperature!r}")
        if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ConfigError(f"top_p must be in (0, 1], got {top_p!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size!r}")
    if any(len(p) == 0 for p in prompts):
        raise ConfigError("a prompt has no tokens; every prompt needs at least one")


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(input_ids, attention_mask, position_ids)``, int64 ``[batch, width]``: every prompt ends at the last
    column; positions count real tokens only (``max(cumsum(mask) - 1, 0)``)."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = np.asarray(list(p), dtype=np.int64)
        mask[i, width - len(p):] = 1
    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0).astype(np.int64)
    return ids, mask, positions


def generation_steps(width: int, max_new_tokens: int, max_positions: int | None) -> int:
    """Tokens that may be generated after a prompt batch of ``width`` columns; ConfigError when none fit."""
    steps = max_new_tokens if max_positions is None else min(max_new_tokens, max_positions - width)
    if steps < 1:
        raise ConfigError(f"a prompt of {width} tokens leaves no room to generate within the model's {max_positions} "
                          "positions; lower max_length")
    return steps


def cut_at_eos(rows: Sequence[Sequence[int]], eos_id: int) -> list[list[int]]:
    """Each row up to (without) its first EOS."""
    out = []
    for row in rows:
        row = [int(t) for t in row]
        out.append(row[:row.index(eos_id)] if eos_id in row else row)
    return out


def decode_answers(tokenizer: "tokenizers.Tokenizer", rows: Sequence[Sequence[int]]) -> list[str]:
    """Generated ids (without the prompt) -> answer text: special tokens dropped, surrounding space stripped."""
    return [tokenizer.decode(list(row), skip_special_tokens=True).strip() for row in rows]


__all__ = ["check_generation_args", "cut_at_eos", "decode_answers", "fill_prompt", "generation_steps", "left_pad",
           "prompt_budget", "prompt_token_ids", "text_token_ids", "truncate_prompts"]
