"""Serving exported bundles: loading and predicting (numpy + onnxruntime, no torch), generation, and the
HTTP/JSON and gRPC services.
"""

from typing import Any

from fedclinic._moved import moved_attribute


def __getattr__(name: str) -> Any:  # the names of the module this package replaced (deprecated)
    return moved_attribute(__name__, name)
