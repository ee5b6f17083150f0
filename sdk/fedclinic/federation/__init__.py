"""Federations on one machine: the in-process simulator, experiment grids, real local processes
(LocalFederation) and the demo.
"""
