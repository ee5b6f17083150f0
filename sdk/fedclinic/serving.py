"""Serve exported classifiers: load an ONNX bundle (``fedclinic export onnx``) and predict from raw inputs.

A bundle folder holds ``model.onnx`` (and optionally ``model.int8.onnx``), ``fedclinic_model.json`` (labels,
family) and, for text models, ``tokenizer.json``. Serving needs onnxruntime, numpy and tokenizers, not torch::

    bundle = ClassifierBundle("onnx-model/", int8=True)
    bundle.predict(["Took it for three weeks, the rash is gone."])
    # [{"label": "Acne", "scores": {"Acne": 0.91, "Depression": 0.02, ...}}]

Single-label scores are the softmax of the logits; multi-label scores are per-label sigmoids, and
``labels`` lists those at or above ``threshold`` (0.5). A token-classification (NER) bundle answers with the
entities found, in character offsets of each input text::

    bundle.predict(["Started sertraline for my depression."])
    # [{"entities": [{"start": 8, "end": 18, "label": "DRUG", "text": "sertraline"}, ...]}]

Its graph returns the CRF's Viterbi path (output ``tags``) when the model has a CRF, else per-token scores
whose argmax is the tag.

A question-answering bundle (a causal LM exported with past key/values) answers each text, taken as a
question, with a generated answer (greedy, at most the bundle's ``generation.max_new_tokens`` tokens), built
from the same prompt as in training (:mod:`fedclinic.onnx_generate`); ``contexts`` optionally gives each
question a context passage::

    bundle.predict(["What is sertraline used for?"])
    # [{"answer": "Depression."}]

A question whose prompt would not fit the model's prompt budget (``max_length`` minus the room kept for the
answer) is refused with a DatasetError rather than cut, as is an empty one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fedclinic.errors import ConfigError, DatasetError
from fedclinic.models.meta import ModelMeta

QA_FAMILY = "question-answering"
TEXT_FAMILIES = ("text-classification", "token-classification", QA_FAMILY)


class ClassifierBundle(ModelMeta):
    """An exported bundle (any family) loaded for prediction on onnxruntime; see the module docstring.

    ``int8`` serves ``model.int8.onnx``; ``threads`` sets onnxruntime's intra-op threads (0: its default);
    ``threshold`` is the multi-label decision threshold. Raises ConfigError when the folder is not a complete
    bundle."""

    def __init__(self, folder: str | Path, *, int8: bool = False, threads: int = 0, threshold: float = 0.5) -> None:
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
        self.threshold = float(threshold)
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = int(threads)
        self.session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
        self._tokenizer = None
        self._pad_id = 0
        self._qa = None
        if self.family in TEXT_FAMILIES:
            from fedclinic.models.text_classification import load_tokenizer, tokenizer_pad_id

            tok_path = root / "tokenizer.json"
            if not tok_path.is_file():
                raise ConfigError(f"{root} has no tokenizer.json, which a text model needs; re-run "
                                  f"`fedclinic export onnx` into a fresh folder")
            raw = tok_path.read_bytes()
            self._tokenizer = load_tokenizer(raw)
            if self.family == QA_FAMILY:
                from fedclinic.onnx_generate import OnnxQAModel

                self._qa = OnnxQAModel(self.session, self.meta, self._tokenizer)
            else:
                self._pad_id = tokenizer_pad_id(raw)

    def encode(self, texts: Sequence[str], *, pad_to: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, attention_mask) as the trainer builds them: truncated to max_length, right-padded to
        the longest text (or to ``pad_to``)."""
        if self._tokenizer is None:
            raise ConfigError(f"a {self.family} bundle takes feature vectors, not texts; use predict_features")
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()]
        if bad:
            raise DatasetError(f"text {bad[0]} is empty or not a string; every input must be non-empty text")
        from fedclinic.models.text_classification import encode_texts

        return encode_texts(self._tokenizer, texts, max_length=self.max_length, pad_id=self._pad_id, pad_to=pad_to)

    def logits(self, texts: Sequence[str], *, pad_to: int | None = None) -> np.ndarray:
        if self._qa is not None:
            raise ConfigError("a question-answering bundle generates answers; use predict or predict_answers")
        ids, mask = self.encode(texts, pad_to=pad_to)
        return self.session.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0]

    def predict(self, texts: Sequence[str], *, batch_size: int = 32,
                contexts: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """One prediction per text: ``label`` (or ``labels`` for multi-label) and ``scores`` per label; for an
        NER bundle, ``entities``; for a question-answering bundle, ``answer`` (``contexts``: one per text, "" for
        none; only question-answering bundles take them)."""
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
        from fedclinic.models.token_classification import encode_with_offsets, spans_from_tag_ids

        bad = [i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()]
        if bad:
            raise DatasetError(f"text {bad[0]} is empty or not a string; every input must be non-empty text")
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
            for p in probs:
                rows.append({"labels": [lab for lab, v in zip(self.labels, p) if v >= self.threshold],
                             "scores": {lab: float(v) for lab, v in zip(self.labels, p)}})
            return rows
        z = logits - logits.max(axis=1, keepdims=True)
        probs = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
        for p in probs:
            rows.append({"label": self.labels[int(p.argmax())], "scores": {lab: float(v) for lab, v in zip(self.labels, p)}})
        return rows


def _read_card_quietly(root: Path) -> dict[str, Any] | None:
    """The bundle's model card, or None when it has none or it cannot be read (serving does not need it)."""
    from fedclinic.model_card import read_card

    try:
        return read_card(root)
    except ConfigError:
        return None
