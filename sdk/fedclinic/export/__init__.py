"""ONNX export of model packages with parity checks, and the graph rewrites that make them fast.
"""

from typing import Any

from fedclinic._moved import moved_attribute


def __getattr__(name: str) -> Any:  # the names of the module this package replaced (deprecated)
    return moved_attribute(__name__, name)
