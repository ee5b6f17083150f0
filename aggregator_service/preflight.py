"""``fedclinic-aggregator check-config``: everything wrong with an aggregator's configuration, before it serves.

It reads ``aggregator.toml`` (and its environment overrides) as ``serve`` does, and checks what ``serve`` would
trip over at start, each with what to do: unknown or malformed settings, no CRL without ``allow_no_crl``, the
TLS pair (files readable, key 0600 and belonging to the certificate, issued by the CA, valid now, role
``aggregator``), the CRL (signed by that CA), a writable ``state_dir`` (created when missing, as ``serve``
does), and with ``[state] database`` on PostgreSQL one connection to it: reachable with the configured password,
and a schema this build can use (older: ``serve`` migrates it; newer: refused). It opens no port and writes no
stored state.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from fedclinic.errors import FedclinicError
from fedclinic.pki import RevocationList, check_own_certificate

from aggregator_service.config import AggregatorConfig


def check_config(path: str | Path) -> tuple[list[str], list[str]]:
    """``(notes, problems)`` of an aggregator configuration: what was found, and everything wrong with it, each
    saying what to do (``problems == []`` when the aggregator may start with it)."""
    try:
        config = AggregatorConfig.load(path)
    except FedclinicError as exc:
        return [], [str(exc)]
    notes: list[str] = []
    problems: list[str] = []
    try:
        config.require_crl_or_dev_mode(str(path))
    except FedclinicError as exc:
        problems.append(str(exc))
    try:
        ident = check_own_certificate(config.tls.cert, config.tls.key, config.tls.ca, expected_role="aggregator")
        notes.append(f"certificate: aggregator {ident.name!r}, valid until {ident.not_after:%Y-%m-%d %H:%M} UTC")
    except FedclinicError as exc:
        problems.append(str(exc))
    if config.crl is not None:
        try:
            RevocationList(config.crl, config.tls.ca)
            notes.append(f"revocation list: {config.crl}")
        except (FedclinicError, OSError) as exc:
            problems.append(f"[tls] crl {config.crl}: {exc}")
    try:
        config.state_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=config.state_dir):
            pass
    except OSError as exc:
        problems.append(f"state_dir {config.state_dir} is not writable ({exc.strerror}); create it and give the "
                        "aggregator's user write access")
    if config.state.is_postgresql:
        _check_database(config, notes, problems)
    return notes, problems


def _check_database(config: AggregatorConfig, notes: list[str], problems: list[str]) -> None:
    from aggregator_service.store import SCHEMA_VERSION
    from aggregator_service.store.database_probe import probe_postgres
    from aggregator_service.store.postgres_schema import check_not_newer

    try:
        found = probe_postgres(config.state)
        check_not_newer(found.schema_version, found.where)  # the refusal serve would give
    except FedclinicError as exc:  # StoreError, ConfigError (the password file)
        problems.append(str(exc))
        return
    if found.schema_version == SCHEMA_VERSION:
        schema = f"schema version {found.schema_version} (this build's)"
    elif found.schema_version == 0:
        schema = "no fedclinic schema yet (serve creates it)"
    else:
        schema = f"schema version {found.schema_version} (serve migrates it to {SCHEMA_VERSION})"
    notes.append(f"state database: PostgreSQL {found.server_version} at {found.where}, {schema}")
