"""FHIR R4 bulk NDJSON exports and Parquet files as data sources: the same rows as the JSONL twin, bad
resources named by file, line and reason, missing columns and files."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest

from fedclinic.data.sources import ParquetSource, parse_source
from fedclinic.data.sources.fhir_ndjson import BAD_JSON, BAD_RESOURCE, NO_TEXT
from fedclinic.data.text import read_classification, read_source_classification
from fedclinic.errors import ConfigError, DatasetError

from tests.helpers.clinical_sources import (
    FHIR_LABELS,
    clinical_records,
    fhir_settings,
    jsonl_twin,
    omop_script,
    write_fhir_export,
)

LABELS = ["cardio", "neuro"]
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fhir")
    records = clinical_records(32, 1)
    return write_fhir_export(folder / "export", records), records, folder


def test_a_fhir_export_gives_the_rows_of_its_jsonl_twin(export):
    root, records, folder = export
    source = parse_source("notes", fhir_settings(root), folder, "x")
    twin = read_classification(jsonl_twin(records, folder / "twin.jsonl"), label_set=LABELS)
    assert read_source_classification(source, label_set=LABELS) == twin
    assert [r.patient_id for r in source.records()] == [f"Patient/{r['person_id']}" for r in records]
    check = source.check()
    assert not check.problems, check.problems
    assert ("path: 33 usable DocumentReference/DiagnosticReport row(s), 32 with a mapped code; per label: cardio 16, "
            "neuro 16") in check.facts
    assert any("1 row(s) have no mapped code" in n for n in check.notes)


def bad_copy(export, tmp_path: Path, line: str) -> Path:
    root, _, _ = export
    bad = tmp_path / "bad"
    shutil.copytree(root, bad)
    with open(bad / "DocumentReference.ndjson", "a") as fh:
        fh.write(line + "\n")
    return bad


@pytest.mark.parametrize("line, rule, says", [
    ('{"resourceType": "DocumentReference", "status": "current", "content": "not a list"}', BAD_RESOURCE,
     "not a valid FHIR R4 DocumentReference: content: Input should be a valid list"),
    ('{"resourceType": "DocumentReference", "status": "current", "content": [{"attachment": {"data": "!!notbase64"}}]}',
     BAD_RESOURCE, "content.0.attachment.data: Base64 decoding error"),
    ('{"resourceType": "DocumentReference", "status": "current", "category": [{"coding": [{"system": '
     '"http://snomed.info/sct", "code": "84114007"}]}], "content": [{"attachment": {"contentType": "application/pdf", '
     '"data": "JVBERi0="}}]}', NO_TEXT, "has no text/\\* attachment"),
    ('{"resourceType": "DocumentReference", "status": ', BAD_JSON, "not a FHIR resource in JSON"),
])
def test_a_bad_resource_is_named_by_file_line_and_reason(export, tmp_path, line, rule, says):
    bad = bad_copy(export, tmp_path, line)
    source = parse_source("notes", fhir_settings(bad), tmp_path, "x")
    with pytest.raises(DatasetError, match=says) as caught:
        read_source_classification(source, label_set=LABELS)
    assert "DocumentReference.ndjson: line 18" in str(caught.value) and caught.value.rule == rule
    # the tolerant reading (statistics) hands the row over and keeps the others
    skipped: list[DatasetError] = []
    assert len(read_source_classification(source, label_set=LABELS, on_bad_row=skipped.append)) == 32
    assert [e.rule for e in skipped] == [rule]
    assert any("line 18" in p for p in source.check().problems)


def test_an_inline_conclusion_and_a_binary_of_the_export_are_texts(export, tmp_path):
    root, records, _ = export
    rows = {r.where.rsplit("/", 1)[1]: r.text for r in parse_source("n", fhir_settings(root), tmp_path, "x").records()}
    reports = [json.loads(x) for x in (root / "DiagnosticReport.ndjson").read_text().splitlines()]
    assert "conclusion" in reports[0] and rows["DiagnosticReport.ndjson: line 1"] == records[0]["text"]
    documents = [json.loads(x) for x in (root / "DocumentReference.ndjson").read_text().splitlines()]
    by_url = [n for n, d in enumerate(documents, 1) if "url" in d["content"][0]["attachment"]]
    assert by_url and rows[f"DocumentReference.ndjson: line {by_url[0]}"] == records[16 + by_url[0] - 1]["text"]


def test_fhir_settings_and_a_missing_export_say_what_to_fix(tmp_path):
    with pytest.raises(ConfigError, match="needs path"):
        parse_source("n", {"source": "fhir", "labels": FHIR_LABELS}, tmp_path, "x")
    with pytest.raises(ConfigError, match="resource_types must list some of"):
        parse_source("n", {**fhir_settings(tmp_path), "resource_types": ["Observation"]}, tmp_path, "x")
    source = parse_source("n", fhir_settings(tmp_path / "missing"), tmp_path, "x")
    with pytest.raises(DatasetError, match="no such export folder"):
        source.records()
    (tmp_path / "empty").mkdir()
    assert any("holds no .ndjson file" in p
               for p in parse_source("n", fhir_settings(tmp_path / "empty"), tmp_path, "x").check().problems)


def test_parquet_gives_the_rows_of_its_jsonl_twin_and_names_missing_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = clinical_records(12, 3)
    pq.write_table(pa.table({"note": [r["text"] for r in records], "dx": [r["label"] for r in records],
                             "pid": [r["person_id"] for r in records]}), tmp_path / "notes.parquet")
    source = ParquetSource("n", tmp_path / "notes.parquet", text_field="note", label_field="dx", group_field="pid")
    twin = read_classification(jsonl_twin(records, tmp_path / "twin.jsonl"), label_set=LABELS)
    assert read_source_classification(source, label_set=LABELS) == twin
    assert not source.check().problems and "12 row(s)" in source.check().facts[0]
    # a list column holds a multi-label row's labels
    pq.write_table(pa.table({"text": ["chest pain and seizure"], "label": [["neuro", "cardio"]]}), tmp_path / "m.parquet")
    rows = read_source_classification(ParquetSource("m", tmp_path / "m.parquet"), label_set=LABELS, multi_label=True)
    assert rows[0].labels == ("cardio", "neuro")
    with pytest.raises(DatasetError, match=r"no column\(s\) \['text', 'label'\]; found columns \['note', 'dx', 'pid'\]"):
        ParquetSource("n", tmp_path / "notes.parquet").records()
    (tmp_path / "not.parquet").write_text("text,label\n")
    assert "not a readable Parquet file" in ParquetSource("n", tmp_path / "not.parquet").check().problems[0]


def test_the_committed_fixtures_are_what_the_helpers_write(tmp_path):
    """docs/hospital-it.md loads tests/fixtures/omop_demo.sql and reads tests/fixtures/fhir_demo/: they stay the
    records the tests use."""
    assert (FIXTURES / "omop_demo.sql").read_text() == omop_script(clinical_records(24, 0))
    fresh = write_fhir_export(tmp_path / "fhir", clinical_records(32, 1))
    assert sorted(p.name for p in (FIXTURES / "fhir_demo").iterdir()) == sorted(p.name for p in fresh.iterdir())
    for p in fresh.iterdir():
        assert (FIXTURES / "fhir_demo" / p.name).read_text() == p.read_text(), p.name
    assert base64  # (the export's texts are base64 attachments)


def test_an_empty_parquet_file_is_an_empty_dataset(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([], pa.string()), "label": pa.array([], pa.string())}),
                   tmp_path / "empty.parquet")
    source = ParquetSource("n", tmp_path / "empty.parquet")
    with pytest.raises(DatasetError, match="the dataset is empty"):
        read_source_classification(source, label_set=LABELS)
    assert "the file has no rows" in source.check().problems[0]
