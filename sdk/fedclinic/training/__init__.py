"""A site's local work: the trainer, the local optimizers, SAFL layer selection and FedNER's private modules.
"""

from typing import Any

from fedclinic._moved import moved_attribute


def __getattr__(name: str) -> Any:  # the names of the module this package replaced (deprecated)
    return moved_attribute(__name__, name)
