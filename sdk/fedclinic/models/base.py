"""What every model family shares: the loaded model, encoded data, tokenizers, tensor I/O, checks, checkpoints.

The family modules (:mod:`.text_classification`, :mod:`.token_classification`, :mod:`.causal_lm`,
:mod:`.image_text`, :mod:`.feature_classification`) build on these and never on each other's internals; the
trainer (:mod:`fedclinic.training.trainer`), the exporter and the serving bundle use the same helpers, so a
served model sees exactly the tokens it was trained on.

- :class:`LoadedModel`: a built torch module with its tokenizer and parsed ``fedclinic_model.json``;
  :class:`EncodedData`: tokenized examples as tensors, subclassed per family.
- tokenizers: ``tokenizer.json`` parsing (:func:`load_tokenizer`, never remote code) and the one encoding path
  (:func:`tokenize_truncated`, :func:`pad_encodings`, :func:`encode_texts`).
- tensors: :func:`module_tensors`, :func:`load_tensors` (partial), :func:`load_strict` (complete).
- checks shared by the packagers (labels, ``max_length``, allowed HF ``model_type``) and :func:`seeded`.
- Hugging Face checkpoints: safetensors only (:func:`read_checkpoint`, never pickle), matched to a module's
  state-dict names by :func:`map_checkpoint`.

Importing this module imports neither torch nor tokenizers (they load on first use).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Mapping, Sequence

import numpy as np

from fedclinic.errors import ConfigError, IntegrityError
from fedclinic.models.meta import ModelMeta
from fedclinic.runtime.array_blocks import flat_blocks
from fedclinic.transport.package import WEIGHTS_FILE, packaged_form

if TYPE_CHECKING:  # pragma: no cover
    import tokenizers
    import torch

log = logging.getLogger("fedclinic.models")

#: HF ``model_type`` values whose classes may be built (all ship in transformers; no remote code).
ALLOWED_MODEL_TYPES = ("bert", "roberta", "distilbert", "electra")
TOKENIZER_FILE = "tokenizer.json"
HF_CONFIG_FILE = "config.json"
#: Plain-JSON tokenizer side files copied from a pretrained folder (so the package is a usable HF folder).
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")
#: Sub-modules a sequence-classification model may lack in a pretrained checkpoint (newly initialised).
FRESH_MODULES = ("classifier.", "pre_classifier.")
PAD_CANDIDATES = ("[PAD]", "<pad>", "<PAD>", "[pad]")


def _torch():
    import torch  # lazy: importing fedclinic.models must not import torch

    return torch


@dataclass
class LoadedModel(ModelMeta):
    """A built model: the torch module, the task's tokenizer and the parsed ``fedclinic_model.json``.

    ``tokenizer`` is a :class:`tokenizers.Tokenizer` with padding disabled (the trainer pads per batch).
    """

    module: "torch.nn.Module"
    tokenizer: "tokenizers.Tokenizer"
    meta: dict
    #: id used to pad token sequences (from the tokenizer's padding settings or its [PAD]/<pad> token)
    pad_id: int = 0

    @property
    def max_length(self) -> int:
        return int(self.meta.get("max_length", 128))

    def logits(self, input_ids: "torch.Tensor", attention_mask: "torch.Tensor") -> "torch.Tensor":
        """Forward pass: ``[batch, seq]`` ids and mask -> ``[batch, num_labels]`` logits."""
        if self.architecture == "transformer":
            return self.module(input_ids=input_ids, attention_mask=attention_mask).logits
        return self.module(input_ids, attention_mask)



@dataclass
class EncodedData:
    """Tokenized examples as tensors (CPU), padded to the longest sequence: encode once, train many rounds.

    ``labels``: int64 class indices ``[N]`` (single-label) or float32 multi-hot ``[N, num_labels]``.
    """

    input_ids: "torch.Tensor"       # [N, L] int64
    attention_mask: "torch.Tensor"  # [N, L] int64, 1 = token, 0 = padding (right-padded)
    labels: "torch.Tensor"
    multi_label: bool
    num_labels: int

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    #: True when ``labels`` hold one target per token (``[N, L]``, trimmed with the batch), as in NER
    per_token_labels: ClassVar[bool] = False

    def batch(self, idx: "torch.Tensor", device: "torch.device") -> tuple[tuple["torch.Tensor", ...], "torch.Tensor"]:
        """((ids, mask), targets) of the examples at ``idx`` on ``device``, trimmed to their longest sequence."""
        mask = self.attention_mask[idx]
        width = max(1, int(mask.sum(dim=1).max()))
        nb = device.type == "cuda"
        y = self.labels[idx, :width] if self.per_token_labels else self.labels[idx]
        return ((self.input_ids[idx, :width].to(device, non_blocking=nb), mask[:, :width].to(device, non_blocking=nb)),
                y.to(device, non_blocking=nb))

    def batches(self, order: "torch.Tensor", batch_size: int, device: "torch.device"):
        """Yield :meth:`batch` for consecutive ``batch_size`` slices of ``order`` (one epoch)."""
        for start in range(0, len(order), batch_size):
            yield self.batch(order[start:start + batch_size], device)


# ------------------------------------------------------------------------------------------------------------
# tokenizers


def load_tokenizer(tokenizer_json: bytes | str) -> "tokenizers.Tokenizer":
    """Parse a ``tokenizer.json`` (padding switched off; truncation is set per call by the encoder)."""
    from tokenizers import Tokenizer

    text = tokenizer_json.decode("utf-8") if isinstance(tokenizer_json, (bytes, bytearray)) else tokenizer_json
    try:
        tok = Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a plain Exception on bad JSON
        raise IntegrityError(f"{TOKENIZER_FILE} could not be parsed: {exc}; re-export it with "
                             "tokenizer.save_pretrained() from a fast tokenizer") from None
    tok.no_padding()
    tok.no_truncation()
    return tok


def tokenize_truncated(tokenizer: "tokenizers.Tokenizer", texts: Sequence[str], *, max_length: int,
                       offsets: bool = True) -> list:
    """The tokenizer's encodings of ``texts``, each truncated to ``max_length`` tokens (no padding): the one
    tokenization step of every text family (:func:`encode_texts`, the NER encoder with offsets). Without
    ``offsets`` the character offsets are not computed (``encode_batch_fast``: the same ids, about a quarter less
    time on a batch of reviews)."""
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length)
    try:
        encode = tokenizer.encode_batch if offsets else tokenizer.encode_batch_fast
        return encode(list(texts))
    finally:
        tokenizer.no_truncation()


def pad_encodings(encs: Sequence, *, pad_id: int, pad_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, attention_mask)``, int64 ``[n, width]``, right-padded with ``pad_id`` to the longest
    encoding (or to ``pad_to``)."""
    width = max(pad_to or 0, 1, *(len(e.ids) for e in encs))
    ids = np.full((len(encs), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(encs), width), dtype=np.int64)
    for i, e in enumerate(encs):
        ids[i, :len(e.ids)] = e.ids
        mask[i, :len(e.ids)] = 1
    return ids, mask


def encode_texts(tokenizer: "tokenizers.Tokenizer", texts: Sequence[str], *, max_length: int, pad_id: int,
                 pad_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(input_ids, attention_mask)``, int64 ``[n, width]``: each text tokenized and truncated to ``max_length``,
    right-padded with ``pad_id`` to the longest one (or to ``pad_to``). The one tokenization path of the
    trainer, the exporter and the serving bundle, so a served model sees exactly what it was trained on.
    """
    return pad_encodings(tokenize_truncated(tokenizer, texts, max_length=max_length, offsets=False), pad_id=pad_id,
                         pad_to=pad_to)


def tokenizer_pad_id(tokenizer_json: bytes | str) -> int:
    """The padding id: the token named in the file's padding settings, else [PAD]/<pad>, else 0."""
    doc = json.loads(tokenizer_json)
    tok = load_tokenizer(tokenizer_json)
    names = [(doc.get("padding") or {}).get("pad_token"), *PAD_CANDIDATES]
    for name in names:
        idx = tok.token_to_id(name) if name else None
        if idx is not None:
            return int(idx)
    return 0


def wordlevel_tokenizer_json(words: Sequence[str], *, lowercase: bool = True) -> bytes:
    """A small BERT-style word-level ``tokenizer.json`` for tests and demos, built with ``tokenizers``.

    Ids: 0 ``[PAD]``, 1 ``[UNK]``, 2 ``[CLS]``, 3 ``[SEP]``, then ``words`` in the given order (duplicates
    dropped). Text is split on whitespace and punctuation (``BertPreTokenizer``); each sequence becomes
    ``[CLS] ... [SEP]``.
    """
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab: dict[str, int] = {t: i for i, t in enumerate(specials)}
    for w in words:
        w = w.lower() if lowercase else w
        if not w or any(c.isspace() for c in w):
            raise ConfigError(f"tokenizer word {w!r} must be non-empty and contain no whitespace")
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok.add_special_tokens(specials)
    return tok.to_str().encode("utf-8")


# ------------------------------------------------------------------------------------------------------------
# tensors <-> module


def module_tensors(module: "torch.nn.Module", names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Detached CPU copies of the module's (persistent) state-dict entries as numpy arrays.

    Floating tensors come back as float32 (whatever the module's dtype); integer buffers keep their dtype.
    ``names`` restricts the result (unknown names raise :class:`IntegrityError`).
    """
    torch = _torch()
    state = module.state_dict()
    if names is None:
        names = list(state)
    else:
        unknown = [n for n in names if n not in state]
        if unknown:
            raise IntegrityError(f"the model has no tensor(s) {format_names(unknown)}; it holds e.g. {format_names(list(state))}")
    return {name: _numpy_copy(state[name], torch) for name in names}


def _numpy_copy(tensor: "torch.Tensor", torch) -> np.ndarray:
    """A detached CPU numpy copy of one state-dict entry: float32 when floating, else its own dtype."""
    t = tensor.detach()
    t = t.to(device="cpu", dtype=torch.float32) if t.is_floating_point() else t.to("cpu")
    return t.numpy().copy()


class ModuleTensorView(Mapping[str, np.ndarray]):
    """The module's (persistent) state-dict entries by name, as :func:`module_tensors` gives them, one per lookup.

    A float32 tensor in CPU memory comes back without a copy: a read-only numpy view of the tensor itself, which
    changes when the module does (read it before training the module again). Any other (a GPU tensor, another
    dtype) is copied out by :func:`module_tensors`. A caller that handles one tensor at a time (e.g.
    ``trainer.compute_delta``) so holds at most one copy, never a copy of the model."""

    def __init__(self, module: "torch.nn.Module") -> None:
        # the state dict once: its entries share storage with the module's tensors (in-place training shows
        # through), and a lookup is then one dict access, not a new state dict per tensor
        self._state = module.state_dict()

    def __getitem__(self, name: str) -> np.ndarray:
        torch = _torch()
        t = self._state[name].detach()
        if t.device.type == "cpu" and t.dtype == torch.float32:
            view = t.numpy()
            view.flags.writeable = False
            return view
        return _numpy_copy(t, torch)

    def __contains__(self, name: object) -> bool:
        return name in self._state

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


def load_tensors(module: "torch.nn.Module", tensors: Mapping[str, np.ndarray]) -> None:
    """Copy ``tensors`` into the module's state in place (a partial update; the others stay as they are).

    Every name must exist and every shape must match, else :class:`IntegrityError` names the offenders and
    nothing is changed.
    """
    torch = _torch()
    state = module.state_dict()
    unknown = [n for n in tensors if n not in state]
    bad_shape = [f"{n} {tuple(np.shape(a))} != model {tuple(state[n].shape)}"
                 for n, a in tensors.items() if n in state and tuple(np.shape(a)) != tuple(state[n].shape)]
    if unknown or bad_shape:
        parts = []
        if unknown:
            parts.append(f"unknown tensor(s) {format_names(unknown)}")
        if bad_shape:
            parts.append(f"shape mismatch: {format_names(bad_shape)}")
        raise IntegrityError("cannot load weights: " + "; ".join(parts)
                             + ". The package does not belong to this model (check family/architecture/config)")
    with torch.no_grad(), warnings.catch_warnings():
        # Read-only arrays (downloads, memory maps) are fine here: the tensor is only read by copy_().
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, arr in tensors.items():
            dst = state[name]
            if not dst.is_contiguous():
                dst.copy_(torch.from_numpy(np.ascontiguousarray(arr)).to(dtype=dst.dtype, device=dst.device))
                continue
            # block by block: a memory-mapped source (the agent's cache) keeps one block's pages resident, not
            # the tensor's (fedclinic.runtime.array_blocks); an elementwise copy, the same values as one copy_
            flat, start = dst.view(-1), 0
            for (block,) in flat_blocks([np.asarray(arr)]):
                flat[start:start + block.size].copy_(torch.from_numpy(block).to(dtype=dst.dtype, device=dst.device))
                start += block.size


def format_names(items: Sequence[str], limit: int = 8) -> str:
    items = list(items)
    shown = ", ".join(repr(i) if " " not in str(i) else str(i) for i in items[:limit])
    return shown + (f" ... ({len(items)} in all)" if len(items) > limit else "")


def load_strict(module, tensors: Mapping[str, np.ndarray]) -> None:
    """Load a full set of tensors: missing, unexpected or mis-shaped ones raise IntegrityError naming them."""
    state = module.state_dict()
    missing = [n for n in state if n not in tensors]
    unexpected = [n for n in tensors if n not in state]
    parts = []
    if missing:
        parts.append(f"missing tensor(s) {format_names(missing)}")
    if unexpected:
        parts.append(f"unexpected tensor(s) {format_names(unexpected)}")
    if parts:
        raise IntegrityError("the package's weights do not match its declared model: " + "; ".join(parts))
    load_tensors(module, tensors)


def build_loaded(build: Callable[[], "torch.nn.Module"], tensors: Mapping[str, np.ndarray]) -> "torch.nn.Module":
    """``build()`` with ``tensors`` loaded strictly (as :func:`load_strict`), without initialising the weights first.

    The module is built on the meta device and materialised empty; every persistent tensor is then loaded from
    ``tensors``, so no random initialisation is computed only to be overwritten. Buffers that are not part of the
    state (``persistent=False``: position ids, rotary frequencies) are not in ``tensors``: they are recomputed by the
    Hugging Face model's own initialisation, which skips every loaded tensor (its ``_is_hf_initialized`` flag, the
    mechanism ``from_pretrained`` relies on). A module with such buffers and no Hugging Face model to recompute them
    is built the plain way (initialised, then loaded).
    """
    torch = _torch()
    with torch.device("meta"):
        module = build()
    state = module.state_dict(keep_vars=True)
    transient = [name for name, _ in module.named_buffers() if name not in state]
    hf = module if hasattr(module, "initialize_weights") else getattr(module, "encoder", None)
    if transient and not hasattr(hf, "initialize_weights"):
        module = build()
        load_strict(module, tensors)
        return module
    module.to_empty(device="cpu")
    load_strict(module, tensors)
    if transient:
        loaded = list(module.state_dict(keep_vars=True).values())
        for t in loaded:
            t._is_hf_initialized = True
        try:
            with torch.no_grad():
                hf.initialize_weights()
        finally:
            for t in loaded:
                del t._is_hf_initialized
    return module


# ------------------------------------------------------------------------------------------------------------
# validation


def check_labels(labels: Sequence[str], multi_label: bool) -> list[str]:
    if isinstance(labels, str):
        raise ConfigError("labels must be a list of label names, not one string")
    labels = list(labels)
    if not all(isinstance(x, str) and x.strip() for x in labels):
        raise ConfigError(f"labels must be non-empty strings, got {labels!r}")
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise ConfigError(f"labels must be unique; repeated: {dupes}")
    need = 1 if multi_label else 2
    if len(labels) < need:
        raise ConfigError(f"a {'multi' if multi_label else 'single'}-label task needs at least {need} labels, "
                          f"got {labels}")
    return labels


def check_model_type(model_type: Any) -> str:
    if model_type not in ALLOWED_MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r} is not allowed for the transformer architecture; "
                          f"allowed: {', '.join(ALLOWED_MODEL_TYPES)} (classes built into transformers; "
                          "no remote code is ever run)")
    return str(model_type)


def check_max_length(max_length: int) -> int:
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 2:
        raise ConfigError(f"max_length must be an integer >= 2, got {max_length!r}")
    return max_length


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run with torch's global RNG seeded, restoring the caller's RNG state afterwards."""
    torch = _torch()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        yield


def enable_gradient_checkpointing(module: "torch.nn.Module") -> int:
    """Turn on activation (gradient) checkpointing in the outermost Hugging Face models inside ``module`` that
    support it (non-reentrant: each layer's activations are recomputed in the backward pass instead of kept, the
    same gradients for less memory); returns how many it was turned on in (0: none supports it)."""
    from transformers import PreTrainedModel  # lazy: transformers is a train dependency

    done: list = []
    for sub in module.modules():
        if not isinstance(sub, PreTrainedModel) or not getattr(sub, "supports_gradient_checkpointing", False):
            continue
        if any(sub is inner for outer in done for inner in outer.modules()):
            continue  # inside a model already turned on (a causal LM's base model)
        if hasattr(sub, "activation_checkpointing_enable"):  # transformers >= 5 (the older name is deprecated)
            sub.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:  # pragma: no cover - older transformers
            sub.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        done.append(sub)
    return len(done)


# ------------------------------------------------------------------------------------------------------------
# Hugging Face configs and pretrained checkpoints


def max_positions(config) -> int | None:
    n = getattr(config, "max_position_embeddings", None)
    if n is None:
        return None
    if config.model_type == "roberta":  # positions start after the padding index
        return int(n) - int(config.pad_token_id or 0) - 1
    return int(n)


def check_transformer_fits(config, vocab_size: int, max_length: int) -> None:
    if int(config.vocab_size) < vocab_size:
        raise ConfigError(f"the tokenizer has {vocab_size} tokens but the model's vocab_size is "
                          f"{config.vocab_size}; use the tokenizer the model was trained with or raise vocab_size")
    limit = max_positions(config)
    if limit is not None and max_length > limit:
        raise ConfigError(f"max_length {max_length} exceeds what the model supports ({limit} positions); "
                          f"lower max_length")


def hf_config_bytes(module, architecture: str | None = None) -> bytes:
    """The module's HF ``config.json``; ``architectures`` names ``architecture`` or else the module's class."""
    d = module.config.to_dict()
    d.pop("_name_or_path", None)
    d["architectures"] = [architecture or type(module).__name__]
    return (json.dumps(d, indent=2, sort_keys=True) + "\n").encode("utf-8")


def read_checkpoint(folder: Path) -> dict[str, np.ndarray]:
    """Read safetensors weights (single file or sharded with an index); never pickle-based formats."""
    from safetensors.numpy import load_file

    single = folder / WEIGHTS_FILE
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        return _load_safetensors(single, load_file)
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        out: dict[str, np.ndarray] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = (folder / shard).resolve()
            if not shard_path.is_relative_to(folder.resolve()):
                raise IntegrityError(f"{index} points outside its folder: {shard!r}")
            out.update(_load_safetensors(shard_path, load_file))
        return out
    raise ConfigError(f"{folder} holds no {WEIGHTS_FILE}; only safetensors weights are loaded (pickle-based "
                      "pytorch_model.bin is refused). Convert it once with save_pretrained(safe_serialization=True)")


def _load_safetensors(path: Path, load_file) -> dict[str, np.ndarray]:
    try:
        arrays = load_file(str(path))
    except Exception as exc:
        # bf16 has no numpy dtype: fall back to torch's reader (still safetensors, no pickle)
        try:
            from safetensors.torch import load_file as torch_load_file

            return {k: v.float().numpy() if v.is_floating_point() else v.numpy()
                    for k, v in torch_load_file(str(path)).items()}
        except Exception:
            raise IntegrityError(f"cannot read weights {path}: {exc}") from None
    return arrays


def pretrained_tensors(build: Callable[[], "torch.nn.Module"], checkpoint: Mapping[str, np.ndarray], seed: int,
                       initialise: Callable[["torch.nn.Module", "torch.nn.Module"], None],
                       fresh_modules: tuple[str, ...] = FRESH_MODULES) -> tuple["torch.nn.Module", dict[str, np.ndarray]]:
    """A pretrained model's package tensors without building its weights: ``(module on the meta device, tensors)``.

    ``build()`` is called under ``torch.device("meta")``, so no weight is allocated or randomly initialised; the
    checkpoint is matched to its names by :func:`map_checkpoint` (same checks). Only the modules that own a tensor
    the checkpoint lacks (the task's new head, a missing pooler) are materialised on the CPU and initialised by
    ``initialise(module, owner)`` with torch's RNG seeded from ``seed`` (owners in state-dict order, so the same seed
    gives the same tensors). The result has the module's state-dict names and order, floating tensors as float32,
    exactly what :func:`module_tensors` of the loaded module would return; the checkpoint's arrays are not copied
    when they already are float32. The meta module carries the config (``module.config``) for the package.
    """
    torch = _torch()
    with torch.device("meta"):
        module = build()
    mapped = map_checkpoint(module, checkpoint, fresh_modules)
    state = module.state_dict()
    owners: list[str] = []
    for name in state:
        if name not in mapped:
            owner = name.rpartition(".")[0]
            if owner not in owners:
                owners.append(owner)
    fresh: dict[str, np.ndarray] = {}
    with seeded(seed), torch.no_grad():
        for path in owners:
            owner = module.get_submodule(path)
            owner.to_empty(device="cpu", recurse=False)
            initialise(module, owner)
            for local, t in owner.state_dict(keep_vars=False).items():
                if "." not in local:
                    fresh[f"{path}.{local}" if path else local] = (
                        t.detach().float() if t.is_floating_point() else t.detach()).numpy().copy()
    out: dict[str, np.ndarray] = {}
    for name in state:
        out[name] = fresh[name] if name not in mapped else packaged_form(np.asarray(mapped[name]))
    return module, out


def map_checkpoint(module, checkpoint: Mapping[str, np.ndarray],
                    fresh_modules: tuple[str, ...] = FRESH_MODULES) -> dict[str, np.ndarray]:
    """Match checkpoint names to the module's state-dict names.

    Accepts names with or without the base-model prefix (``bert.``) and legacy LayerNorm ``gamma``/``beta``.
    Raises IntegrityError when a tensor of the encoder itself is missing or has the wrong shape. The
    classification head is never taken from the checkpoint (a new task has new labels) and a pooler may be
    absent; those keep their seeded initialisation. ``fresh_modules``: name prefixes of the task's new head(s).
    """
    state = module.state_dict()
    prefix = getattr(module, "base_model_prefix", "") or ""
    normalised: dict[str, np.ndarray] = {}
    for key, arr in checkpoint.items():
        key = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", key)
        key = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", key)
        normalised[key] = arr
    mapped: dict[str, np.ndarray] = {}
    for name in state:
        if name.startswith(fresh_modules):
            continue  # the task's labels get a new head, even when the checkpoint has one for other labels
        if name in normalised:
            mapped[name] = normalised[name]
        elif prefix and name.startswith(prefix + ".") and name[len(prefix) + 1:] in normalised:
            mapped[name] = normalised[name[len(prefix) + 1:]]
    missing = [n for n in state if n not in mapped]
    fresh = [n for n in missing if n.startswith(fresh_modules) or ".pooler." in f".{n}"]
    hard_missing = [n for n in missing if n not in fresh]
    if hard_missing:
        raise IntegrityError(f"the pretrained weights lack encoder tensor(s) {format_names(hard_missing)}; the folder "
                             "does not match its config.json (wrong model_type or a different model)")
    bad = [f"{n} {tuple(a.shape)} != model {tuple(state[n].shape)}" for n, a in mapped.items()
           if tuple(a.shape) != tuple(state[n].shape)]
    if bad:
        raise IntegrityError(f"pretrained tensor shape mismatch: {format_names(bad)}")
    if fresh:
        log.info("newly initialised (seeded): %s", ", ".join(fresh))
    return mapped


