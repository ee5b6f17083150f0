"""Metrics that score predictions: generated answers and multi-label classification.
"""
