"""Differential privacy at the sites: DP-SGD (:mod:`.dp_sgd`, with ghost clipping, :mod:`.ghost`, the per-example
loop, :mod:`.per_example_clipping`, and per-example objectives, :mod:`.per_example`) on top of the trainer, and its
accounting (:mod:`.accounting`, the torch-free math of :mod:`fedclinic.strategies.dp_accounting`)."""
