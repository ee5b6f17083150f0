"""Site dataset readers (text, NER, QA, image manifests), tag schemes, prompt layout and the partitioners
that split one dataset over simulated sites.
"""

from typing import Any

from fedclinic._moved import moved_attribute


def __getattr__(name: str) -> Any:  # the names of the module this package replaced (deprecated)
    return moved_attribute(__name__, name)
