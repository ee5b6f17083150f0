"""Data sources the site admin registers in agent.toml, read where the data lives: a SQL query (PostgreSQL or
SQLite), an OMOP CDM mapping, a FHIR R4 bulk NDJSON export, a Parquet file.

A dataset table names its source; a task only names the dataset (it can never choose a source, pass SQL or a
path)::

    [datasets.notes]
    source = "omop"          # "sql" | "omop" | "fhir"; a Parquet file is path = "x.parquet" (format "parquet")
    ...

:func:`parse_source` builds the :class:`DataSource` of a table (ConfigError says what to fix);
``hospital_agent.site_data`` reads it through :func:`fedclinic.data.text.read_source_classification`, which gives
the same ``Example`` rows a JSONL file gives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedclinic.data.sources.database import DATABASE_KEYS
from fedclinic.data.sources.fhir_ndjson import FHIR_KEYS, FhirNdjsonSource
from fedclinic.data.sources.omop import OMOP_KEYS, OmopSource
from fedclinic.data.sources.parquet import ParquetSource
from fedclinic.data.sources.records import DataSource, Record, SourceCheck
from fedclinic.data.sources.sql_query import SQL_KEYS, SqlSource
from fedclinic.errors import ConfigError

#: the values of ``source =``
SOURCE_KINDS = ("sql", "omop", "fhir")
#: the keys each kind adds to a dataset table
SOURCE_KEYS = {"sql": ("source",) + DATABASE_KEYS + SQL_KEYS,
               "omop": ("source",) + DATABASE_KEYS + OMOP_KEYS,
               "fhir": ("source",) + FHIR_KEYS}


def parse_source(name: str, entry: dict[str, Any], base: Path, where: str) -> DataSource:
    """The DataSource of the dataset table ``entry`` (its ``source`` one of :data:`SOURCE_KINDS`); relative
    paths are resolved against ``base`` (the configuration file's folder)."""
    kind = entry.get("source")
    if kind == "sql":
        return SqlSource.from_entry(name, entry, base, where)
    if kind == "omop":
        return OmopSource.from_entry(name, entry, base, where)
    if kind == "fhir":
        return FhirNdjsonSource.from_entry(name, entry, base, where)
    raise ConfigError(f"{where}: source must be one of {', '.join(SOURCE_KINDS)}, got {kind!r} (a file dataset "
                      "has no source key, only path)")


__all__ = ["DataSource", "FhirNdjsonSource", "OmopSource", "ParquetSource", "Record", "SOURCE_KEYS", "SOURCE_KINDS",
           "SourceCheck", "SqlSource", "parse_source"]
