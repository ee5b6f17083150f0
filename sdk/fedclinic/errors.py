"""Exceptions raised by the SDK. Every message says what went wrong and what to do about it."""

from __future__ import annotations


class FedclinicError(Exception):
    """Base class of every error fedclinic raises on purpose."""


class ConfigError(FedclinicError):
    """A configuration file, task definition or command-line value is invalid."""


class IntegrityError(FedclinicError):
    """Bytes did not match their declared hash, size, dtype or shape."""


class DatasetError(FedclinicError):
    """A site dataset does not match the task's data contract (names the file and row)."""


class PolicyError(FedclinicError):
    """A site policy forbids what a task asks for."""
