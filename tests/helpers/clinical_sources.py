"""Synthetic clinical records in the shapes hospitals keep them: an OMOP CDM database (DDL + rows, for SQLite
and PostgreSQL), a FHIR R4 bulk NDJSON export, and their JSONL twin (the same rows as a JSONL dataset).

Each record is one of :func:`tests.helpers.text_models.make_examples` (``n``, ``seed``): note ``i`` (1-based
``note_id``) of person ``100 + i``, its text and label. The OMOP twin adds what a warehouse also holds and the
mapping must skip (a condition of the other label outside the window, an unmapped diabetes condition, a note
with no mapped condition); the FHIR export adds a Patient resource, a document with no mapped code, a Binary
holding one note's text and DiagnosticReports whose text is their inline conclusion. Read through the source
settings below, both give exactly the JSONL twin's rows in its order.

``tests/fixtures/omop_demo.sql`` and ``tests/fixtures/fhir_demo/`` are these for ``(24, 0)`` and ``(32, 1)``,
committed for docs/hospital-it.md (a test keeps them equal to what this module writes).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from pathlib import Path

from tests.helpers.text_models import make_examples

#: OMOP condition_concept_id -> label (SNOMED heart failure, epilepsy); 201826 (type 2 diabetes) stays unmapped
OMOP_LABELS = {"316139": "cardio", "380378": "neuro"}
OMOP_CONCEPT = {v: int(k) for k, v in OMOP_LABELS.items()}
UNMAPPED_CONCEPT = 201826
#: FHIR coding -> label (SNOMED CT)
SNOMED = "http://snomed.info/sct"
FHIR_LABELS = {f"{SNOMED}|84114007": "cardio", f"{SNOMED}|84757009": "neuro"}
FHIR_CODE = {v: k.split("|")[1] for k, v in FHIR_LABELS.items()}
START = dt.date(2024, 1, 1)

OMOP_DDL = """\
-- A small synthetic OMOP CDM v5.4 extract (the columns fedclinic reads, and a few more): SQLite and PostgreSQL.
CREATE TABLE person (
    person_id BIGINT PRIMARY KEY,
    gender_concept_id INTEGER NOT NULL,
    year_of_birth INTEGER NOT NULL,
    race_concept_id INTEGER NOT NULL,
    ethnicity_concept_id INTEGER NOT NULL
);
CREATE TABLE note (
    note_id BIGINT PRIMARY KEY,
    person_id BIGINT NOT NULL REFERENCES person (person_id),
    note_date DATE NOT NULL,
    note_type_concept_id INTEGER NOT NULL,
    note_class_concept_id INTEGER NOT NULL,
    note_title VARCHAR(250),
    note_text TEXT NOT NULL,
    encoding_concept_id INTEGER NOT NULL,
    language_concept_id INTEGER NOT NULL
);
CREATE TABLE condition_occurrence (
    condition_occurrence_id BIGINT PRIMARY KEY,
    person_id BIGINT NOT NULL REFERENCES person (person_id),
    condition_concept_id INTEGER NOT NULL,
    condition_start_date DATE NOT NULL,
    condition_type_concept_id INTEGER NOT NULL
);
"""


def clinical_records(n: int, seed: int) -> list[dict]:
    """``n`` records ``{note_id, person_id, date, text, label}`` (the JSONL twin's rows plus their keys)."""
    return [{"note_id": i, "person_id": 100 + i, "date": START + dt.timedelta(days=3 * i), **row}
            for i, row in enumerate(make_examples(n, seed), start=1)]


def jsonl_twin(records: list[dict], path: Path) -> Path:
    """``path``: the records as a JSONL dataset ``{"text", "label", "patient_id"}`` in source order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": r["text"], "label": r["label"], "patient_id": r["person_id"]}) + "\n"
                            for r in records))
    return path


def _q(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def omop_script(records: list[dict]) -> str:
    """DDL + INSERTs of the OMOP twin of ``records`` (one script for SQLite and PostgreSQL)."""
    other = {"cardio": "neuro", "neuro": "cardio"}
    people, notes, conditions = [], [], []
    extra = len(records) + 1  # a note whose person has only an unmapped condition: left out by the mapping
    for r in records + [{"note_id": extra, "person_id": 100 + extra, "date": START, "label": None,
                         "text": "routine follow up visit"}]:
        people.append(f"({r['person_id']}, 8507, {1940 + r['note_id'] % 50}, 0, 0)")
        notes.append(f"({r['note_id']}, {r['person_id']}, '{r['date']}', 44814637, 44814637, 'progress note', "
                     f"{_q(r['text'])}, 32678, 4180186)")
    cid = 0
    for r in records + [{"person_id": 100 + extra, "date": START, "label": None}]:
        rows = [(UNMAPPED_CONCEPT, r["date"])]
        if r["label"]:
            rows.append((OMOP_CONCEPT[r["label"]], r["date"] + dt.timedelta(days=r["person_id"] % 7)))  # in window
            rows.append((OMOP_CONCEPT[other[r["label"]]], r["date"] + dt.timedelta(days=400)))      # outside it
        for concept, day in rows:
            cid += 1
            conditions.append(f"({cid}, {r['person_id']}, {concept}, '{day}', 32817)")
    return (OMOP_DDL
            + "INSERT INTO person VALUES\n    " + ",\n    ".join(people) + ";\n"
            + "INSERT INTO note VALUES\n    " + ",\n    ".join(notes) + ";\n"
            + "INSERT INTO condition_occurrence VALUES\n    " + ",\n    ".join(conditions) + ";\n")


def write_sqlite_omop(path: Path, records: list[dict]) -> Path:
    """An SQLite database file holding the OMOP twin of ``records``."""
    import sqlite3

    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path)
    try:
        db.executescript(omop_script(records))
        db.commit()
    finally:
        db.close()
    return path


def write_fhir_export(folder: Path, records: list[dict]) -> Path:
    """``folder``: a bulk NDJSON export of ``records`` (first half DiagnosticReport, second half
    DocumentReference, so that the files' order is the records' order), plus resources the source skips."""
    folder.mkdir(parents=True, exist_ok=True)
    half = len(records) // 2
    reports, documents, binaries, patients = [], [], [], []
    for k, r in enumerate(records):
        code = {"coding": [{"system": SNOMED, "code": FHIR_CODE[r["label"]]}]}
        subject = {"reference": f"Patient/{r['person_id']}"}
        data = base64.b64encode(r["text"].encode()).decode()
        patients.append({"resourceType": "Patient", "id": str(r["person_id"])})
        if k < half:
            report = {"resourceType": "DiagnosticReport", "id": f"dr-{r['note_id']}", "status": "final",
                      "code": {"coding": [{"system": "http://loinc.org", "code": "11526-1"}]}, "subject": subject,
                      "effectiveDateTime": str(r["date"]), "conclusionCode": [code]}
            if k % 3 == 0:
                report["conclusion"] = r["text"]  # the text inline
            else:
                report["presentedForm"] = [{"contentType": "text/plain; charset=utf-8", "data": data}]
            reports.append(report)
        else:
            attachment = {"contentType": "text/plain"}
            if k % 4 == 0:
                attachment["url"] = f"Binary/b-{r['note_id']}"
                binaries.append({"resourceType": "Binary", "id": f"b-{r['note_id']}", "contentType": "text/plain",
                                 "data": data})
            else:
                attachment["data"] = data
            documents.append({"resourceType": "DocumentReference", "id": f"doc-{r['note_id']}", "status": "current",
                              "type": {"coding": [{"system": "http://loinc.org", "code": "11506-3"}]},
                              "category": [code], "subject": subject, "date": f"{r['date']}T09:00:00Z",
                              "content": [{"attachment": attachment}]})
    # a progress note coded only with LOINC: no mapped code, left out
    documents.append({"resourceType": "DocumentReference", "id": "doc-unmapped", "status": "current",
                      "type": {"coding": [{"system": "http://loinc.org", "code": "11506-3"}]},
                      "subject": {"reference": "Patient/999"},
                      "content": [{"attachment": {"contentType": "text/plain",
                                                  "data": base64.b64encode(b"routine follow up").decode()}}]})
    for name, rows in (("DiagnosticReport", reports), ("DocumentReference", documents), ("Binary", binaries),
                       ("Patient", patients)):
        (folder / f"{name}.ndjson").write_text("".join(json.dumps(x, sort_keys=True) + "\n" for x in rows))
    return folder


def omop_settings(**db) -> dict:
    """The ``[datasets.NAME]`` table of the OMOP twin (``db``: engine and where)."""
    return {"source": "omop", **db, "window_days": 30, "labels": dict(OMOP_LABELS)}


def fhir_settings(folder: Path) -> dict:
    """The ``[datasets.NAME]`` table of the FHIR twin."""
    return {"source": "fhir", "path": str(folder), "labels": dict(FHIR_LABELS)}


def load_postgres_omop(server, dbname: str, records: list[dict], *, schema: str = "cdm") -> dict:
    """Load the OMOP twin of ``records`` into ``schema`` of database ``dbname`` on ``server``
    (tests/helpers/postgres_server.py) and create a login role that may only read it; returns the OMOP table
    settings that connect as that role (``dsn`` without a password, ``password_file`` beside the server's)."""
    import secrets

    role, password = f"reader_{dbname}", secrets.token_urlsafe(12)
    server.admin_sql(f"CREATE SCHEMA {schema}; SET search_path = {schema};\n" + omop_script(records)
                     + f"CREATE SEQUENCE {schema}.note_seq;", dbname)
    server.admin_sql(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'; GRANT USAGE ON SCHEMA {schema} TO {role}; "
                     f"GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {role}; "
                     f"GRANT USAGE, SELECT ON SEQUENCE {schema}.note_seq TO {role}", dbname)
    pw = server.root / f"{role}.password"
    pw.write_text(password + "\n")
    pw.chmod(0o600)
    return {"engine": "postgresql", "dsn": f"host={server.host} port={server.port} dbname={dbname} user={role}",
            "password_file": str(pw), "schema": schema}
