"""The question-answering family's identity and its torch module, shared by packaging and building.

What both :mod:`fedclinic.models.causal_lm_packaging` (making a package) and :mod:`fedclinic.models.causal_lm`
(building a package's model) need, so neither imports the other's internals:

- the family's name, format, architectures and the generation defaults of ``fedclinic_model.json``;
- the Hugging Face ``model_type`` values whose ``*ForCausalLM`` classes may be built
  (:data:`ALLOWED_MODEL_TYPES`: classes that ship inside transformers; no code is ever fetched or run);
- :func:`hf_lm_config`: an HF config dict -> a transformers config, with every remote-code and head-shaping
  key dropped; ConfigError for a disallowed ``model_type`` or an invalid config;
- :func:`build_module`: the seeded ``AutoModelForCausalLM.from_config`` module, in float32;
- :func:`stored_names`: the tensors a package holds, i.e. every state-dict entry except tied aliases
  (:func:`tied_aliases`, e.g. an ``lm_head.weight`` that is the input embedding), which are stored once.

Importing this module imports neither torch nor transformers; they load when a module is built.
"""

from __future__ import annotations

from typing import Any, Mapping

from fedclinic.errors import ConfigError
from fedclinic.models.base import seeded

FAMILY = "question-answering"
FORMAT = 1
ARCHITECTURES = ("causal-lm",)
#: HF ``model_type`` values whose causal-LM classes may be built (GPT-2 family; Llama, e.g. SmolLM2).
ALLOWED_MODEL_TYPES = ("gpt2", "llama")
#: how many evaluation examples get a generated answer by default (generation dominates evaluation time)
EVAL_EXAMPLES = 32
#: default cap on generated tokens per answer
MAX_NEW_TOKENS = 64


def check_architecture(architecture: Any) -> str:
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"unknown architecture {architecture!r} for family {FAMILY!r}; "
                          f"choose one of: {', '.join(ARCHITECTURES)}")
    return str(architecture)


def check_model_type(model_type: Any) -> str:
    if model_type not in ALLOWED_MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not allowed for the causal-lm architecture; allowed: "
                          f"{', '.join(ALLOWED_MODEL_TYPES)} (classes built into transformers; no remote code is "
                          "ever run)")
    return str(model_type)


def hf_lm_config(config_dict: Mapping[str, Any]):
    from transformers import AutoConfig

    d = dict(config_dict)
    model_type = check_model_type(d.pop("model_type", None))
    for key in ("_name_or_path", "auto_map", "trust_remote_code", "architectures", "quantization_config",
                "id2label", "label2id", "num_labels", "problem_type"):
        d.pop(key, None)
    try:
        return AutoConfig.for_model(model_type, **d)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid {model_type} config: {exc}") from None


def build_module(config, seed: int):
    from transformers import AutoModelForCausalLM

    with seeded(seed):
        module = AutoModelForCausalLM.from_config(config)
    return module.float()


def tied_aliases(module) -> list[str]:
    """State-dict names that are the same tensor as an earlier name (tied output embeddings): not stored."""
    seen: dict[tuple[int, tuple[int, ...]], str] = {}
    aliases = []
    for name, t in module.state_dict().items():
        if t.numel() == 0:
            continue
        key = (t.data_ptr(), tuple(t.shape))
        if key in seen:
            aliases.append(name)
        else:
            seen[key] = name
    return aliases


def stored_names(module) -> list[str]:
    """The tensors a package holds: every state-dict entry except tied aliases."""
    aliases = set(tied_aliases(module))
    return [n for n in module.state_dict() if n not in aliases]



__all__ = ["ALLOWED_MODEL_TYPES", "ARCHITECTURES", "EVAL_EXAMPLES", "FAMILY", "FORMAT", "MAX_NEW_TOKENS",
           "build_module", "check_architecture", "check_model_type", "hf_lm_config", "stored_names", "tied_aliases"]
