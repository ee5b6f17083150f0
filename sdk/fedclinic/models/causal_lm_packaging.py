"""Packaging a causal language model for the question-answering family (see :mod:`fedclinic.models.causal_lm`).

:func:`package_qa_pretrained` reads a local Hugging Face folder (``config.json``, safetensors weights,
``tokenizer.json`` and optional ``tokenizer_config.json`` / ``chat_template.jinja``); nothing is downloaded
and no code from the folder runs. :func:`package_qa_from_config` makes a freshly initialised, seeded model
from an HF config dict (tiny test models). Both return a :class:`~fedclinic.transport.package.ModelPackage`
whose ``fedclinic_model.json`` fixes, once and for all:

- the prompt (:func:`plain_prompt`, or the tokenizer's chat template rendered once by :func:`chat_prompt`),
  so training, evaluation, serving and export build byte-identical prompts without a template engine;
- the special tokens: EOS (required), BOS (only when the tokenizer adds one) and the padding id;
- the generation settings (``max_new_tokens``, ``eval_examples``).

Bad arguments or a folder that cannot be packaged raise ConfigError; weights that do not match the folder's
config raise IntegrityError. The stored tensors are :func:`~fedclinic.models.causal_lm_module.stored_names`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.models.base import (
    HF_CONFIG_FILE,
    TOKENIZER_FILE,
    check_max_length,
    format_names,
    hf_config_bytes,
    load_tensors,
    load_tokenizer,
    max_positions,
    module_tensors,
    read_checkpoint,
)
from fedclinic.models.causal_lm_module import (
    EVAL_EXAMPLES,
    FORMAT,
    FAMILY,
    MAX_NEW_TOKENS,
    build_module,
    hf_lm_config,
    stored_names,
)
from fedclinic.transport.package import META_FILE, WEIGHTS_FILE, ModelPackage, meta_bytes

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
#: plain-JSON/text tokenizer side files copied from a pretrained folder (the package stays a usable HF folder)
_SIDE_FILES = (TOKENIZER_CONFIG_FILE, "special_tokens_map.json", CHAT_TEMPLATE_FILE, "generation_config.json")
PLAIN_TEMPLATE = "Question: {question}\nAnswer:"
PLAIN_CONTEXT_TEMPLATE = "Context: {context}\nQuestion: {question}\nAnswer:"
CHAT_USER_CONTENT = "{question}"
CHAT_USER_CONTENT_WITH_CONTEXT = "Context: {context}\nQuestion: {question}"
PROMPT_CHOICES = ("auto", "chat", "plain")
_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|im_end|>", "<|end_of_text|>", "[EOS]", "<EOS>")
_PAD_CANDIDATES = ("<pad>", "[PAD]", "<PAD>", "<|pad|>")


# ------------------------------------------------------------------------------------------------------------
# prompt (fill_prompt, prompt_budget and the token layout live in fedclinic.data.qa_prompt, shared with the
# onnxruntime generation loop of an exported model)


def plain_prompt() -> dict[str, Any]:
    return {"source": "plain", "template": PLAIN_TEMPLATE, "context_template": PLAIN_CONTEXT_TEMPLATE,
            "answer_prefix": " "}


def chat_prompt(chat_template: str, special_tokens: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Render ``chat_template`` once for a user turn holding the placeholders, plus the generation prompt.

    Uses transformers' sandboxed jinja2 renderer (nothing is fetched). Raises ConfigError when the template
    does not render or does not keep the user's text verbatim (then package with ``prompt="plain"``)."""
    out = {"source": "chat_template", "answer_prefix": ""}
    for key, content, needed in (("template", CHAT_USER_CONTENT, ("{question}",)),
                                 ("context_template", CHAT_USER_CONTENT_WITH_CONTEXT, ("{context}", "{question}"))):
        try:
            text = _render_chat(chat_template, [{"role": "user", "content": content}], dict(special_tokens or {}))
        except Exception as exc:  # jinja2 template and sandbox errors, a missing jinja2
            raise ConfigError(f"the tokenizer's chat template does not render ({type(exc).__name__}: {exc}); "
                              "package the model with prompt=\"plain\"") from None
        for ph in needed:
            if text.count(ph) != 1:
                raise ConfigError(f"the tokenizer's chat template does not keep the user's message verbatim "
                                  f"({ph} appears {text.count(ph)} times in {text!r}); package the model with "
                                  "prompt=\"plain\"")
        out[key] = text
    return out


def _render_chat(chat_template: str, messages: list[dict[str, str]], special_tokens: dict[str, str]) -> str:
    try:
        from transformers.utils.chat_template_utils import render_jinja_template
    except ImportError:  # transformers < 4.49: the compiled template is there, the wrapper is not
        from transformers.utils.chat_template_utils import _compile_jinja_template

        return _compile_jinja_template(chat_template).render(messages=messages, add_generation_prompt=True,
                                                             **special_tokens)
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=chat_template,
                                        add_generation_prompt=True, **special_tokens)
    return rendered[0]


# ------------------------------------------------------------------------------------------------------------
# packaging


def _token_name(value: Any) -> str | None:
    """A special token from ``tokenizer_config.json``: a string or an AddedToken dict ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _special_ids(tokenizer, tokenizer_config: Mapping[str, Any], hf_config: Mapping[str, Any],
                 eos_token: str | None) -> dict[str, Any]:
    """EOS (required), BOS (only when the tokenizer adds one) and the padding id."""
    def tid(name: str | None) -> int | None:
        return None if name is None else tokenizer.token_to_id(name)

    if eos_token is not None:
        if tid(eos_token) is None:
            raise ConfigError(f"eos_token {eos_token!r} is not in the tokenizer's vocabulary")
        eos = eos_token
    else:
        eos = _token_name(tokenizer_config.get("eos_token"))
        if eos is None or tid(eos) is None:
            cfg_eos = hf_config.get("eos_token_id")
            cfg_eos = cfg_eos[0] if isinstance(cfg_eos, list) and cfg_eos else cfg_eos
            eos = tokenizer.id_to_token(cfg_eos) if isinstance(cfg_eos, int) else None
        if eos is None or tid(eos) is None:
            eos = next((c for c in _EOS_CANDIDATES if tid(c) is not None), None)
        if eos is None:
            raise ConfigError("cannot tell the tokenizer's end-of-sequence token (no eos_token in "
                              f"{TOKENIZER_CONFIG_FILE}, no eos_token_id in {HF_CONFIG_FILE}, none of "
                              f"{', '.join(_EOS_CANDIDATES)} in the vocabulary); pass eos_token=")
    eos_id = int(tid(eos))
    bos_id = None
    if tokenizer_config.get("add_bos_token"):
        bos = _token_name(tokenizer_config.get("bos_token"))
        if bos is None or tid(bos) is None:
            raise ConfigError(f"{TOKENIZER_CONFIG_FILE} sets add_bos_token but its bos_token is not in the vocabulary")
        bos_id = int(tid(bos))
    pad = _token_name(tokenizer_config.get("pad_token"))
    pad_id = tid(pad) if pad else None
    if pad_id is None:
        pad_id = next((tid(c) for c in _PAD_CANDIDATES if tid(c) is not None), None)
    return {"eos_token": eos, "eos_token_id": eos_id, "bos_token_id": bos_id,
            "pad_token_id": int(eos_id if pad_id is None else pad_id)}


def _resolve_prompt(prompt: str, chat_template: str | None, tokenizer_config: Mapping[str, Any]) -> dict[str, Any]:
    if prompt not in PROMPT_CHOICES:
        raise ConfigError(f"prompt must be one of {', '.join(PROMPT_CHOICES)}, got {prompt!r}")
    if prompt == "plain" or (prompt == "auto" and not chat_template):
        return plain_prompt()
    if not chat_template:
        raise ConfigError(f"prompt=\"chat\" but the tokenizer has no chat template ({TOKENIZER_CONFIG_FILE} "
                          f"chat_template or {CHAT_TEMPLATE_FILE}); use prompt=\"plain\"")
    specials = {k: name for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                if (name := _token_name(tokenizer_config.get(k))) is not None}
    return chat_prompt(chat_template, specials)


def _check_generation(max_new_tokens: int, eval_examples: int) -> dict[str, int]:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not isinstance(eval_examples, int) or isinstance(eval_examples, bool) or eval_examples < 0:
        raise ConfigError(f"eval_examples must be an integer >= 0 (0 = no generation in evaluation), got "
                          f"{eval_examples!r}")
    return {"max_new_tokens": max_new_tokens, "eval_examples": eval_examples}


def _check_fits(config, vocab_size: int, max_length: int) -> None:
    if int(config.vocab_size) < vocab_size:
        raise ConfigError(f"the tokenizer has {vocab_size} tokens but the model's vocab_size is {config.vocab_size}; "
                          "use the tokenizer the model was trained with or raise vocab_size")
    limit = max_positions(config)
    if limit is not None and max_length > limit:
        raise ConfigError(f"max_length {max_length} exceeds what the model supports ({limit} positions); "
                          "lower max_length")


def _meta(max_length: int, base_model: str, model_type: str, specials: Mapping[str, Any],
          prompt: Mapping[str, Any], generation: Mapping[str, int]) -> dict[str, Any]:
    return {"format": FORMAT, "family": FAMILY, "architecture": "causal-lm", "labels": [], "multi_label": False,
            "max_length": int(max_length), "base_model": base_model, "arch_config": {"model_type": model_type},
            **dict(specials), "prompt": dict(prompt), "generation": dict(generation)}


def package_qa_from_config(*, tokenizer_json: bytes | str, config: Mapping[str, Any], max_length: int = 128,
                           seed: int = 0, base_model: str = "from-config", eos_token: str | None = None,
                           chat_template: str | None = None, prompt: str = "auto",
                           max_new_tokens: int = MAX_NEW_TOKENS, eval_examples: int = EVAL_EXAMPLES) -> ModelPackage:
    """A freshly initialised (seeded) causal LM from an HF config dict with ``model_type`` — tiny test models.

    ``vocab_size`` defaults to the tokenizer's, ``bos_token_id``/``eos_token_id``/``pad_token_id`` to the
    tokenizer's EOS (``eos_token``, else a conventional name such as ``</s>``) and padding token. ``prompt``:
    ``"auto"`` uses ``chat_template`` when given, else the plain template.
    """
    check_max_length(max_length)
    if isinstance(tokenizer_json, str):
        tokenizer_json = tokenizer_json.encode("utf-8")
    tokenizer = load_tokenizer(tokenizer_json)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    specials = _special_ids(tokenizer, {}, {}, eos_token)
    cfg = dict(config)
    cfg.setdefault("vocab_size", vocab)
    for key in ("bos_token_id", "eos_token_id"):
        cfg.setdefault(key, specials["eos_token_id"])
    cfg.setdefault("pad_token_id", specials["pad_token_id"])
    hf_config = hf_lm_config(cfg)
    _check_fits(hf_config, vocab, max_length)
    prompt_meta = _resolve_prompt(prompt, chat_template, {"eos_token": specials["eos_token"]})
    generation = _check_generation(max_new_tokens, eval_examples)
    module = build_module(hf_config, seed)
    meta = _meta(max_length, base_model, hf_config.model_type, specials, prompt_meta, generation)
    files = {META_FILE: meta_bytes(meta), TOKENIZER_FILE: bytes(tokenizer_json),
             HF_CONFIG_FILE: hf_config_bytes(module)}
    return ModelPackage(tensors=module_tensors(module, stored_names(module)), files=files)


def package_qa_pretrained(path: str | Path, *, max_length: int = 128, prompt: str = "auto",
                          eos_token: str | None = None, max_new_tokens: int = MAX_NEW_TOKENS,
                          eval_examples: int = EVAL_EXAMPLES, config: Mapping[str, Any] | None = None) -> ModelPackage:
    """Package a local Hugging Face causal-LM folder for a question-answering task.

    Reads only ``config.json``, safetensors weights (``model.safetensors`` or a sharded index),
    ``tokenizer.json`` and, when present, ``tokenizer_config.json`` / ``chat_template.jinja`` (EOS/BOS tokens and
    the chat template; ``prompt="auto"`` uses the chat template when there is one). Nothing is downloaded and no
    code from the folder runs. ``config`` overrides HF config fields that do not change shapes.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"pretrained model folder {folder} does not exist; give a local folder with "
                          f"{HF_CONFIG_FILE}, {WEIGHTS_FILE} and {TOKENIZER_FILE}")
    for name in (HF_CONFIG_FILE, TOKENIZER_FILE):
        if not (folder / name).is_file():
            raise ConfigError(f"{folder} has no {name}; a causal LM folder needs its Hugging Face config and a "
                              "fast tokenizer's tokenizer.json (save them once with save_pretrained)")
    check_max_length(max_length)
    hf_cfg = _read_json(folder / HF_CONFIG_FILE)
    tok_cfg = _read_json(folder / TOKENIZER_CONFIG_FILE) if (folder / TOKENIZER_CONFIG_FILE).is_file() else {}
    chat_template = tok_cfg.get("chat_template")
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        chat_template = (folder / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    if chat_template is not None and not isinstance(chat_template, str):  # a list of named templates
        named = {t.get("name"): t.get("template") for t in chat_template if isinstance(t, dict)}
        chat_template = named.get("default")
    tokenizer_json = (folder / TOKENIZER_FILE).read_bytes()
    tokenizer = load_tokenizer(tokenizer_json)
    specials = _special_ids(tokenizer, tok_cfg, hf_cfg, eos_token)
    hf_config = hf_lm_config({**hf_cfg, **dict(config or {})})
    _check_fits(hf_config, tokenizer.get_vocab_size(with_added_tokens=True), max_length)
    prompt_meta = _resolve_prompt(prompt, chat_template, tok_cfg)
    generation = _check_generation(max_new_tokens, eval_examples)
    module = build_module(hf_config, 0)
    load_tensors(module, _map_checkpoint(module, read_checkpoint(folder)))
    meta = _meta(max_length, str(hf_cfg.get("_name_or_path") or folder.name), hf_config.model_type, specials,
                 prompt_meta, generation)
    files = {META_FILE: meta_bytes(meta), TOKENIZER_FILE: tokenizer_json, HF_CONFIG_FILE: hf_config_bytes(module),
             **{n: (folder / n).read_bytes() for n in _SIDE_FILES if (folder / n).is_file()}}
    return ModelPackage(tensors=module_tensors(module, stored_names(module)), files=files)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return doc


def _map_checkpoint(module, checkpoint: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Checkpoint names -> the module's stored names (with or without the base-model prefix, e.g.
    ``transformer.`` for original GPT-2 files). Every stored tensor must be there with its shape; extra
    checkpoint entries (old attention-mask buffers, a saved copy of a tied head) are ignored."""
    state = module.state_dict()
    prefix = getattr(module, "base_model_prefix", "") or ""
    mapped: dict[str, np.ndarray] = {}
    for name in stored_names(module):
        if name in checkpoint:
            mapped[name] = checkpoint[name]
        elif prefix and name.startswith(prefix + ".") and name[len(prefix) + 1:] in checkpoint:
            mapped[name] = checkpoint[name[len(prefix) + 1:]]
    missing = [n for n in stored_names(module) if n not in mapped]
    if missing:
        raise IntegrityError(f"the pretrained weights lack tensor(s) {format_names(missing)}; the folder does not match "
                             "its config.json (wrong model_type or a different model)")
    bad = [f"{n} {tuple(a.shape)} != model {tuple(state[n].shape)}" for n, a in mapped.items()
           if tuple(a.shape) != tuple(state[n].shape)]
    if bad:
        raise IntegrityError(f"pretrained tensor shape mismatch: {format_names(bad)}")
    return mapped



__all__ = ["CHAT_TEMPLATE_FILE", "PLAIN_CONTEXT_TEMPLATE", "PLAIN_TEMPLATE", "PROMPT_CHOICES", "TOKENIZER_CONFIG_FILE",
           "chat_prompt", "package_qa_from_config", "package_qa_pretrained", "plain_prompt"]
