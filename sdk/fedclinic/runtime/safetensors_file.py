"""Reading a safetensors file's bytes together with its ``__metadata__`` header (never pickle).

Model packages (:mod:`fedclinic.transport.package`), a site's private tensors
(:mod:`fedclinic.training.private_modules`) and the error-feedback residuals of the codecs
(:mod:`fedclinic.codecs.feedback`) are all stored this way.
"""

from __future__ import annotations

import json

import numpy as np
import safetensors.numpy


def safetensors_with_metadata(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors of a safetensors file's bytes and its ``__metadata__`` ({} when absent). Malformed bytes
    raise whatever safetensors or json raises: callers turn that into their own IntegrityError."""
    tensors = safetensors.numpy.load(data)
    header_len = int.from_bytes(data[:8], "little")
    return tensors, json.loads(data[8:8 + header_len]).get("__metadata__") or {}
