"""The "text-classification" model family: transformer encoder, LSTM, or logistic regression over tokens.

All three architectures read the same inputs — token ids and an attention mask made by the task's
``tokenizer.json`` (loaded with :func:`tokenizers.Tokenizer.from_str`, never with remote code) — and return
one logit per label. Which one a package holds is written in its ``fedclinic_model.json``::

    {"format": 1, "family": "text-classification", "architecture": "transformer" | "lstm" | "logreg",
     "labels": [...], "multi_label": false, "max_length": 128, "base_model": "...", "arch_config": {...}}

Architectures
-------------
``transformer``
    A Hugging Face ``*ForSequenceClassification`` built with ``AutoConfig.for_model`` and
    ``AutoModelForSequenceClassification.from_config`` for a ``model_type`` in :data:`ALLOWED_MODEL_TYPES`
    (classes that ship inside transformers; no code is ever fetched). The package also holds the HF
    ``config.json``, so a saved package folder loads with ``from_pretrained(folder)``. Tensor names are the
    HF state-dict keys, e.g. for BERT/MiniLM ``bert.embeddings.word_embeddings.weight``,
    ``bert.encoder.layer.{i}.attention.self.query.weight``, ``bert.pooler.dense.weight``,
    ``classifier.weight``. With ``pooling = "mean"`` (a ``config`` key, recorded in ``arch_config``) the head
    reads the masked mean of the last layer instead of the ``[CLS]`` pooler, and the model has no pooler
    (:mod:`fedclinic.models.mean_pooling`; sentence encoders such as all-MiniLM-L6-v2 were trained that way).
``lstm``
    ``embedding -> (Bi)LSTM -> dropout -> linear``; the feature is the final hidden state of the last
    layer (both directions concatenated when bidirectional), computed on packed sequences so padding never
    enters the recurrence. Tensors: ``embedding.weight``, ``lstm.weight_ih_l{k}[_reverse]``, ...,
    ``classifier.weight``, ``classifier.bias``.
``logreg``
    Multinomial logistic regression on token counts: ``logits = C(x) W + b`` where ``C(x)`` is the vector
    of token counts (padding excluded), implemented as ``EmbeddingBag(vocab, labels, mode="sum")``.
    Tensors: ``token_weights.weight`` (vocab x labels) and ``bias``. Initialised at zero (the problem is
    convex, so the seed does not matter).

What every family shares (the loaded model, tokenizers, tensor I/O, checkpoint reading) is in
:mod:`fedclinic.models.base`; this module holds the family's own modules, packaging and building.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.models.mean_pooling import POOLINGS, mean_pooled_classifier_class, pooling_notice, pooling_problem
# ALLOWED_MODEL_TYPES, encode_texts, tokenize_truncated and wordlevel_tokenizer_json are also re-exported here,
# where they were defined before fedclinic.models.base
from fedclinic.models.base import (  # noqa: F401
    ALLOWED_MODEL_TYPES,
    HF_CONFIG_FILE,
    TOKENIZER_FILE,
    TOKENIZER_SIDE_FILES,
    LoadedModel,
    build_loaded,
    check_labels,
    check_max_length,
    check_model_type,
    check_transformer_fits,
    encode_texts,
    hf_config_bytes,
    load_strict,
    load_tensors,
    load_tokenizer,
    map_checkpoint,
    pretrained_tensors,
    module_tensors,
    read_checkpoint,
    seeded,
    tokenize_truncated,
    tokenizer_pad_id,
    wordlevel_tokenizer_json,
)
from fedclinic.transport.package import META_FILE, WEIGHTS_FILE, ModelPackage, meta_bytes

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("fedclinic.models")

FAMILY = "text-classification"
FORMAT = 1
ARCHITECTURES = ("transformer", "lstm", "logreg")

LSTM_DEFAULTS: dict[str, Any] = {
    "embedding_dim": 128,
    "hidden_size": 128,
    "num_layers": 1,
    "bidirectional": True,
    "dropout": 0.1,
}


# ------------------------------------------------------------------------------------------------------------
# our own modules


def _torch():
    import torch

    return torch


def _lstm_class():
    torch = _torch()
    from torch import nn
    from torch.nn.utils.rnn import pack_padded_sequence

    class LSTMClassifier(nn.Module):
        """Embedding -> (Bi)LSTM over packed sequences -> dropout -> linear head."""

        def __init__(self, *, vocab_size: int, num_labels: int, embedding_dim: int, hidden_size: int,
                     num_layers: int, bidirectional: bool, dropout: float, pad_token_id: int) -> None:
            super().__init__()
            self.bidirectional = bool(bidirectional)
            self.embedding = nn.Embedding(vocab_size, embedding_dim, padding_idx=pad_token_id)
            self.lstm = nn.LSTM(embedding_dim, hidden_size, num_layers=num_layers, batch_first=True,
                                bidirectional=bidirectional, dropout=dropout if num_layers > 1 else 0.0)
            self.dropout = nn.Dropout(dropout)
            self.classifier = nn.Linear(hidden_size * (2 if bidirectional else 1), num_labels)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            if torch.compiler.is_exporting():
                return self.classifier(self._features_unpacked(input_ids, attention_mask))
            lengths = attention_mask.sum(dim=1).clamp(min=1).to("cpu", torch.int64)
            packed = pack_padded_sequence(self.embedding(input_ids), lengths, batch_first=True,
                                          enforce_sorted=False)
            _, (h_n, _) = self.lstm(packed)  # h_n: [layers * dirs, batch, hidden], in input order
            feat = torch.cat([h_n[-2], h_n[-1]], dim=-1) if self.bidirectional else h_n[-1]
            return self.classifier(self.dropout(feat))

        def _features_unpacked(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            """The same final hidden states without packing (for ONNX export): :func:`lstm_final_states_unpacked`."""
            return lstm_final_states_unpacked(self.embedding(input_ids), attention_mask, self.lstm, self.bidirectional)

    return LSTMClassifier


def lstm_final_states_unpacked(x: "torch.Tensor", attention_mask: "torch.Tensor", lstm: "torch.nn.LSTM",
                               bidirectional: bool) -> "torch.Tensor":
    """The last layer's final hidden state(s) of a batch-first ``lstm`` over embedded ``x`` ``[B, L, E]``, without
    packing: what ``lstm(pack_padded_sequence(x, lengths))`` gives in ``h_n`` (both directions concatenated when
    ``bidirectional``), for ONNX export, where packed sequences of dynamic lengths cannot be traced (inference
    only: no inter-layer dropout).

    Each direction runs as a one-layer LSTM over the padded batch. The reverse direction runs forward over each
    sequence reversed *within its length* (positions past the length stay in place), so a valid position never
    sees padding; the forward state is read at position ``length - 1``. Exports check this against the packed
    path.
    """
    torch = _torch()
    lengths = attention_mask.sum(dim=1).clamp(min=1)
    steps = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
    inside = steps < lengths.unsqueeze(1)
    rev = torch.where(inside, lengths.unsqueeze(1) - 1 - steps, steps)  # an involution on each row
    hidden = lstm.hidden_size

    def gather(t: "torch.Tensor", index: "torch.Tensor") -> "torch.Tensor":
        return torch.gather(t, 1, index.unsqueeze(-1).expand(-1, -1, t.shape[-1]))

    def run(inp: "torch.Tensor", layer: int, suffix: str) -> "torch.Tensor":
        weights = [getattr(lstm, f"{kind}_l{layer}{suffix}") for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
        zeros = inp.new_zeros(1, inp.shape[0], hidden)
        out, _, _ = torch.lstm(inp, (zeros, zeros), weights, True, 1, 0.0, False, False, True)
        return out

    for layer in range(lstm.num_layers):
        forward_out = run(x, layer, "")
        if bidirectional:
            backward_out = gather(run(gather(x, rev), layer, "_reverse"), rev)
            x = torch.cat([forward_out, backward_out], dim=-1)
        else:
            x = forward_out
    last = (lengths - 1).unsqueeze(1)
    h_forward = gather(forward_out, last).squeeze(1)
    if not bidirectional:
        return h_forward
    return torch.cat([h_forward, backward_out[:, 0]], dim=-1)


def _logreg_class():
    torch = _torch()
    from torch import nn

    class BagOfTokensLogReg(nn.Module):
        """logits = counts(x) @ W + b, with counts over non-padding tokens (EmbeddingBag, mode="sum")."""

        def __init__(self, *, vocab_size: int, num_labels: int) -> None:
            super().__init__()
            self.token_weights = nn.EmbeddingBag(vocab_size, num_labels, mode="sum")
            self.bias = nn.Parameter(torch.zeros(num_labels))
            nn.init.zeros_(self.token_weights.weight)

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            weights = attention_mask.to(self.token_weights.weight.dtype)
            return self.token_weights(input_ids, per_sample_weights=weights) + self.bias

    return BagOfTokensLogReg


def _check_architecture(architecture: str) -> str:
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"unknown architecture {architecture!r} for family {FAMILY!r}; "
                          f"choose one of: {', '.join(ARCHITECTURES)}")
    return architecture


# ------------------------------------------------------------------------------------------------------------
# transformer


def _hf_config(config_dict: Mapping[str, Any], labels: Sequence[str], multi_label: bool):
    from transformers import AutoConfig

    d = dict(config_dict)
    model_type = check_model_type(d.pop("model_type", None))
    for key in ("_name_or_path", "auto_map", "trust_remote_code"):
        d.pop(key, None)
    d["id2label"] = {i: lab for i, lab in enumerate(labels)}
    d["label2id"] = {lab: i for i, lab in enumerate(labels)}
    d["num_labels"] = len(labels)
    d["problem_type"] = "multi_label_classification" if multi_label else "single_label_classification"
    try:
        return AutoConfig.for_model(model_type, **d)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid {model_type} config: {exc}") from None


def _transformer_config_bytes(module, pooling: str) -> bytes:
    # a mean-pooled classifier is not a Hugging Face class; its encoder is (the head is fedclinic's)
    return hf_config_bytes(module, type(module.encoder).__name__ if pooling == "mean" else None)


def _pop_pooling(config: dict[str, Any]) -> str:
    """Remove and check the ``pooling`` key of a transformer ``config`` (default ``cls``)."""
    pooling = config.pop("pooling", "cls")
    problem = pooling_problem(pooling)
    if problem:
        raise ConfigError(problem)
    return pooling


def _transformer_arch_config(model_type: str, pooling: str) -> dict[str, Any]:
    # the [CLS] form records no pooling key, so packages made before mean pooling existed keep their hash
    return {"model_type": model_type, **({"pooling": pooling} if pooling != "cls" else {})}


def _build_hf_module(config, seed: int, pooling: str = "cls"):
    from transformers import AutoModelForSequenceClassification

    with seeded(seed):
        if pooling == "mean":
            module = mean_pooled_classifier_class()(config)
        else:
            module = AutoModelForSequenceClassification.from_config(config)
    return module.float()


# ------------------------------------------------------------------------------------------------------------
# public: packaging


def package_pretrained(
    path: str | Path,
    *,
    labels: Sequence[str],
    architecture: str = "transformer",
    multi_label: bool = False,
    max_length: int = 128,
    seed: int = 0,
    config: Mapping[str, Any] | None = None,
) -> ModelPackage:
    """Package a local Hugging Face folder (``config.json`` + safetensors + ``tokenizer.json``) for a task.

    ``transformer``: the encoder weights come from the folder; the new classification head (and a pooler if
    the checkpoint has none) is initialised from ``seed`` (same seed, same package hash). ``config``
    overrides HF config fields that do not change shapes (e.g. ``{"hidden_dropout_prob": 0.0}``) and may set
    ``pooling``: ``"cls"`` (default, HF's pooler) or ``"mean"`` (:mod:`fedclinic.models.mean_pooling`).
    ``lstm`` / ``logreg``: only the folder's tokenizer is used; ``config`` sets the architecture's fields.
    Nothing is downloaded; nothing but JSON and safetensors is read.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"pretrained model folder {folder} does not exist; give a local folder with "
                          f"{HF_CONFIG_FILE}, {WEIGHTS_FILE} and {TOKENIZER_FILE}")
    _check_architecture(architecture)
    tok_path = folder / TOKENIZER_FILE
    if not tok_path.is_file():
        raise ConfigError(f"{folder} has no {TOKENIZER_FILE}; save a fast tokenizer there once with "
                          "tokenizer.save_pretrained(folder)")
    tokenizer_json = tok_path.read_bytes()
    cfg_path = folder / HF_CONFIG_FILE
    hf_cfg: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    base_model = str(hf_cfg.get("_name_or_path") or folder.name)
    side_files = {n: (folder / n).read_bytes() for n in TOKENIZER_SIDE_FILES if (folder / n).is_file()}
    if architecture != "transformer":
        pkg = package_from_config(architecture=architecture, labels=labels, tokenizer_json=tokenizer_json,
                                  config=dict(config or {}), multi_label=multi_label, max_length=max_length,
                                  seed=seed, base_model=base_model)
        pkg.files.update(side_files)
        return pkg
    if not cfg_path.is_file():
        raise ConfigError(f"{folder} has no {HF_CONFIG_FILE}; a transformer folder needs its Hugging Face config")
    labels = check_labels(labels, multi_label)
    check_max_length(max_length)
    merged = {**hf_cfg, **dict(config or {})}
    pooling = _pop_pooling(merged)
    notice = pooling_notice(folder, pooling)
    if notice is not None:
        log.info("%s", notice)
    hf_config = _hf_config(merged, labels, multi_label)
    tokenizer = load_tokenizer(tokenizer_json)
    check_transformer_fits(hf_config, tokenizer.get_vocab_size(with_added_tokens=True), max_length)
    checkpoint = read_checkpoint(folder)
    module, tensors = pretrained_tensors(lambda: _build_hf_module(hf_config, seed, pooling), checkpoint, seed,
                                         _initialise_head)
    meta = _meta(architecture, labels, multi_label, max_length, base_model,
                 _transformer_arch_config(hf_config.model_type, pooling))
    files = {META_FILE: meta_bytes(meta), TOKENIZER_FILE: tokenizer_json,
             HF_CONFIG_FILE: _transformer_config_bytes(module, pooling),
             **side_files}
    return ModelPackage(tensors=tensors, files=files)


def _initialise_head(module, owner) -> None:
    """Hugging Face's initialisation of one new module of a pretrained classifier (a mean-pooled classifier
    is not a Hugging Face model: its encoder's rule, the same normal(0, initializer_range) weights and zero biases)."""
    init = getattr(module, "_init_weights", None) or module.encoder._init_weights
    init(owner)


def package_from_config(
    *,
    architecture: str,
    labels: Sequence[str],
    tokenizer_json: bytes,
    config: Mapping[str, Any],
    multi_label: bool = False,
    max_length: int = 128,
    seed: int = 0,
    base_model: str = "from-config",
) -> ModelPackage:
    """A freshly initialised model (seeded) from an architecture config — tiny models for tests and baselines.

    ``transformer``: ``config`` is an HF config dict with ``model_type`` (e.g. ``{"model_type": "bert",
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}``, plus
    an optional ``pooling``: ``"cls"`` or ``"mean"``); ``vocab_size`` and ``pad_token_id`` default to the
    tokenizer's. ``lstm``: keys of :data:`LSTM_DEFAULTS`.
    ``logreg``: no keys. ``vocab_size`` always comes from the tokenizer for lstm/logreg.
    """
    _check_architecture(architecture)
    labels = check_labels(labels, multi_label)
    check_max_length(max_length)
    if isinstance(tokenizer_json, str):
        tokenizer_json = tokenizer_json.encode("utf-8")
    tokenizer = load_tokenizer(tokenizer_json)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    pad_id = tokenizer_pad_id(tokenizer_json)
    config = dict(config or {})
    files = {TOKENIZER_FILE: bytes(tokenizer_json)}
    if architecture == "transformer":
        config.setdefault("vocab_size", vocab_size)
        config.setdefault("pad_token_id", pad_id)
        pooling = _pop_pooling(config)
        hf_config = _hf_config(config, labels, multi_label)
        check_transformer_fits(hf_config, vocab_size, max_length)
        module = _build_hf_module(hf_config, seed, pooling)
        arch_config: dict[str, Any] = _transformer_arch_config(hf_config.model_type, pooling)
        files[HF_CONFIG_FILE] = _transformer_config_bytes(module, pooling)
    else:
        arch_config = _arch_config(architecture, config, vocab_size, pad_id)
        with seeded(seed):
            module = _build_own_module(architecture, arch_config, len(labels))
    meta = _meta(architecture, labels, multi_label, max_length, base_model, arch_config)
    files[META_FILE] = meta_bytes(meta)
    return ModelPackage(tensors=module_tensors(module), files=files)


def _meta(architecture: str, labels: list[str], multi_label: bool, max_length: int, base_model: str,
          arch_config: Mapping[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "family": FAMILY, "architecture": architecture, "labels": list(labels),
            "multi_label": bool(multi_label), "max_length": int(max_length), "base_model": base_model,
            "arch_config": dict(arch_config)}


def _arch_config(architecture: str, config: Mapping[str, Any], vocab_size: int, pad_id: int) -> dict[str, Any]:
    config = dict(config)
    config.pop("vocab_size", None)
    config.pop("pad_token_id", None)
    if architecture == "logreg":
        if config:
            raise ConfigError(f"logreg takes no config keys, got {sorted(config)}")
        return {"vocab_size": vocab_size}
    unknown = sorted(set(config) - set(LSTM_DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown lstm config key(s) {unknown}; allowed: {sorted(LSTM_DEFAULTS)}")
    out = {**LSTM_DEFAULTS, **config, "vocab_size": vocab_size, "pad_token_id": pad_id}
    for key in ("embedding_dim", "hidden_size", "num_layers"):
        if not isinstance(out[key], int) or isinstance(out[key], bool) or out[key] < 1:
            raise ConfigError(f"lstm {key} must be a positive integer, got {out[key]!r}")
    if not isinstance(out["bidirectional"], bool):
        raise ConfigError(f"lstm bidirectional must be true or false, got {out['bidirectional']!r}")
    if not isinstance(out["dropout"], (int, float)) or not 0.0 <= float(out["dropout"]) < 1.0:
        raise ConfigError(f"lstm dropout must be in [0, 1), got {out['dropout']!r}")
    out["dropout"] = float(out["dropout"])
    return out


def _build_own_module(architecture: str, arch_config: Mapping[str, Any], num_labels: int):
    try:
        if architecture == "lstm":
            kw = {k: arch_config[k] for k in (*LSTM_DEFAULTS, "vocab_size", "pad_token_id")}
            return _lstm_class()(num_labels=num_labels, **kw)
        return _logreg_class()(vocab_size=int(arch_config["vocab_size"]), num_labels=num_labels)
    except KeyError as exc:
        raise IntegrityError(f"fedclinic_model.json arch_config lacks {exc} for architecture {architecture!r}") from None


# ------------------------------------------------------------------------------------------------------------
# public: building


def build(package: ModelPackage) -> LoadedModel:
    """Build the module of a text-classification package and load its tensors strictly."""
    meta = package.meta
    architecture = _check_architecture(meta.get("architecture"))
    labels = meta.get("labels")
    if not isinstance(labels, list):
        raise IntegrityError(f"{META_FILE} has no label list")
    multi_label = bool(meta.get("multi_label", False))
    labels = check_labels(labels, multi_label)
    tok_bytes = package.files.get(TOKENIZER_FILE)
    if tok_bytes is None:
        raise IntegrityError(f"the package has no {TOKENIZER_FILE}; every text model carries its tokenizer")
    tokenizer = load_tokenizer(tok_bytes)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    if architecture == "transformer":
        raw = package.files.get(HF_CONFIG_FILE)
        if raw is None:
            raise IntegrityError(f"a transformer package needs {HF_CONFIG_FILE}")
        hf = json.loads(raw)
        declared = (meta.get("arch_config") or {}).get("model_type")
        pooling = (meta.get("arch_config") or {}).get("pooling", "cls")
        if pooling not in POOLINGS:
            raise IntegrityError(f"{META_FILE} declares pooling {pooling!r}; this version knows {list(POOLINGS)}")
        check_model_type(hf.get("model_type"))
        if declared is not None and declared != hf.get("model_type"):
            raise IntegrityError(f"{META_FILE} says model_type {declared!r} but {HF_CONFIG_FILE} says "
                                 f"{hf.get('model_type')!r}")
        config = _hf_config(hf, labels, multi_label)
        if int(config.vocab_size) < vocab_size:
            raise IntegrityError(f"{TOKENIZER_FILE} has {vocab_size} tokens but the model's vocab_size is "
                                 f"{config.vocab_size}")
        module = build_loaded(lambda: _build_hf_module(config, 0, pooling), package.tensors)
    else:
        arch = dict(meta.get("arch_config") or {})
        if int(arch.get("vocab_size", -1)) != vocab_size:
            raise IntegrityError(f"{META_FILE} declares vocab_size {arch.get('vocab_size')} but {TOKENIZER_FILE} "
                                 f"has {vocab_size} tokens")
        with seeded(0):  # the initial values are overwritten; seeding keeps the caller's RNG untouched
            module = _build_own_module(architecture, arch, len(labels))
        load_strict(module, package.tensors)
    module.eval()
    return LoadedModel(module=module, tokenizer=tokenizer, meta=meta, pad_id=tokenizer_pad_id(tok_bytes))


