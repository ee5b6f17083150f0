"""Serve exported classifiers: load an ONNX bundle (``fedclinic export onnx``) and predict from raw inputs.

A bundle folder holds ``model.onnx`` (and optionally ``model.int8.onnx``), ``fedclinic_model.json`` (labels,
family) and, for text models, ``tokenizer.json``. Serving needs onnxruntime, numpy and tokenizers, not torch::

    bundle = ClassifierBundle("onnx-model/", int8=True)
    bundle.predict(["Took it for three weeks, the rash is gone."])
    # [{"label": "Acne", "scores": {"Acne": 0.91, "Depression": 0.02, ...}}]

Single-label scores are the softmax of the logits; multi-label scores are per-label sigmoids, and
``labels`` lists those at or above their threshold: the per-label thresholds the bundle's ``fedclinic_model.json``
carries (``"thresholds"``, label order: tuned for F1 on the sites' validation rows, :mod:`fedclinic.spec.card_thresholds`;
each answer then has ``thresholds``, label -> threshold), else one ``threshold`` for every label (0.5, or what the
caller gives, which also overrides tuned ones). The probabilities are the same either way. A token-classification (NER) bundle answers with the
entities found, in character offsets of each input text::

    bundle.predict(["Started sertraline for my depression."])
    # [{"entities": [{"start": 8, "end": 18, "label": "DRUG", "text": "sertraline"}, ...]}]

Its graph returns the CRF's Viterbi path (output ``tags``) when the model has a CRF, else per-token scores
whose argmax is the tag.

A question-answering bundle (a causal LM exported with past key/values) answers each text, taken as a
question, with a generated answer (greedy, at most the bundle's ``generation.max_new_tokens`` tokens), built
from the same prompt as in training (:mod:`fedclinic.serving.generate`); ``contexts`` optionally gives each
question a context passage::

    bundle.predict(["What is sertraline used for?"])
    # [{"answer": "Depression."}]

A question whose prompt would not fit the model's prompt budget (``max_length`` minus the room kept for the
answer) is refused with a DatasetError rather than cut, as is an empty one.

An image + text bundle (``image-text-classification``) takes one image per report: the bytes of a PNG, JPEG or
DICOM file (or a path to one), decoded by :func:`fedclinic.data.image.decode_image_bytes` (the code that reads the
sites' images) and preprocessed as the bundle's ``preprocessing.json`` states (:func:`fedclinic.data.image.preprocess`:
resize to the graph's fixed size, ``(v - mean) / std``)::

    bundle.predict(["no focal marker"], images=[Path("study.dcm").read_bytes()])
    # [{"labels": ["ct"], "scores": {"ct": 0.97, "mr": 0.02, "marker": 0.11}, "threshold": 0.5}]

Multi-label predictions carry the ``threshold`` (or per-label ``thresholds``) they were decided with. Every bad input (an image missing,
empty, not PNG/JPEG/DICOM, corrupt, multi-frame or palette-colour; an empty report; counts that differ) is a
DatasetError naming the input and what to send instead.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fedclinic.errors import ConfigError, DatasetError
from fedclinic.models.meta import ModelMeta
from fedclinic.data.image import decode_image, decode_image_bytes, preprocess
from fedclinic.models.base import encode_texts, load_tokenizer, tokenizer_pad_id
from fedclinic.models.image_text import PREPROCESSING_FILE
from fedclinic.models.token_classification import encode_with_offsets, spans_from_tag_ids
from fedclinic.serving.generate import OnnxQAModel
from fedclinic.spec.card_thresholds import DEFAULT as DEFAULT_THRESHOLD, check_thresholds
from fedclinic.spec.model_card import read_card

QA_FAMILY = "question-answering"
IMAGE_TEXT_FAMILY = "image-text-classification"
TEXT_FAMILIES = ("text-classification", "token-classification", QA_FAMILY, IMAGE_TEXT_FAMILY)
#: onnxruntime graph optimizers a serving session turns off: their CPU kernels are slower than the ops they replace
#: (measurements in :mod:`fedclinic.export.encoder_fusion`, which keeps the same fusions out of the graph)
SESSION_DISABLED_OPTIMIZERS = ("SkipLayerNormFusion", "BiasGeluFusion")
#: an image is the bytes of a PNG/JPEG/DICOM file, or the path of one
ImageInput = bytes | bytearray | memoryview | os.PathLike


@dataclass(frozen=True)
class ImagePreprocessing:
    """What an image-text bundle's graph expects of its ``image`` input (from ``preprocessing.json``): one
    grayscale channel of ``size x size`` pixels, normalised as ``(v - mean) / std`` with v in [0, 1]."""

    size: int
    mean: float
    std: float


class ClassifierBundle(ModelMeta):
    """An exported bundle (any family) loaded for prediction on onnxruntime; see the module docstring.

    ``int8`` serves ``model.int8.onnx``; ``threads`` sets onnxruntime's intra-op threads (0: its default);
    ``threshold``, when given, is the multi-label decision threshold of every label (a label is reported when its
    probability is >= it), in place of the bundle's per-label thresholds or the default 0.5.
    Raises ConfigError when the folder is not a complete bundle or its thresholds do not fit its labels."""

    def __init__(self, folder: str | Path, *, int8: bool = False, threads: int = 0,
                 threshold: float | None = None) -> None:
        import onnxruntime as ort

        root = Path(folder)
        name = "model.int8.onnx" if int8 else "model.onnx"
        model = root / name
        if not model.is_file():
            hint = " (export with --int8)" if int8 else ""
            raise ConfigError(f"{root} has no {name}; create the bundle with `fedclinic export onnx MODEL_DIR "
                              f"{root}`{hint}")
        meta_path = root / "fedclinic_model.json"
        if not meta_path.is_file():
            raise ConfigError(f"{root} has no fedclinic_model.json; it is not a bundle made by fedclinic export")
        self.meta = json.loads(meta_path.read_text())
        self.card = _read_card_quietly(root)  # model_card.json when the bundle has one (exports since the card)
        self.max_length = int(self.meta.get("max_length", 128))
        self._set_thresholds(threshold, root)
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = int(threads)
        try:
            self.session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"],
                                                disabled_optimizers=list(SESSION_DISABLED_OPTIMIZERS))
        except Exception as exc:  # onnxruntime's own error types: a missing kernel or opset, a corrupt file
            raise ConfigError(f"onnxruntime {ort.__version__} cannot load {model}: {exc}. A BERT int8 graph needs "
                              f"opset-24 kernels: install the onnxruntime fedclinic pins (constraints.txt), or "
                              f"re-export the bundle with this one") from None
        self._tokenizer = None
        self._pad_id = 0
        self._qa = None
        self.image: ImagePreprocessing | None = None
        if self.family == IMAGE_TEXT_FAMILY:
            self.image = _image_preprocessing(root, self.session)
        if self.family in TEXT_FAMILIES:
            tok_path = root / "tokenizer.json"
            if not tok_path.is_file():
                raise ConfigError(f"{root} has no tokenizer.json, which a text model needs; re-run "
                                  f"`fedclinic export onnx` into a fresh folder")
            raw = tok_path.read_bytes()
            self._tokenizer = load_tokenizer(raw)
            if self.family == QA_FAMILY:
                self._qa = OnnxQAModel(self.session, self.meta, self._tokenizer)
            else:
                self._pad_id = tokenizer_pad_id(raw)

    def _set_thresholds(self, threshold: float | None, root: Path) -> None:
        """``thresholds`` (one per label), ``threshold`` (the one value of every label, None when they differ) and
        ``tuned_thresholds`` (whether the bundle's own per-label ones are in use)."""
        if threshold is not None and not (isinstance(threshold, (int, float)) and 0.0 < float(threshold) < 1.0):
            raise ConfigError(f"threshold must be a probability in (0, 1), got {threshold!r}")
        carried = self.meta.get("thresholds")
        if carried is not None and not self.multi_label:
            raise ConfigError(f"{root}/fedclinic_model.json has thresholds but the model is not multi-label; "
                              "re-export the bundle")
        if carried is not None:
            try:
                carried = check_thresholds(carried, self.labels)
            except ConfigError as exc:
                raise ConfigError(f"{root}/fedclinic_model.json: {exc}; re-export the bundle") from None
        self.tuned_thresholds = carried is not None and threshold is None
        if self.tuned_thresholds:
            self.thresholds = list(carried)
        else:
            value = DEFAULT_THRESHOLD if threshold is None else float(threshold)
            self.thresholds = [value] * len(self.labels)
        self.threshold = None if self.tuned_thresholds else self.thresholds[0] if self.thresholds else DEFAULT_THRESHOLD

    def decision(self) -> dict[str, Any]:
        """How a multi-label answer decides: ``{"thresholds": {label: t}}`` with per-label thresholds, else
        ``{"threshold": t}``."""
        if self.tuned_thresholds:
            return {"thresholds": dict(zip(self.labels, self.thresholds))}
        return {"threshold": self.threshold}

    def encode(self, texts: Sequence[str], *, pad_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, attention_mask) as the trainer builds them: truncated to max_length, right-padded to
        the longest text (or to ``pad_to``)."""
        if self._tokenizer is None:
            raise ConfigError(f"a {self.family} bundle takes feature vectors, not texts; use predict_features")
        _require_texts(texts)
        return encode_texts(self._tokenizer, texts, max_length=self.max_length, pad_id=self._pad_id, pad_to=pad_to)

    def logits(self, texts: Sequence[str], *, pad_to: int | None = None) -> np.ndarray:
        if self._qa is not None:
            raise ConfigError("a question-answering bundle generates answers; use predict or predict_answers")
        if self.image is not None:
            raise ConfigError(f"an {IMAGE_TEXT_FAMILY} bundle reads an image with each text; use "
                              "predict(texts, images=[...])")
        ids, mask = self.encode(texts, pad_to=pad_to)
        return self.session.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0]

    def predict(self, texts: Sequence[str], *, batch_size: int = 32,
                contexts: Sequence[str] | None = None,
                images: Sequence[ImageInput] | None = None) -> list[dict[str, Any]]:
        """One prediction per text: ``label`` (or ``labels`` and ``threshold`` for multi-label) and ``scores`` per
        label; for an NER bundle, ``entities``; for a question-answering bundle, ``answer`` (``contexts``: one per
        text, "" for none; only question-answering bundles take them); an image-text bundle needs ``images``, one
        per text (see :meth:`predict_image_text`)."""
        if self.image is not None:
            if images is None:
                raise ConfigError(f"an {IMAGE_TEXT_FAMILY} bundle needs one image per text: predict(texts, "
                                  "images=[...]) with the bytes of PNG, JPEG or DICOM files")
            return self.predict_image_text(images, texts, batch_size=min(batch_size, 16))
        if images is not None:
            raise ConfigError(f"a {self.family} bundle takes no images; only {IMAGE_TEXT_FAMILY} bundles do")
        if self._qa is not None:
            return self.predict_answers(texts, contexts, batch_size=min(batch_size, 8))
        if contexts is not None:
            raise ConfigError(f"a {self.family} bundle takes no contexts; only question-answering bundles do")
        if self.family == "token-classification":
            return self.predict_entities(texts, batch_size=batch_size)
        out: list[dict[str, Any]] = []
        for start in range(0, len(texts), batch_size):
            out.extend(self._describe(self.logits(texts[start:start + batch_size])))
        return out

    def predict_entities(self, texts: Sequence[str], *, batch_size: int = 32) -> list[dict[str, Any]]:
        """``{"entities": [{"start", "end", "label", "text"}, ...]}`` per text (an NER bundle)."""
        if self.family != "token-classification":
            raise ConfigError(f"a {self.family} bundle does not find entities; use predict")
        _require_texts(texts)
        outputs = {o.name for o in self.session.get_outputs()}
        tags, scheme = list(self.meta["tags"]), str(self.meta.get("scheme", "BIO"))
        out: list[dict[str, Any]] = []
        for start in range(0, len(texts), batch_size):
            chunk = list(texts[start:start + batch_size])
            ids, mask, offsets = encode_with_offsets(self._tokenizer, chunk, max_length=self.max_length,
                                                     pad_id=self._pad_id)
            feeds = {"input_ids": ids, "attention_mask": mask}
            if "tags" in outputs:
                pred = self.session.run(["tags"], feeds)[0]
            else:
                pred = self.session.run(["logits"], feeds)[0].argmax(-1)
            out.extend({"entities": spans_from_tag_ids(text, pred[i], mask[i], offsets[i], tags, scheme)}
                       for i, text in enumerate(chunk))
        return out

    def predict_answers(self, questions: Sequence[str], contexts: Sequence[str] | None = None, *,
                        batch_size: int = 8, max_new_tokens: int | None = None) -> list[dict[str, Any]]:
        """``{"answer": "..."}`` per question (a question-answering bundle): greedy generation, at most
        ``max_new_tokens`` tokens (default: the bundle's). DatasetError for an empty question, a context that is
        not a string, or a prompt longer than the model's prompt budget; ConfigError for a context count that
        does not match."""
        if self._qa is None:
            raise ConfigError(f"a {self.family} bundle does not answer questions; use predict")
        if isinstance(questions, str):
            raise ConfigError("questions must be a list of strings, not one string")
        answers = self._qa.generate(list(questions), None if contexts is None else list(contexts),
                                    max_new_tokens=max_new_tokens, batch_size=batch_size, strict=True)
        return [{"answer": a} for a in answers]

    def image_inputs(self, images: Sequence[ImageInput]) -> np.ndarray:
        """The graph's ``image`` input ``[N, 1, S, S]`` float32: each image (file bytes or a path) decoded by
        :mod:`fedclinic.data.image` (as the sites' images are) and preprocessed with the bundle's size and
        normalisation. DatasetError naming the image (0-based) for a missing, unreadable or unsupported one."""
        if self.image is None:
            raise ConfigError(f"a {self.family} bundle takes no images; only {IMAGE_TEXT_FAMILY} bundles do")
        _require_list_of_images(images)
        pixels = []
        for i, image in enumerate(images):
            if image is None:
                raise DatasetError(f"image {i} is missing; send one PNG, JPEG or DICOM image per text")
            if isinstance(image, os.PathLike):
                gray = decode_image(image, where=f"image {i}")
            else:
                gray = decode_image_bytes(image, name=f"image {i}")
            pixels.append(preprocess(gray, size=self.image.size, mean=self.image.mean, std=self.image.std))
        if not pixels:
            return np.zeros((0, 1, self.image.size, self.image.size), np.float32)
        return np.stack(pixels)

    def predict_image_text(self, images: Sequence[ImageInput], texts: Sequence[str], *,
                           batch_size: int = 16) -> list[dict[str, Any]]:
        """``{"labels": [...], "scores": {label: sigmoid}, "threshold": t}`` per (image, report) pair (an image-text
        bundle). Every input is checked before any is run: DatasetError for a count mismatch, a bad image
        (:meth:`image_inputs`) or an empty report."""
        if self.image is None:
            raise ConfigError(f"a {self.family} bundle takes no images; use predict")
        if isinstance(texts, str):
            raise ConfigError("texts must be a list of strings (one report per image), not one string")
        _require_list_of_images(images)
        texts, images = list(texts), list(images)
        if len(images) != len(texts):
            raise DatasetError(f"{len(images)} images for {len(texts)} texts; send exactly one image per report")
        _require_texts(texts)  # before any image is decoded
        pixels = self.image_inputs(images)
        out: list[dict[str, Any]] = []
        for start in range(0, len(texts), batch_size):
            ids, mask = self.encode(texts[start:start + batch_size])
            feeds = {"image": pixels[start:start + batch_size], "input_ids": ids, "attention_mask": mask}
            out.extend(self._describe(self.session.run(["logits"], feeds)[0]))
        return out

    def predict_features(self, features: np.ndarray) -> list[dict[str, Any]]:
        if self.family != "feature-classification":
            raise ConfigError(f"a {self.family} bundle takes texts; use predict")
        x = np.asarray(features, dtype=np.float32)
        if x.ndim != 2 or not np.isfinite(x).all():
            raise DatasetError("features must be a finite [rows, num_features] matrix")
        return self._describe(self.session.run(["logits"], {"features": x})[0])

    def _describe(self, logits: np.ndarray) -> list[dict[str, Any]]:
        rows = []
        if self.multi_label:
            probs = 1.0 / (1.0 + np.exp(-logits))
            decision = self.decision()
            for p in probs:
                rows.append({"labels": [lab for lab, v, t in zip(self.labels, p, self.thresholds) if v >= t],
                             "scores": {lab: float(v) for lab, v in zip(self.labels, p)}, **decision})
            return rows
        z = logits - logits.max(axis=1, keepdims=True)
        probs = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
        for p in probs:
            rows.append({"label": self.labels[int(p.argmax())], "scores": {lab: float(v) for lab, v in zip(self.labels, p)}})
        return rows


def _require_texts(texts: Sequence[Any]) -> None:
    """DatasetError naming the first input that is not a non-empty string."""
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()]
    if bad:
        raise DatasetError(f"text {bad[0]} is empty or not a string; every input must be non-empty text")


def _require_list_of_images(images: Any) -> None:
    if isinstance(images, (str, bytes, bytearray, memoryview, os.PathLike)) or not isinstance(images, Sequence):
        raise ConfigError("images must be a list (one image per text), not a single image")


def _read_card_quietly(root: Path) -> dict[str, Any] | None:
    """The bundle's model card, or None when it has none or it cannot be read (serving does not need it)."""
    try:
        return read_card(root)
    except ConfigError:
        return None


def _image_preprocessing(root: Path, session) -> ImagePreprocessing:
    """The image input an image-text bundle's graph expects, from its ``preprocessing.json``, checked against the
    graph's ``image`` input shape ``[batch, 1, S, S]``; ConfigError when the file is missing or disagrees."""
    path = root / PREPROCESSING_FILE
    redo = "re-run `fedclinic export onnx` into a fresh folder"
    if not path.is_file():
        raise ConfigError(f"{root} has no {PREPROCESSING_FILE}, which an {IMAGE_TEXT_FAMILY} bundle needs (image size "
                          f"and normalisation); {redo}")
    try:
        image = json.loads(path.read_text(encoding="utf-8"))["image"]
        size, mean, std = image["height"], float(image["mean"]), float(image["std"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError):
        raise ConfigError(f"{path} is not a valid image preprocessing file (needs image.height, image.width, "
                          f"image.mean, image.std); {redo}") from None
    if (not isinstance(size, int) or isinstance(size, bool) or size < 1 or image.get("width") != size
            or not (math.isfinite(mean) and math.isfinite(std) and std > 0)):
        raise ConfigError(f"{path}: image size {size!r} x {image.get('width')!r}, mean {mean!r}, std {std!r} are "
                          f"not a square size and a finite mean with std > 0; {redo}")
    inputs = {i.name: i.shape for i in session.get_inputs()}
    shape = inputs.get("image")
    if shape is None or list(shape[1:]) != [1, size, size]:
        raise ConfigError(f"{root}: the graph's image input is {shape}, but {PREPROCESSING_FILE} says 1 x {size} x "
                          f"{size}; the files come from different exports, {redo}")
    return ImagePreprocessing(size=size, mean=mean, std=std)
