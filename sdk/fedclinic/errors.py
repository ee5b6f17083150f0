"""Exceptions raised by the SDK and the services. Every message says what went wrong and what to do about it.

The tree (every class fedclinic raises on purpose derives from :class:`FedclinicError`)::

    FedclinicError                  base class; catch it to handle every deliberate fedclinic error
    ├── ConfigError                 a configuration file, task definition, command-line value or task spec is
    │   │                           invalid (Task.validate, fedclinic.spec.validation.check_spec, config loaders)
    │   ├── CodecSpecError          (fedclinic.codecs.errors) a codec spec string or codec parameter is invalid
    │   └── SecAggConfigError       (fedclinic.secagg.errors, also a SecAggError) unsafe session parameters
    ├── IntegrityError              bytes did not match their declared hash, size, dtype or shape (uploads,
    │   │                           downloads, spill files, blobs, codec payloads)
    │   ├── ParityError             (fedclinic.export.onnx_export) the exported graph does not compute what the PyTorch model
    │   │                           computes (within the stated tolerance)
    │   └── SecAggIntegrityError    (fedclinic.secagg.errors) authenticated decryption or a share check failed
    ├── DatasetError                a site dataset does not match the task's data contract (names file and row)
    ├── PolicyError                 a site policy forbids what a task asks for
    │   └── SecAggRefusal           (fedclinic.secagg.errors) a client refuses a request that could reveal it
    ├── Refused                     a service will not carry out a request; carries the grpc.StatusCode the
    │                               call ends with (the aggregator's round engine, update admission,
    │                               secure-aggregation coordinator; turned into the call's status by the API)
    ├── CodecInputError             (fedclinic.codecs.errors, also ValueError) a tensor does not fit its codec
    ├── SecAggError                 (fedclinic.secagg.errors) base of the secure-aggregation errors: SecAggAbort
    │                               (too few clients left), SecAggProtocolError (wrong phase, unknown sender),
    │                               SecAggInputError (bad update vector), and the two above
    ├── PkiError                    (fedclinic.pki) a certificate, key, CSR, CRL or CA folder is missing, invalid,
    │                               expired, revoked or mismatched
    ├── AuditError                  (fedclinic.runtime.audit_log) the audit log cannot be written or read as asked
    ├── StoreError                  (aggregator_service.store) the state database cannot be opened or migrated
    ├── BackupError                 (aggregator_service.backup) a backup cannot be taken, verified or restored
    ├── BudgetExceeded              (hospital_agent.privacy_ledger) a task would overspend a dataset's budget
    ├── ApprovalError               (hospital_agent.approvals) an approval decision cannot be made as asked
    └── InstallError                (hospital_agent.install) the service layout cannot be installed as asked
"""

from __future__ import annotations

import grpc


class FedclinicError(Exception):
    """Base class of every error fedclinic raises on purpose."""


class ConfigError(FedclinicError):
    """A configuration file, task definition or command-line value is invalid."""


class IntegrityError(FedclinicError):
    """Bytes did not match their declared hash, size, dtype or shape."""


class DatasetError(FedclinicError):
    """A site dataset does not match the task's data contract. ``str(exc)`` names the file, the row and what is
    in it, for the site's own log and console; ``rule`` (the contract rule that failed, a fixed sentence with no
    value from the data) and ``row`` (1-based, or None) are what may leave the site: :attr:`public`."""

    def __init__(self, message: str, *, rule: str | None = None, row: int | None = None) -> None:
        super().__init__(message)
        self.rule = rule
        self.row = row

    @property
    def public(self) -> str | None:
        """The rule that failed and at most the row number, safe to show outside the site; None when the raiser
        gave no rule (the caller then says only that the data does not meet the contract)."""
        if not self.rule:
            return None
        return f"row {self.row}: {self.rule}" if self.row is not None else self.rule


class PolicyError(FedclinicError):
    """A site policy forbids what a task asks for."""


class Refused(FedclinicError):
    """A request a service will not carry out. ``code`` is the gRPC status the call ends with (e.g.
    ``NOT_FOUND``, ``FAILED_PRECONDITION``, ``INVALID_ARGUMENT``, ``PERMISSION_DENIED``, ``ALREADY_EXISTS``);
    ``message`` says what was refused and what to do instead (it becomes the status details)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
