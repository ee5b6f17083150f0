"""Real offline demo data and pretrained assets (installed from PyPI as data-only packages, never imported)."""

from __future__ import annotations

from fedclinic.assets.drugreview import condition_classification, load_drug_reviews, minilm_path
from fedclinic.assets.smollm2 import smollm2_folder

__all__ = ["condition_classification", "load_drug_reviews", "minilm_path", "smollm2_folder"]
