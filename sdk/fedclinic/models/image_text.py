"""The "image-text-classification" model family: an image and its report -> multi-label findings (IU-CXR).

The IU-CXR capstone's multimodal classifier (shared/seeds/specs/iucxr_multimodal_dynamic_weighting.md §4):
a ResNet image branch and a (Bi)LSTM text branch, fused late by concatenation, with one sigmoid output per
label trained with binary cross-entropy. ``fedclinic_model.json``::

    {"format": 1, "family": "image-text-classification", "architecture": "resnet-bilstm",
     "labels": ["normal", "cardiomegaly", ...], "multi_label": true, "max_length": 128,
     "base_model": "...", "arch_config": {"image_size": 224, "image_mean": 0.5, "image_std": 0.5,
                                          "resnet_hidden_sizes": [...], ..., "vocab_size": V, "pad_token_id": 0}}

Network (``B`` examples, ``S`` = ``image_size``, ``L`` tokens, sizes from ``arch_config``)::

    image  [B, 1, S, S] -> ResNet (transformers' ResNetModel, 1 input channel) -> global average pool [B, H_img]
                        -> image_proj: Linear(H_img, branch_hidden) -> ReLU -> Dropout -> Linear(., branch_dim) -> ReLU
    text   [B, L] ids   -> text_embedding -> text_lstm (packed: padding never enters the recurrence), feature =
                           the last layer's final hidden state (both directions concatenated when bidirectional)
                        -> text_proj: Linear(H_txt, branch_hidden) -> ReLU -> Dropout -> Linear(., branch_dim) -> ReLU
    fusion              concat[text, image] (text first, as the notebook) -> Linear(2 branch_dim, fusion_hidden)
                        -> ReLU -> Dropout -> classifier: Linear(fusion_hidden, C)  = the logits z  [B, C]

    p = sigmoid(z);   loss = mean over the B x C entries of BCE(z, y) = -[y log p + (1 - y) log(1 - p)]

Defaults (:data:`IMAGE_TEXT_DEFAULTS`) follow the paper where it is specific: ResNet-50's shape (bottleneck
blocks, depths 3-4-6-3, widths 256-512-1024-2048), 224 x 224 images, a 128-d embedding, a *bidirectional*
LSTM of 128 units (the report says bidirectional; the notebook ran a unidirectional one: set
``bidirectional = false``), 128 -> 64 branch projections, a 128-unit fusion layer and dropout 0.5. Images
are one grayscale channel, preprocessed as :mod:`fedclinic.data.image` states (resize, ``(v - mean) / std``).

Tensor names: ``image_encoder.*`` (the ResNet: ``image_encoder.embedder.embedder.convolution.weight``,
``image_encoder.encoder.stages.{s}.layers.{l}....``, batch-norm ``weight``/``bias``/``running_mean``/
``running_var``), ``image_proj.{0,3}.*``, ``text_embedding.weight``, ``text_lstm.weight_ih_l{k}[_reverse]``...,
``text_proj.{0,3}.*``, ``fusion.0.*``, ``classifier.*``. Every tensor is float32: batch norm's
``num_batches_tracked`` counter is removed (momentum is fixed at 0.1, so the counter is never read), which lets
FedAvg average every tensor, running statistics included (the sample-weighted mean of the sites' statistics).

Batch norm and freezing: a batch-norm layer whose affine weight is not being trained (the task freezes it,
e.g. ``frozen = ['image_encoder\\..*']`` as the notebook froze ResNet-50) runs in inference mode during
training: it normalises with its running statistics and does not update them (Keras's behaviour for frozen
layers). Otherwise statistics would drift at every site while the weights stay global. Select a layer's
running statistics together with its weight (the default, all tensors, does).

ONNX export (:mod:`fedclinic.export.onnx_export`): inputs ``image`` ``[B, 1, S, S]`` (S fixed), ``input_ids`` and
``attention_mask`` ``[B, L]`` (B and L dynamic) -> ``logits`` ``[B, C]``; the report branch is traced through
:func:`~fedclinic.models.text_classification.lstm_final_states_unpacked`, and the bundle's ``preprocessing.json``
(:func:`preprocessing_spec`) says how to make the inputs in any language.

Pretrained image encoder: :func:`package_image_text_pretrained` reads a local Hugging Face ResNet folder
(``config.json`` with ``model_type = "resnet"`` + ``model.safetensors``; nothing is downloaded). Its first
convolution is made single-channel by summing its filters over the input channels, which is exact for a
gray image fed as three equal channels with one normalisation. The text branch and the heads are new.

Module layout: the network and its ``arch_config`` validation are :mod:`fedclinic.models.image_text_net`; this
module packages models, builds a package's model, and holds its training step, evaluation and the exported
bundle's ``preprocessing.json``. Every public name of the network module is importable from here as well.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from fedclinic.errors import ConfigError, DatasetError, IntegrityError
from fedclinic.models.base import (
    EncodedData,
    HF_CONFIG_FILE,
    LoadedModel,
    TOKENIZER_FILE,
    check_labels,
    check_max_length,
    encode_texts,
    format_names,
    load_strict,
    load_tensors,
    load_tokenizer,
    module_tensors,
    read_checkpoint,
    tokenizer_pad_id,
)
from fedclinic.models.image_text_net import (  # noqa: F401  (re-exported: the family's public names live here too)
    ARCHITECTURE,
    ARCHITECTURES,
    FAMILY,
    FORMAT,
    IMAGE_TEXT_DEFAULTS,
    PRETRAINED_IMAGE_MEAN,
    PRETRAINED_IMAGE_STD,
    _RESNET_KEYS,
    build_module,
    check_architecture,
    image_text_arch_config,
)
from fedclinic.transport.package import META_FILE, ModelPackage, meta_bytes
from fedclinic.data.image import load_image
from fedclinic.evaluation.multilabel import multilabel_evaluation

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from fedclinic.data.image import ImageTextExample


# ------------------------------------------------------------------------------------------------------------
# loaded model and encoded data


@dataclass
class ImageTextData(EncodedData):
    """Encoded image + text examples (CPU tensors): ``pixel_values`` float32 ``[N, 1, S, S]`` (preprocessed as
    :mod:`fedclinic.data.image` states), token ids and mask ``[N, L]``, multi-hot ``labels`` ``[N, C]``.

    A batch is ``((pixel_values, input_ids, attention_mask), labels)``, trimmed to its longest text.
    """

    pixel_values: "torch.Tensor" = None  # type: ignore[assignment]

    def batch(self, idx: "torch.Tensor", device: "torch.device"):
        (ids, mask), y = super().batch(idx, device)
        return (self.pixel_values[idx].to(device, non_blocking=device.type == "cuda"), ids, mask), y


@dataclass
class ImageTextModel(LoadedModel):
    """A built image + text model: the torch module, the task's tokenizer and the parsed ``fedclinic_model.json``.

    ``logits(pixel_values, input_ids, attention_mask)`` are one score per label; ``sigmoid`` gives the
    probabilities. The trainer (:mod:`fedclinic.training.trainer`) calls :meth:`encode`, :meth:`training_loss` and
    :meth:`evaluate`.
    """

    @property
    def arch_config(self) -> dict[str, Any]:
        return dict(self.meta.get("arch_config") or {})

    @property
    def image_size(self) -> int:
        return int(self.arch_config["image_size"])

    @property
    def image_mean(self) -> float:
        return float(self.arch_config["image_mean"])

    @property
    def image_std(self) -> float:
        return float(self.arch_config["image_std"])

    def logits(self, pixel_values: "torch.Tensor", input_ids: "torch.Tensor",
               attention_mask: "torch.Tensor") -> "torch.Tensor":
        """``[B, 1, S, S]`` images, ``[B, L]`` ids and mask -> ``[B, C]`` logits."""
        return self.module(pixel_values, input_ids, attention_mask)

    def training_loss(self, inputs: tuple["torch.Tensor", ...], targets: "torch.Tensor") -> "torch.Tensor":
        """Mean binary cross-entropy over the batch's examples and labels (on float32 logits)."""
        import torch.nn.functional as F

        return F.binary_cross_entropy_with_logits(self.logits(*inputs).float(), targets)

    def encode(self, examples: Sequence["ImageTextExample"], *, max_length: int | None = None) -> ImageTextData:
        return encode_image_text(examples, self, max_length=max_length)

    def evaluate(self, data: ImageTextData, *, batch_size: int = 64) -> dict[str, float]:
        return evaluate_image_text(self, data, batch_size=batch_size)

    def predict_proba(self, images: Sequence[str | Path], texts: Sequence[str]) -> np.ndarray:
        """Label probabilities ``[N, C]`` (sigmoid of the logits) for image files and their reports."""
        import torch

        if len(images) != len(texts):
            raise ConfigError(f"{len(images)} images but {len(texts)} texts; give one report per image")
        if not images:
            return np.zeros((0, len(self.labels)), dtype=np.float32)
        px = np.stack([load_image(p, size=self.image_size, mean=self.image_mean, std=self.image_std) for p in images])
        ids, mask = encode_texts(self.tokenizer, list(texts), max_length=self.max_length, pad_id=self.pad_id)
        device = next(self.module.parameters()).device
        was_training = self.module.training
        self.module.eval()
        with torch.no_grad():
            z = self.logits(torch.from_numpy(px).to(device), torch.from_numpy(ids).to(device),
                            torch.from_numpy(mask).to(device))
        self.module.train(was_training)
        return torch.sigmoid(z.float()).cpu().numpy()


def encode_image_text(examples: Sequence["ImageTextExample"], loaded: ImageTextModel, *,
                      max_length: int | None = None) -> ImageTextData:
    """Decode and preprocess every image at the model's size, tokenize every report, multi-hot the labels.

    DatasetError naming the example's manifest row for a label the model does not know or an image that no
    longer decodes (it was valid when the manifest was read).
    """
    import torch

    max_length = loaded.max_length if max_length is None else max_length
    check_max_length(max_length)
    if not examples:
        raise DatasetError("no examples to encode; the dataset is empty, so there is nothing to train")
    index = {lab: i for i, lab in enumerate(loaded.labels)}
    y = np.zeros((len(examples), len(index)), dtype=np.float32)
    pixels = np.empty((len(examples), 1, loaded.image_size, loaded.image_size), dtype=np.float32)
    for i, ex in enumerate(examples):
        if not hasattr(ex, "image"):
            raise DatasetError(f"example {i} is not an image + text example; read the dataset with "
                               "fedclinic.data.image.read_image_text (or read_dataset('image-text-classification', ...))")
        where = ex.source or f"example {i}"
        bad = [lab for lab in ex.labels if lab not in index]
        if bad or not ex.labels:
            raise DatasetError(f"{where}: label(s) {list(ex.labels)} not in the model's labels {loaded.labels}")
        y[i, [index[lab] for lab in ex.labels]] = 1.0
        pixels[i] = load_image(ex.image, size=loaded.image_size, mean=loaded.image_mean, std=loaded.image_std,
                               where=where)
    ids, mask = encode_texts(loaded.tokenizer, [ex.text for ex in examples], max_length=max_length,
                             pad_id=loaded.pad_id)
    return ImageTextData(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                         labels=torch.from_numpy(y), multi_label=True, num_labels=len(index),
                         pixel_values=torch.from_numpy(pixels))


def evaluate_image_text(loaded: ImageTextModel, data: ImageTextData, *, batch_size: int = 64) -> dict[str, float]:
    """``loss`` (the training loss: mean BCE over examples and labels), ``f1/<label>``, ``auc/<label>``,
    ``macro_f1``, ``macro_auc``, ``micro_f1``, ``exact_match``, ``label_accuracy``, ``n`` and the threshold
    histograms (:func:`fedclinic.evaluation.multilabel.multilabel_evaluation`).

    A label is predicted when its logit is > 0 (probability > 0.5); AUC ranks the logits (not the
    probabilities, whose float32 sigmoid saturates into ties). Definitions: :mod:`fedclinic.evaluation.multilabel`;
    a label without both classes in ``data`` has AUC NaN, which the aggregator's round summary skips.
    """
    import torch
    import torch.nn.functional as F

    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if len(data) == 0:
        raise DatasetError("no evaluation examples; the evaluation set is empty")
    module = loaded.module
    device = next(module.parameters()).device
    was_training = module.training
    module.eval()
    loss_sum = 0.0
    logits = []
    with torch.no_grad():
        for start in range(0, len(data), batch_size):
            idx = torch.arange(start, min(start + batch_size, len(data)))
            inputs, y = data.batch(idx, device)
            z = loaded.logits(*inputs).float()
            loss_sum += float(F.binary_cross_entropy_with_logits(z, y, reduction="sum")) / y.shape[1]
            logits.append(z.cpu())
    module.train(was_training)
    return multilabel_evaluation(data.labels.numpy(), torch.cat(logits).numpy(), loaded.labels,
                                 loss=loss_sum / len(data))



def _meta(labels: list[str], max_length: int, base_model: str, arch: Mapping[str, Any]) -> dict[str, Any]:
    return {"format": FORMAT, "family": FAMILY, "architecture": ARCHITECTURE, "labels": list(labels),
            "multi_label": True, "max_length": int(max_length), "base_model": base_model, "arch_config": dict(arch)}


# ------------------------------------------------------------------------------------------------------------
# packaging and building


def package_image_text_from_config(*, labels: Sequence[str], tokenizer_json: bytes | str,
                                   config: Mapping[str, Any] | None = None, architecture: str = ARCHITECTURE,
                                   max_length: int = 128, seed: int = 0,
                                   base_model: str = "from-config") -> ModelPackage:
    """A freshly initialised (seeded: same seed, same package) image + text model.

    ``config``: keys of :data:`IMAGE_TEXT_DEFAULTS` (unknown keys are refused); ``vocab_size`` and the padding
    id come from ``tokenizer_json`` (a ``tokenizer.json``, e.g. from
    :func:`fedclinic.models.wordlevel_tokenizer_json`). Tiny test models set small ResNet stages, e.g.
    ``{"image_size": 32, "resnet_embedding_size": 8, "resnet_hidden_sizes": [8, 16], "resnet_depths": [1, 1],
    "resnet_layer_type": "basic", ...}``.
    """
    check_architecture(architecture)
    labels = check_labels(labels, True)
    check_max_length(max_length)
    if isinstance(tokenizer_json, str):
        tokenizer_json = tokenizer_json.encode("utf-8")
    tokenizer = load_tokenizer(tokenizer_json)
    arch = image_text_arch_config(config, vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
                                  pad_token_id=tokenizer_pad_id(tokenizer_json))
    module = build_module(arch, len(labels), seed)
    meta = _meta(labels, max_length, base_model, arch)
    return ModelPackage(tensors=module_tensors(module),
                        files={META_FILE: meta_bytes(meta), TOKENIZER_FILE: bytes(tokenizer_json)})


def package_image_text_pretrained(path: str | Path, *, labels: Sequence[str], tokenizer_json: bytes | str | None = None,
                                  config: Mapping[str, Any] | None = None, max_length: int = 128,
                                  seed: int = 0) -> ModelPackage:
    """Package a model whose ResNet comes from a local Hugging Face ResNet folder; the rest is new (seeded).

    The folder holds ``config.json`` (``model_type = "resnet"``) and ``model.safetensors`` (of ``ResNetModel``
    or ``ResNetForImageClassification``: a ``resnet.`` prefix and the ``classifier.*`` head are accepted and
    the head is dropped), and ``tokenizer.json`` unless ``tokenizer_json`` is given. A folder without
    ``config.json`` supplies only the tokenizer: the model is then :func:`package_image_text_from_config`'s. The ResNet's shape comes
    from its ``config.json`` (``resnet_*`` keys in ``config`` are refused); ``image_mean``/``image_std``
    default to :data:`PRETRAINED_IMAGE_MEAN`/:data:`PRETRAINED_IMAGE_STD`. The first convolution's filters
    are summed over their input channels (module doc). Nothing is downloaded; only JSON and safetensors
    are read.
    """
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"pretrained model folder {folder} does not exist; give a local folder with "
                          f"{HF_CONFIG_FILE} (a ResNet), model.safetensors and {TOKENIZER_FILE}")
    labels = check_labels(labels, True)
    check_max_length(max_length)
    if tokenizer_json is None:
        tok_path = folder / TOKENIZER_FILE
        if not tok_path.is_file():
            raise ConfigError(f"{folder} has no {TOKENIZER_FILE}; put the task's tokenizer there or pass "
                              "tokenizer_json=")
        tokenizer_json = tok_path.read_bytes()
    elif isinstance(tokenizer_json, str):
        tokenizer_json = tokenizer_json.encode("utf-8")
    tokenizer = load_tokenizer(tokenizer_json)
    cfg_path = folder / HF_CONFIG_FILE
    if not cfg_path.is_file():  # a tokenizer only: the whole network starts fresh (seeded) from ``config``
        return package_image_text_from_config(labels=labels, tokenizer_json=tokenizer_json, config=config,
                                              max_length=max_length, seed=seed, base_model=folder.name)
    hf = json.loads(cfg_path.read_text())
    if hf.get("model_type") != "resnet":
        raise ConfigError(f"{cfg_path} has model_type {hf.get('model_type')!r}; the image branch must be a "
                          "transformers ResNet (model_type 'resnet')")
    if hf.get("hidden_act", "relu") != "relu":
        raise ConfigError(f"{cfg_path} has hidden_act {hf.get('hidden_act')!r}; only ReLU ResNets are supported")
    given = sorted(k for k in (config or {}) if k in _RESNET_KEYS)
    if given:
        raise ConfigError(f"config sets {given}, but a pretrained ResNet's shape comes from {cfg_path}")
    base = {**IMAGE_TEXT_DEFAULTS, "image_mean": PRETRAINED_IMAGE_MEAN, "image_std": PRETRAINED_IMAGE_STD,
            "resnet_embedding_size": hf.get("embedding_size", 64),
            "resnet_hidden_sizes": hf.get("hidden_sizes", IMAGE_TEXT_DEFAULTS["resnet_hidden_sizes"]),
            "resnet_depths": hf.get("depths", IMAGE_TEXT_DEFAULTS["resnet_depths"]),
            "resnet_layer_type": hf.get("layer_type", "bottleneck"),
            "resnet_downsample_in_first_stage": bool(hf.get("downsample_in_first_stage", False)),
            "resnet_downsample_in_bottleneck": bool(hf.get("downsample_in_bottleneck", False))}
    arch = image_text_arch_config(config, vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
                                  pad_token_id=tokenizer_pad_id(tokenizer_json), base=base)
    module = build_module(arch, len(labels), seed)
    load_tensors(module, _map_resnet_checkpoint(module, read_checkpoint(folder), folder))
    base_model = str(hf.get("_name_or_path") or folder.name)
    meta = _meta(labels, max_length, base_model, arch)
    return ModelPackage(tensors=module_tensors(module),
                        files={META_FILE: meta_bytes(meta), TOKENIZER_FILE: bytes(tokenizer_json)})


def _map_resnet_checkpoint(module, checkpoint: Mapping[str, np.ndarray], folder: Path) -> dict[str, np.ndarray]:
    """Checkpoint tensors -> ``image_encoder.*`` names; every ResNet tensor must be there with its shape."""
    wanted = {n for n in module.state_dict() if n.startswith("image_encoder.")}
    mapped: dict[str, np.ndarray] = {}
    for key, arr in checkpoint.items():
        if key.startswith("classifier.") or key.endswith("num_batches_tracked"):
            continue
        name = "image_encoder." + (key[len("resnet."):] if key.startswith("resnet.") else key)
        if name in wanted:
            mapped[name] = np.asarray(arr, dtype=np.float32)
    stem = "image_encoder.embedder.embedder.convolution.weight"
    if stem in mapped and mapped[stem].ndim == 4 and mapped[stem].shape[1] != 1:
        mapped[stem] = mapped[stem].sum(axis=1, keepdims=True)  # gray replicated on every input channel
    missing = sorted(wanted - set(mapped))
    if missing:
        raise IntegrityError(f"the ResNet weights in {folder} lack tensor(s) {format_names(missing)}; the folder does not "
                             f"match its {HF_CONFIG_FILE}")
    state = module.state_dict()
    bad = [f"{n} {tuple(a.shape)} != model {tuple(state[n].shape)}" for n, a in mapped.items()
           if tuple(a.shape) != tuple(state[n].shape)]
    if bad:
        raise IntegrityError(f"pretrained ResNet tensor shape mismatch: {format_names(bad)}")
    return mapped


def build(package: ModelPackage) -> ImageTextModel:
    """Build the module of an image + text package and load its tensors strictly (CPU, eval mode)."""
    meta = package.meta
    check_architecture(meta.get("architecture"))
    labels = meta.get("labels")
    if not isinstance(labels, list):
        raise IntegrityError(f"{META_FILE} has no label list")
    labels = check_labels(labels, True)
    if meta.get("multi_label") is not True:
        raise IntegrityError(f"{META_FILE} of an {FAMILY} model must say multi_label: true (sigmoid outputs)")
    tok_bytes = package.files.get(TOKENIZER_FILE)
    if tok_bytes is None:
        raise IntegrityError(f"the package has no {TOKENIZER_FILE}; an image + text model carries its tokenizer")
    tokenizer = load_tokenizer(tok_bytes)
    stored = dict(meta.get("arch_config") or {})
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if int(stored.get("vocab_size", -1)) != vocab:
        raise IntegrityError(f"{META_FILE} declares vocab_size {stored.get('vocab_size')} but {TOKENIZER_FILE} has "
                             f"{vocab} tokens")
    missing = sorted(set(IMAGE_TEXT_DEFAULTS) - set(stored))
    if missing:
        raise IntegrityError(f"{META_FILE} arch_config lacks {missing}; re-package the model")
    try:
        arch = image_text_arch_config({k: v for k, v in stored.items() if k in IMAGE_TEXT_DEFAULTS},
                                      vocab_size=vocab, pad_token_id=int(stored.get("pad_token_id", 0)))
    except ConfigError as exc:
        raise IntegrityError(f"{META_FILE}: {exc}") from None
    module = build_module(arch, len(labels), 0)  # initial values are overwritten; seeding keeps the caller's RNG
    load_strict(module, package.tensors)
    module.eval()
    return ImageTextModel(module=module, tokenizer=tokenizer, meta=meta, pad_id=tokenizer_pad_id(tok_bytes))


# ------------------------------------------------------------------------------------------------------------
# ONNX export


#: the file of an exported bundle that says how to make the graph's inputs (:func:`preprocessing_spec`)
PREPROCESSING_FILE = "preprocessing.json"
#: decision threshold on each label's sigmoid probability (logit > 0), as the family's metrics use it
DEFAULT_THRESHOLD = 0.5


def preprocessing_spec(loaded: ImageTextModel) -> dict[str, Any]:
    """``preprocessing.json`` of an exported bundle: how to make the ONNX graph's inputs from an image file and its
    report in any language with an ONNX Runtime binding, and how to read its output. The exact image steps are
    :mod:`fedclinic.data.image`'s (its module doc states them; ``fedclinic.serving.bundle`` runs that very code)."""
    size = loaded.image_size
    return {
        "format": 1,
        "family": FAMILY,
        "image": {
            "input": "image", "dtype": "float32", "layout": "NCHW", "shape": ["batch", 1, size, size],
            "channels": 1, "height": size, "width": size, "mean": loaded.image_mean, "std": loaded.image_std,
            "formats": ["png", "jpeg", "dicom"],
            "steps": [
                "decode to grayscale v in [0, 1]: PNG/JPEG 8-bit: ITU-R 601-2 luma (299 R + 587 G + 114 B) / 1000 / "
                "255; 16-bit: v / 65535; DICOM: modality LUT, then the first VOI window (LINEAR, LINEAR_EXACT or "
                "SIGMOID) or min-max scaling without one, inverted for MONOCHROME1",
                f"resize to {size} x {size} with a bilinear filter (Pillow's, on float pixels; antialiased when "
                "shrinking); the aspect ratio is not kept",
                f"normalise: (v - {loaded.image_mean}) / {loaded.image_std}",
            ],
            "reference": "fedclinic.data.image (decode_image / decode_image_bytes, preprocess)",
        },
        "text": {
            "inputs": ["input_ids", "attention_mask"], "dtype": "int64", "shape": ["batch", "seq"],
            "tokenizer": TOKENIZER_FILE, "max_length": loaded.max_length, "pad_id": loaded.pad_id,
            "steps": [f"tokenize with {TOKENIZER_FILE} (special tokens added as it defines them)",
                      f"truncate to {loaded.max_length} tokens",
                      f"right-pad every row to the batch's longest with id {loaded.pad_id}; attention_mask is 1 on "
                      "real tokens, 0 on padding"],
        },
        "output": {"name": "logits", "shape": ["batch", len(loaded.labels)], "labels": META_FILE,
                   "activation": "sigmoid (one independent probability per label)",
                   "threshold": DEFAULT_THRESHOLD,
                   "decision": "a label is present when its probability >= threshold"},
    }


__all__ = ["ARCHITECTURE", "ARCHITECTURES", "DEFAULT_THRESHOLD", "FAMILY", "IMAGE_TEXT_DEFAULTS", "ImageTextData",
           "ImageTextModel", "PREPROCESSING_FILE", "PRETRAINED_IMAGE_MEAN", "PRETRAINED_IMAGE_STD", "build",
           "encode_image_text", "evaluate_image_text", "image_text_arch_config",
           "package_image_text_from_config", "package_image_text_pretrained", "preprocessing_spec"]
