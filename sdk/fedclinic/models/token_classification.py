"""The "token-classification" model family (named-entity recognition): a tag per token, entities as spans.

A task's labels are entity types (e.g. ``["DRUG", "CONDITION"]``); the tag set is derived from them and a tag
scheme (:func:`fedclinic.data.ner_tags.tag_set`: ``O`` first, then ``B-``/``I-`` (BIO) or ``B-``/``I-``/``E-``/``S-``
(BIOES) per type). ``fedclinic_model.json``::

    {"format": 1, "family": "token-classification",
     "architecture": "transformer" | "transformer-crf" | "cnn-bilstm-crf",
     "labels": ["DRUG", ...], "scheme": "BIO", "tags": ["O", "B-DRUG", ...], "max_length": 128,
     "base_model": "...", "arch_config": {"model_type": "bert"}}   (cnn-bilstm-crf: its hyperparameters)

Architectures
-------------
``transformer``
    A Hugging Face ``*ForTokenClassification`` (built with ``AutoModelForTokenClassification.from_config`` for
    a ``model_type`` in :data:`ALLOWED_MODEL_TYPES`); emissions = ``classifier(encoder(x))``, ``[B, L, tags]``.
    Loss: token cross-entropy over non-padding positions; decoding: argmax per token.
``transformer-crf``
    The same encoder and linear head, followed by a linear-chain CRF (:class:`fedclinic.models.crf.CRF`,
    tensors ``crf.*``). Loss: the CRF's negative log-likelihood per sequence (mean over the batch);
    decoding: Viterbi.
``cnn-bilstm-crf``
    The FedNER tagger (:mod:`fedclinic.models.fedner`): token embedding + character CNN over each token's
    characters (taken from the tokenizer's vocabulary) -> word-level CNN -> BiLSTM (packed sequences) ->
    linear emissions (``classifier.*``) -> CRF (``crf.*``). No HF ``config.json``: ``arch_config`` holds the
    hyperparameters (:data:`fedclinic.models.fedner.FEDNER_DEFAULTS`, the paper's values) and is all
    :func:`build` needs besides the tokenizer. Loss and decoding as ``transformer-crf``.

Tokens and tags: every sub-word token is tagged (a token belongs to an entity when its character range
overlaps the entity's span; see :func:`fedclinic.data.ner_tags.spans_to_token_tags`); special tokens (``[CLS]``,
``[SEP]``, with empty offsets) are tagged ``O``, padding is ignored. Predicted entities map back to character
spans through the tokenizer's offsets, so the served model answers in the text's own coordinates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Sequence

import numpy as np

from fedclinic.errors import ConfigError, DatasetError, IntegrityError
from fedclinic.models.base import (
    ALLOWED_MODEL_TYPES,
    EncodedData,
    HF_CONFIG_FILE,
    LoadedModel,
    TOKENIZER_FILE,
    TOKENIZER_SIDE_FILES,
    check_max_length,
    check_model_type,
    check_transformer_fits,
    hf_config_bytes,
    load_strict,
    load_tensors,
    load_tokenizer,
    map_checkpoint,
    module_tensors,
    pad_encodings,
    read_checkpoint,
    seeded,
    tokenize_truncated,
    tokenizer_pad_id,
)
from fedclinic.data.ner_tags import (SCHEMES, entity_scores, spans_to_token_tags, tag_set, tags_to_spans,
                                token_spans_to_char_spans)
from fedclinic.transport.package import META_FILE, ModelPackage, meta_bytes
from fedclinic.models import fedner

if TYPE_CHECKING:  # pragma: no cover
    import tokenizers
    import torch

    from fedclinic.data.ner import NerExample

FAMILY = "token-classification"
FORMAT = 1
ARCHITECTURES = ("transformer", "transformer-crf", "cnn-bilstm-crf")
#: architectures whose module ends in a CRF (``module.crf``): CRF loss and Viterbi decoding
CRF_ARCHITECTURES = ("transformer-crf", "cnn-bilstm-crf")
#: architectures built from a Hugging Face config (``config.json`` in the package)
HF_ARCHITECTURES = ("transformer", "transformer-crf")
#: target id of positions that carry no tag (padding)
IGNORE = -100


# ------------------------------------------------------------------------------------------------------------
# loaded model and encoded data


@dataclass
class TokenModel(LoadedModel):
    """A built NER model: the torch module (HF token classifier, with ``.crf`` when it has one, or the FedNER
    tagger), the task's tokenizer and the parsed ``fedclinic_model.json``. ``logits`` are the per-token tag
    scores."""

    @property
    def scheme(self) -> str:
        return str(self.meta.get("scheme", "BIO"))

    @property
    def tags(self) -> list[str]:
        return list(self.meta["tags"])

    @property
    def has_crf(self) -> bool:
        return self.architecture in CRF_ARCHITECTURES

    def logits(self, input_ids: "torch.Tensor", attention_mask: "torch.Tensor") -> "torch.Tensor":
        """``[batch, seq]`` ids and mask -> ``[batch, seq, num_tags]`` per-token tag scores (the emissions)."""
        if self.architecture in HF_ARCHITECTURES:
            return self.module(input_ids=input_ids, attention_mask=attention_mask).logits
        return self.module(input_ids, attention_mask)

    emissions = logits

    # the trainer's interface (fedclinic.training.trainer): a loss on a batch, and decoding for evaluation
    def training_loss(self, inputs: tuple["torch.Tensor", ...], targets: "torch.Tensor") -> "torch.Tensor":
        """Mean loss of a batch: CRF negative log-likelihood per sequence, or token cross-entropy."""
        input_ids, mask = inputs
        return self.loss_from_emissions(self.emissions(input_ids, mask), targets, mask)

    def loss_units(self, targets: "torch.Tensor") -> int:
        """What :meth:`training_loss` is the mean over: sequences with a CRF, labelled tokens without (data-parallel
        training weights by them)."""
        return int(targets.shape[0]) if self.has_crf else int((targets != IGNORE).sum())

    def loss_from_emissions(self, emissions: "torch.Tensor", targets: "torch.Tensor", mask: "torch.Tensor"
                            ) -> "torch.Tensor":
        import torch.nn.functional as F

        em = emissions.float()
        if self.has_crf:
            return self.module.crf.nll(em, targets, mask).mean()
        return F.cross_entropy(em.reshape(-1, em.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)

    def decode(self, input_ids: "torch.Tensor", attention_mask: "torch.Tensor") -> "torch.Tensor":
        """Best tag ids ``[batch, seq]`` (Viterbi with a CRF, else argmax); padded positions are 0 (``O``)."""
        return self.decode_emissions(self.emissions(input_ids, attention_mask), attention_mask)

    def decode_emissions(self, emissions: "torch.Tensor", attention_mask: "torch.Tensor") -> "torch.Tensor":
        if self.has_crf:
            return self.module.crf.viterbi(emissions, attention_mask)
        return emissions.argmax(dim=-1) * attention_mask.long()

    def encode(self, examples: Sequence["NerExample"], *, max_length: int | None = None) -> "TokenData":
        return encode_ner(examples, self, max_length=max_length)

    def evaluate(self, data: "TokenData", *, batch_size: int = 64) -> dict[str, float]:
        return evaluate_ner(self, data, batch_size=batch_size)

    def predict_entities(self, texts: Sequence[str]) -> list[list[dict[str, Any]]]:
        """Entities per text: ``{"start", "end", "label", "text"}`` in character offsets of the input."""
        import torch

        ids, mask, offsets = encode_with_offsets(self.tokenizer, texts, max_length=self.max_length, pad_id=self.pad_id)
        self.module.eval()
        device = next(self.module.parameters()).device
        with torch.no_grad():
            pred = self.decode(torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)).cpu().numpy()
        return [spans_from_tag_ids(text, pred[i], mask[i], offsets[i], self.tags, self.scheme)
                for i, text in enumerate(texts)]


def spans_from_tag_ids(text: str, tag_ids: np.ndarray, mask: np.ndarray, offsets: Sequence[tuple[int, int]],
                       tags: Sequence[str], scheme: str) -> list[dict[str, Any]]:
    """Predicted tag ids of one text -> entity dicts with character offsets (shared with ONNX serving)."""
    n = int(np.asarray(mask).sum())
    names = [tags[int(i)] for i in np.asarray(tag_ids)[:n]]
    names = [t if offsets[k][0] != offsets[k][1] else "O" for k, t in enumerate(names)]  # specials are never entities
    out = []
    for start, end, label in token_spans_to_char_spans(tags_to_spans(names, scheme), offsets[:n]):
        out.append({"start": int(start), "end": int(end), "label": label, "text": text[start:end]})
    return out


@dataclass
class TokenData(EncodedData):
    """Tokenized NER examples as CPU tensors: encode once, train many rounds.

    ``labels`` holds tag ids ``[N, L]`` (``IGNORE`` at padding, trimmed with each batch); ``gold`` the entities
    per example as ``(type, start_token, end_token)`` after tokenization and truncation (what evaluation
    compares against).
    """

    gold: list[list[tuple[str, int, int]]] = field(default_factory=list)
    per_token_labels: ClassVar[bool] = True


def encode_with_offsets(tokenizer: "tokenizers.Tokenizer", texts: Sequence[str], *, max_length: int, pad_id: int
                        ) -> tuple[np.ndarray, np.ndarray, list[list[tuple[int, int]]]]:
    """``(input_ids, attention_mask, offsets)``: as :func:`~fedclinic.models.text_classification.encode_texts`,
    plus each kept token's character offsets (``(0, 0)`` for special tokens). The one NER tokenization path of
    the trainer, the exporter and the serving bundle."""
    encs = tokenize_truncated(tokenizer, texts, max_length=max_length)
    ids, mask = pad_encodings(encs, pad_id=pad_id)
    offsets = [[(0, 0) if special else (int(a), int(b)) for special, (a, b) in zip(e.special_tokens_mask, e.offsets)]
               for e in encs]
    return ids, mask, offsets


def encode_ner(examples: Sequence["NerExample"], loaded: TokenModel, *, max_length: int | None = None) -> TokenData:
    """Tokenize NER examples with the task's tokenizer and tag every token under the model's scheme."""
    import torch

    max_length = loaded.max_length if max_length is None else max_length
    check_max_length(max_length)
    if not examples:
        raise DatasetError("no examples to encode; the dataset is empty")
    known = set(loaded.labels)
    for i, ex in enumerate(examples):
        if not hasattr(ex, "entities"):
            raise DatasetError(f"example {i} is not an NER example (text + entity spans); read the dataset with "
                               "fedclinic.data.ner.read_ner")
        bad = sorted({s.label for s in ex.entities} - known)
        if bad:
            raise DatasetError(f"example {i}: entity type(s) {bad} not in the model's labels {loaded.labels}")
    ids, mask, offsets = encode_with_offsets(loaded.tokenizer, [ex.text for ex in examples], max_length=max_length,
                                             pad_id=loaded.pad_id)
    index = {t: k for k, t in enumerate(loaded.tags)}
    labels = np.full(ids.shape, IGNORE, dtype=np.int64)
    gold = []
    for i, ex in enumerate(examples):
        tags = spans_to_token_tags(offsets[i], [(s.start, s.end, s.label) for s in ex.entities], loaded.scheme)
        labels[i, :len(tags)] = [index[t] for t in tags]
        gold.append(tags_to_spans(tags, loaded.scheme))
    return TokenData(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                     labels=torch.from_numpy(labels), multi_label=False, num_labels=len(loaded.labels), gold=gold)


def evaluate_ner(loaded: TokenModel, data: TokenData, *, batch_size: int = 64) -> dict[str, float]:
    """Loss (the training loss, averaged over examples), token accuracy over non-padding positions, and
    entity-level strict and relaxed precision/recall/F1 (:func:`fedclinic.data.ner_tags.entity_scores`)."""
    import torch

    if len(data) == 0:
        raise DatasetError("no evaluation examples; the evaluation set is empty")
    module = loaded.module
    device = next(module.parameters()).device
    was_training = module.training
    module.eval()
    loss_sum = 0.0
    correct = 0
    counted = 0
    pred_entities: list[list[tuple[str, int, int]]] = []
    tags = loaded.tags
    with torch.no_grad():
        for start in range(0, len(data), batch_size):
            idx = torch.arange(start, min(start + batch_size, len(data)))
            (ids, mask), y = data.batch(idx, device)
            em = loaded.emissions(ids, mask)  # one forward pass serves the loss and the decoding
            loss_sum += float(loaded.loss_from_emissions(em, y, mask)) * len(idx)
            pred = loaded.decode_emissions(em, mask)
            on = mask.bool()
            correct += int(((pred == y) & on).sum())
            counted += int(on.sum())
            for row, m in zip(pred.cpu().numpy(), mask.cpu().numpy()):
                pred_entities.append(tags_to_spans([tags[int(k)] for k in row[:int(m.sum())]], loaded.scheme))
    module.train(was_training)
    scores = entity_scores(data.gold, pred_entities)
    return {"loss": loss_sum / len(data), "token_accuracy": correct / max(counted, 1), **scores,
            "n": float(len(data))}


# ------------------------------------------------------------------------------------------------------------
# packaging and building


def _check_scheme(scheme: str) -> str:
    if scheme not in SCHEMES:
        raise ConfigError(f"unknown tag scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    return scheme


def _check_architecture(architecture: Any) -> str:
    if architecture not in ARCHITECTURES:
        raise ConfigError(f"unknown architecture {architecture!r} for family {FAMILY!r}; "
                          f"choose one of: {', '.join(ARCHITECTURES)}")
    return str(architecture)


def _hf_token_config(config_dict: Mapping[str, Any], tags: Sequence[str]):
    from transformers import AutoConfig

    d = dict(config_dict)
    model_type = check_model_type(d.pop("model_type", None))
    for key in ("_name_or_path", "auto_map", "trust_remote_code", "problem_type", "architectures"):
        d.pop(key, None)
    d["id2label"] = {i: t for i, t in enumerate(tags)}
    d["label2id"] = {t: i for i, t in enumerate(tags)}
    d["num_labels"] = len(tags)
    try:
        return AutoConfig.for_model(model_type, **d)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid {model_type} config: {exc}") from None


def _build_module(config, architecture: str, num_tags: int, seed: int):
    from transformers import AutoModelForTokenClassification

    # lazy: fedclinic.models.crf imports torch; importing fedclinic.models must not
    from fedclinic.models.crf import CRF

    with seeded(seed):
        module = AutoModelForTokenClassification.from_config(config)
        if architecture == "transformer-crf":
            module.crf = CRF(num_tags)
    return module.float()


def _meta(architecture: str, labels: list[str], scheme: str, max_length: int, base_model: str,
          arch_config: Mapping[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "family": FAMILY, "architecture": architecture, "labels": list(labels),
            "scheme": scheme, "tags": tag_set(labels, scheme), "multi_label": False, "max_length": int(max_length),
            "base_model": base_model, "arch_config": dict(arch_config)}


def _package_fedner(*, labels: Sequence[str], tags: list[str], scheme: str, tokenizer_json: bytes,
                    config: Mapping[str, Any], max_length: int, seed: int, base_model: str) -> ModelPackage:
    """A seeded cnn-bilstm-crf package: tensors, fedclinic_model.json (with arch_config) and tokenizer.json."""
    vocab = load_tokenizer(tokenizer_json).get_vocab_size(with_added_tokens=True)
    arch = fedner.fedner_arch_config(config, vocab_size=vocab, pad_token_id=tokenizer_pad_id(tokenizer_json))
    with seeded(seed):
        module = fedner.build_tagger(arch, len(tags), tokenizer_json).float()
    meta = _meta(fedner.ARCHITECTURE, list(labels), scheme, max_length, base_model, arch)
    files = {META_FILE: meta_bytes(meta), TOKENIZER_FILE: bytes(tokenizer_json)}
    return ModelPackage(tensors=module_tensors(module), files=files)


def package_ner_pretrained(path: str | Path, *, labels: Sequence[str], architecture: str = "transformer",
                           scheme: str = "BIO", max_length: int = 128, seed: int = 0,
                           config: Mapping[str, Any] | None = None) -> ModelPackage:
    """Package a local Hugging Face encoder folder (``config.json`` + safetensors + ``tokenizer.json``) as an
    NER model: pretrained encoder, new seeded tag head (and CRF). Nothing is downloaded; only JSON and
    safetensors are read.

    ``cnn-bilstm-crf``: only the folder's ``tokenizer.json`` (and tokenizer side files) is used; the network is
    freshly initialised from ``seed`` and ``config`` sets its hyperparameters (see
    :func:`package_ner_from_config`)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"pretrained model folder {folder} does not exist; give a local folder with "
                          f"{HF_CONFIG_FILE}, model.safetensors and {TOKENIZER_FILE}")
    architecture = _check_architecture(architecture)
    tags = tag_set(labels, _check_scheme(scheme))
    check_max_length(max_length)
    if architecture not in HF_ARCHITECTURES:
        if not (folder / TOKENIZER_FILE).is_file():
            raise ConfigError(f"{folder} has no {TOKENIZER_FILE}; the {architecture} architecture takes its "
                              "vocabulary from a fast tokenizer's tokenizer.json")
        cfg_path = folder / HF_CONFIG_FILE
        hf_cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        pkg = _package_fedner(labels=labels, tags=tags, scheme=scheme,
                              tokenizer_json=(folder / TOKENIZER_FILE).read_bytes(), config=dict(config or {}),
                              max_length=max_length, seed=seed,
                              base_model=str(hf_cfg.get("_name_or_path") or folder.name))
        pkg.files.update({n: (folder / n).read_bytes() for n in TOKENIZER_SIDE_FILES if (folder / n).is_file()})
        return pkg
    for name in (HF_CONFIG_FILE, TOKENIZER_FILE):
        if not (folder / name).is_file():
            raise ConfigError(f"{folder} has no {name}; an NER transformer needs its Hugging Face config and a "
                              "fast tokenizer's tokenizer.json")
    hf_cfg = json.loads((folder / HF_CONFIG_FILE).read_text())
    tokenizer_json = (folder / TOKENIZER_FILE).read_bytes()
    config = _hf_token_config({**hf_cfg, **dict(config or {})}, tags)
    check_transformer_fits(config, load_tokenizer(tokenizer_json).get_vocab_size(with_added_tokens=True), max_length)
    module = _build_module(config, architecture, len(tags), seed)
    load_tensors(module, map_checkpoint(module, read_checkpoint(folder), fresh_modules=("classifier.", "crf.")))
    meta = _meta(architecture, list(labels), scheme, max_length, str(hf_cfg.get("_name_or_path") or folder.name),
                 {"model_type": config.model_type})
    files = {META_FILE: meta_bytes(meta), TOKENIZER_FILE: tokenizer_json, HF_CONFIG_FILE: hf_config_bytes(module),
             **{n: (folder / n).read_bytes() for n in TOKENIZER_SIDE_FILES if (folder / n).is_file()}}
    return ModelPackage(tensors=module_tensors(module), files=files)


def package_ner_from_config(*, labels: Sequence[str], tokenizer_json: bytes | str, config: Mapping[str, Any],
                            architecture: str = "transformer", scheme: str = "BIO", max_length: int = 128,
                            seed: int = 0, base_model: str = "from-config") -> ModelPackage:
    """A freshly initialised (seeded) NER model: from an HF config dict with ``model_type`` (``transformer``,
    ``transformer-crf``; tiny test models), or for ``cnn-bilstm-crf`` from its hyperparameters (keys of
    :data:`fedclinic.models.fedner.FEDNER_DEFAULTS`, defaults filled in; ``vocab_size`` and the padding id
    always come from the tokenizer). Same seed, same package."""
    architecture = _check_architecture(architecture)
    tags = tag_set(labels, _check_scheme(scheme))
    check_max_length(max_length)
    if isinstance(tokenizer_json, str):
        tokenizer_json = tokenizer_json.encode("utf-8")
    if architecture not in HF_ARCHITECTURES:
        return _package_fedner(labels=labels, tags=tags, scheme=scheme, tokenizer_json=tokenizer_json,
                               config=config if config is not None else {}, max_length=max_length, seed=seed,
                               base_model=base_model)
    vocab = load_tokenizer(tokenizer_json).get_vocab_size(with_added_tokens=True)
    cfg = dict(config)
    cfg.setdefault("vocab_size", vocab)
    cfg.setdefault("pad_token_id", tokenizer_pad_id(tokenizer_json))
    hf_config = _hf_token_config(cfg, tags)
    check_transformer_fits(hf_config, vocab, max_length)
    module = _build_module(hf_config, architecture, len(tags), seed)
    meta = _meta(architecture, list(labels), scheme, max_length, base_model, {"model_type": hf_config.model_type})
    files = {META_FILE: meta_bytes(meta), TOKENIZER_FILE: bytes(tokenizer_json), HF_CONFIG_FILE: hf_config_bytes(module)}
    return ModelPackage(tensors=module_tensors(module), files=files)


def build(package: ModelPackage) -> TokenModel:
    """Build the module of a token-classification package and load its tensors strictly."""
    meta = package.meta
    architecture = _check_architecture(meta.get("architecture"))
    labels = meta.get("labels")
    if not isinstance(labels, list) or not labels:
        raise IntegrityError(f"{META_FILE} has no entity label list")
    scheme = _check_scheme(str(meta.get("scheme", "BIO")))
    tags = tag_set(labels, scheme)
    if meta.get("tags") != tags:
        raise IntegrityError(f"{META_FILE} declares tags {meta.get('tags')} but labels {labels} under {scheme} give "
                             f"{tags}; re-package the model")
    tok_bytes = package.files.get(TOKENIZER_FILE)
    if tok_bytes is None:
        raise IntegrityError(f"an NER package needs {TOKENIZER_FILE}")
    tokenizer = load_tokenizer(tok_bytes)
    if architecture not in HF_ARCHITECTURES:
        arch = fedner.stored_arch_config(meta.get("arch_config") or {},
                                         vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
                                         pad_token_id=tokenizer_pad_id(tok_bytes))
        with seeded(0):  # the initial values are overwritten; seeding keeps the caller's RNG untouched
            module = fedner.build_tagger(arch, len(tags), tok_bytes).float()
        load_strict(module, package.tensors)
        module.eval()
        return TokenModel(module=module, tokenizer=tokenizer, meta=meta, pad_id=tokenizer_pad_id(tok_bytes))
    raw = package.files.get(HF_CONFIG_FILE)
    if raw is None:
        raise IntegrityError(f"a {architecture} NER package needs {HF_CONFIG_FILE}")
    hf = json.loads(raw)
    config = _hf_token_config(hf, tags)
    if int(config.vocab_size) < tokenizer.get_vocab_size(with_added_tokens=True):
        raise IntegrityError(f"{TOKENIZER_FILE} has more tokens than the model's vocab_size {config.vocab_size}")
    module = _build_module(config, architecture, len(tags), 0)
    load_strict(module, package.tensors)
    module.eval()
    return TokenModel(module=module, tokenizer=tokenizer, meta=meta, pad_id=tokenizer_pad_id(tok_bytes))


__all__ = ["ALLOWED_MODEL_TYPES", "ARCHITECTURES", "CRF_ARCHITECTURES", "FAMILY", "TokenData", "TokenModel", "build",
           "encode_ner", "encode_with_offsets", "evaluate_ner", "package_ner_from_config", "package_ner_pretrained",
           "spans_from_tag_ids"]
