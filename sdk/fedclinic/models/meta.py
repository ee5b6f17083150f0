"""What every built model reads from its ``fedclinic_model.json`` (shared by the model families)."""

from __future__ import annotations


class ModelMeta:
    """Properties over ``self.meta`` (the parsed ``fedclinic_model.json``) common to every family."""

    meta: dict

    @property
    def family(self) -> str:
        return str(self.meta.get("family"))

    @property
    def labels(self) -> list[str]:
        return list(self.meta["labels"])

    @property
    def multi_label(self) -> bool:
        return bool(self.meta.get("multi_label", False))

    @property
    def architecture(self) -> str:
        return str(self.meta["architecture"])
