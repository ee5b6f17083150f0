"""What ``fedclinic serve`` does with one prediction request, whichever port it came in on.

:class:`PredictionService` checks a request against the bundle (family, input counts, image bytes, the pixel
budget) and runs the bundle. Every problem with the input raises :class:`BadRequest` (HTTP 400, gRPC
INVALID_ARGUMENT) naming the input; an image above the pixel budget raises
:class:`~fedclinic.serving.pixel_budget.ImageTooLarge` (413 / RESOURCE_EXHAUSTED); what the bundle itself
refuses is a :class:`~fedclinic.errors.FedclinicError` (422 / INVALID_ARGUMENT). The HTTP app and the gRPC
servicer only translate these; the limits below are the same on both ports.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import numpy as np

from fedclinic.errors import DatasetError
from fedclinic.serving.pixel_budget import PixelBudget
from fedclinic.spec.model_card import card_summary

#: inputs per request (texts or feature rows)
MAX_ITEMS = 256
#: questions per request to a question-answering bundle (generation costs one model step per answer token)
MAX_QUESTIONS = 32
#: request body limit (bytes)
MAX_BODY = 1 << 20
#: image + report pairs per request to an image-text bundle, and its body limit (a DICOM study image is MBs)
MAX_IMAGES = 16
MAX_IMAGE_BODY = 64 << 20
IMAGE_TEXT = "image-text-classification"


class BadRequest(Exception):
    """A request the service cannot take as sent; the message says what to change (HTTP 400)."""


def default_body_limit(family: str) -> int:
    """The default request size limit of a bundle family (bytes)."""
    return MAX_IMAGE_BODY if family == IMAGE_TEXT else MAX_BODY


class PredictionService:
    """Requests for one loaded bundle (a :class:`fedclinic.serving.bundle.ClassifierBundle`)."""

    def __init__(self, bundle: Any, pixel_budget: PixelBudget | None = None, body_limit: int | None = None) -> None:
        self.bundle = bundle
        self.pixel_budget = pixel_budget or PixelBudget()
        self.body_limit = body_limit if body_limit is not None else default_body_limit(bundle.family)
        info: dict[str, Any] = {"family": bundle.family, "labels": bundle.labels, "multi_label": bundle.multi_label}
        if bundle.multi_label:
            info.update(bundle.decision())
        if getattr(bundle, "image", None) is not None:
            info["image"] = {"channels": 1, "size": bundle.image.size, "mean": bundle.image.mean,
                             "std": bundle.image.std, "formats": ["png", "jpeg", "dicom"],
                             "max_pixels": self.pixel_budget.max_pixels}
        if getattr(bundle, "card", None):
            info["card"] = card_summary(bundle.card)
        #: the model's summary that ``/readyz`` returns
        self.info = info

    @property
    def item_limit(self) -> int:
        """Inputs per request for this bundle's family."""
        if self.bundle.family == IMAGE_TEXT:
            return MAX_IMAGES
        return MAX_QUESTIONS if self.bundle.family == "question-answering" else MAX_ITEMS

    def predict_json(self, body: bytes) -> list[dict]:
        """The predictions for an HTTP request body (the JSON of ``POST /v1/predict``)."""
        try:
            request = json.loads(body or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise BadRequest("the body is not valid JSON") from None
        if not isinstance(request, dict):
            raise BadRequest('expected a JSON object like {"texts": ["..."]}')
        bundle = self.bundle
        if bundle.family == IMAGE_TEXT:
            images = request.get("images")
            if images is not None and not isinstance(images, list):
                raise BadRequest("'images' must be a list of base64 strings, one per report")
            images = images or []
            if len(images) > MAX_IMAGES:
                raise BadRequest(f"{len(images)} images; the limit is {MAX_IMAGES} per call")
            return self._predict_images([_b64_image(v, i) for i, v in enumerate(images)], request.get("texts"))
        if request.get("images") is not None:
            raise BadRequest(f"'images' are for {IMAGE_TEXT} bundles; this model is {bundle.family}")
        key = "features" if bundle.family == "feature-classification" else "texts"
        items = request.get(key)
        if not isinstance(items, list) or not items:
            raise BadRequest(f"expected a non-empty list in {key!r} (this model is {bundle.family})")
        if len(items) > self.item_limit:
            raise BadRequest(f"{len(items)} inputs; the limit is {self.item_limit} per call")
        if key == "texts":
            contexts = self._contexts(request.get("contexts"), len(items))
            return bundle.predict(items) if contexts is None else bundle.predict(items, contexts=contexts)
        try:
            x = np.asarray(items, dtype=np.float32)
        except (TypeError, ValueError):
            raise BadRequest("features must be a list of equal-length lists of numbers") from None
        return bundle.predict_features(x)

    def predict_message(self, request: Any) -> list[dict]:
        """The predictions for a gRPC ``fedclinic.v1.PredictRequest``."""
        bundle = self.bundle
        if bundle.family == "feature-classification":
            if not request.features:
                raise BadRequest("send features (this model is feature-classification)")
            if len(request.features) > self.item_limit:
                raise BadRequest(f"{len(request.features)} inputs; the limit is {self.item_limit} per call")
            rows = [list(r.values) for r in request.features]
            if len({len(r) for r in rows}) != 1:
                raise BadRequest("every feature row must have the same length")
            return bundle.predict_features(np.asarray(rows, dtype=np.float32))
        if bundle.family == IMAGE_TEXT:
            return self._predict_images(list(request.images), list(request.texts))
        if request.images:
            raise BadRequest(f"images are for {IMAGE_TEXT} bundles; this model is {bundle.family}")
        if not request.texts:
            raise BadRequest(f"send texts (this model is {bundle.family})")
        if len(request.texts) > self.item_limit:
            raise BadRequest(f"{len(request.texts)} inputs; the limit is {self.item_limit} per call")
        contexts = self._contexts(list(request.contexts), len(request.texts))
        return (bundle.predict(list(request.texts)) if contexts is None else
                bundle.predict(list(request.texts), contexts=contexts))

    def _predict_images(self, images: list[bytes], texts: Any) -> list[dict]:
        """An image-text bundle's predictions; every problem with the inputs is a :class:`BadRequest` that names
        the input, an image above the pixel budget an ``ImageTooLarge``."""
        if not isinstance(texts, list) or not texts:
            raise BadRequest("expected a non-empty list of reports in 'texts', one per image (this model is "
                             f"{IMAGE_TEXT})")
        if not images:
            raise BadRequest("no images: send one image per report in 'images' (this model is "
                             f"{IMAGE_TEXT}: it reads an image and its report together)")
        if len(texts) > MAX_IMAGES or len(images) > MAX_IMAGES:
            raise BadRequest(f"{max(len(texts), len(images))} inputs; the limit is {MAX_IMAGES} image + report "
                             "pairs per call")
        if len(images) != len(texts):
            raise BadRequest(f"{len(images)} images for {len(texts)} reports; send exactly one image per report")
        for i, image in enumerate(images):  # every header before any pixel is decoded
            self.pixel_budget.check(image, f"image {i}")
        try:
            return self.bundle.predict_image_text(images, texts)
        except DatasetError as exc:
            raise BadRequest(str(exc)) from None

    def _contexts(self, contexts: Any, count: int) -> list[str] | None:
        """The request's contexts (None: none given), checked: only question-answering bundles take them, one
        string per question."""
        if contexts is None or contexts == []:
            return None
        if self.bundle.family != "question-answering":
            raise BadRequest(f"'contexts' are for question-answering bundles; this model is {self.bundle.family}")
        if not isinstance(contexts, list) or not all(isinstance(c, str) for c in contexts):
            raise BadRequest("'contexts' must be a list of strings, one per question (\"\" for none)")
        if len(contexts) != count:
            raise BadRequest(f"{len(contexts)} contexts for {count} questions; give one per question (\"\" for none)")
        return contexts


def _b64_image(value: Any, index: int) -> bytes:
    """The bytes of image ``index`` of a JSON request: standard base64 (RFC 4648; whitespace and a
    ``data:<type>;base64,`` prefix are allowed)."""
    if not isinstance(value, str) or not value.strip():
        raise BadRequest(f"image {index} is missing or not a string; send each image as the base64 of its PNG, "
                         "JPEG or DICOM file's bytes")
    text = value.strip()
    if text.startswith("data:"):
        head, sep, text = text.partition(",")
        if not sep or not head.endswith(";base64"):
            raise BadRequest(f"image {index} is a data URL without ';base64,'; send the file base64-encoded")
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"image {index} is not valid base64 (standard alphabet, '=' padding); send the image "
                         "file's bytes base64-encoded") from None
