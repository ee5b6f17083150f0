"""Differential privacy: accounting (:mod:`.accounting`)."""
