"""Data sources in agent.toml: how a [datasets.NAME] table registers one, what `hospital-agent check-config`
says about each, and that the agent's readers (training, statistics, `tasks show`) take a source's rows as
they take a file's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedclinic.errors import ConfigError, DatasetError
from fedclinic.federation.local_federation import LocalFederation, SiteSetup
from fedclinic.proto import task_pb2
from hospital_agent import cli
from hospital_agent.config import AgentConfig
from hospital_agent.site_data import read_ids, read_rows
from hospital_agent.site_statistics import answer_statistics

from tests.helpers.clinical_sources import (
    clinical_records,
    fhir_settings,
    omop_settings,
    write_fhir_export,
    write_sqlite_omop,
)

SQL = ("SELECT n.note_text AS text, CASE c.condition_concept_id WHEN 316139 THEN 'cardio' ELSE 'neuro' END AS label, "
       "n.person_id FROM note n JOIN condition_occurrence c ON c.person_id = n.person_id AND c.condition_concept_id IN "
       "(316139, 380378) AND c.condition_start_date <= date(n.note_date, '+30 days') ORDER BY n.note_id")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sources")
    write_sqlite_omop(folder / "cdw.sqlite", clinical_records(24, 0))
    write_fhir_export(folder / "fhir", clinical_records(32, 1))
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = clinical_records(10, 2)
    pq.write_table(pa.table({"text": [r["text"] for r in rows], "label": [r["label"] for r in rows]}),
                   folder / "notes.parquet")
    return folder


def datasets(data: Path) -> dict:
    return {"omop": omop_settings(engine="sqlite", database=str(data / "cdw.sqlite")),
            "fhir": fhir_settings(data / "fhir"),
            "sql": {"source": "sql", "engine": "sqlite", "database": str(data / "cdw.sqlite"), "query": SQL,
                    "group_field": "person_id"},
            "pq": {"path": str(data / "notes.parquet")}}


def load(data: Path, **tables) -> AgentConfig:
    doc = {"aggregator": "a:1", "work_dir": "w", "tls": {"cert": "c", "key": "k", "ca": "ca"},
           "datasets": {**datasets(data), **tables}}
    return AgentConfig.from_dict(doc, base=data, source="agent.toml")


def spec(dataset: str, family: str = "text-classification", **kw) -> task_pb2.TaskSpec:
    return task_pb2.TaskSpec(family=family, dataset=dataset, labels=["cardio", "neuro"],
                             training=task_pb2.TrainingConfig(max_length=16), **kw)


def test_each_source_registers_with_its_patient_ids_and_reads_like_a_file(data):
    config = load(data)
    assert {n: (e.source.kind, e.group_field) for n, e in config.datasets.items()} == {
        "omop": ("omop", "person_id"), "fhir": ("fhir", "subject"), "sql": ("sql", "person_id"), "pq": ("parquet", None)}
    assert config.policy.allowed_datasets == ("omop", "fhir", "sql", "pq")
    omop, sql = read_rows(config.datasets["omop"], spec("omop")), read_rows(config.datasets["sql"], spec("sql"))
    assert omop == sql and len(omop) == 24  # the OMOP mapping and the admin's equivalent SELECT agree
    assert read_ids(config.datasets["fhir"], rows=32)[0] == "Patient/101"
    with pytest.raises(DatasetError, match="24 patient ids for 5 examples"):
        read_ids(config.datasets["sql"], rows=5)
    no_ids = load(data, x={"source": "sql", "engine": "sqlite", "database": str(data / "cdw.sqlite"),
                           "query": "SELECT note_text AS text, 'cardio' AS label, NULL AS pid FROM note",
                           "group_field": "pid"}).datasets["x"]
    with pytest.raises(DatasetError) as caught:
        read_ids(no_ids)
    assert caught.value.public == "row 1: a row has no patient id (the column the site's group_field names)"


def test_statistics_answer_from_a_source(data):
    values = answer_statistics(spec("fhir"), task_id="t", config=load(data), min_cell=1, ledger=None)
    assert (values["rows"], values["label/cardio"], values["label/neuro"]) == (32, 16, 16)


def test_a_task_of_another_family_on_a_source_is_declined_with_the_reason(data):
    with pytest.raises(DatasetError) as caught:
        read_rows(load(data).datasets["omop"], spec("omop", family="token-classification"))
    assert caught.value.public == "the dataset's source does not serve this task's family"


@pytest.mark.parametrize("table, says", [
    ({"source": "omop", "engine": "sqlite", "database": "x", "labels": {"1": "a"}, "path": "x"}, "unknown setting"),
    ({"source": "sql", "engine": "sqlite", "database": "x", "querry": "SELECT 1"}, "unknown setting"),
    ({"source": "sql", "engine": "sqlite", "database": "x"}, "needs query"),
    ({"source": "sql", "engine": "sqlite", "database": "x", "query": "DELETE FROM note"}, "must be a SELECT"),
    ({"source": "warehouse"}, "source must be one of sql, omop, fhir"),
    ({"source": "sql", "engine": "postgresql", "dsn": "host=db", "password": "pw", "query": "SELECT 1"},
     "do not put the database password"),
    ({"path": "x.parquet", "entities_field": "e"}, "unknown setting"),
])
def test_a_bad_source_table_is_refused_with_what_to_write(data, table, says):
    with pytest.raises(ConfigError, match=says):
        load(data, bad=table)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    fed = LocalFederation(tmp_path_factory.mktemp("fed"), [SiteSetup("site-a")])
    fed.make_pki()
    return fed


def check_config(pki, tmp_path, tables: dict, capsys) -> tuple[int, str, str]:
    pki.sites["site-a"].datasets = tables
    pki.address = "127.0.0.1:1"
    path = pki.write_agent_config("site-a")
    code = cli.main(["check-config", "--config", str(path)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_check_config_says_what_each_source_holds(pki, data, tmp_path, capsys):
    code, out, err = check_config(pki, tmp_path, datasets(data), capsys)
    assert code == 0, err
    assert "dataset 'omop': omop source" in out and "ok: read-only: opened with mode=ro" in out
    assert "ok: 25 note(s), 24 with a mapped condition within 30 day(s); per label: cardio 12, neuro 12" in out
    assert "note: 1 note(s) have no mapped condition in the window and are left out" in out
    assert "dataset 'sql': sql source" in out and "ok: query: 24 row(s)" in out
    assert "ok: path: 33 usable DocumentReference/DiagnosticReport row(s), 32 with a mapped code" in out
    assert "dataset 'pq': parquet source" in out and "columns text, label present, 10 row(s)" in out
    assert "configuration OK" in out


def test_check_config_names_each_broken_source_and_the_fix(pki, data, tmp_path, capsys):
    (tmp_path / "bad-fhir").mkdir()
    (tmp_path / "bad-fhir" / "DocumentReference.ndjson").write_text(json.dumps(
        {"resourceType": "DocumentReference", "status": "current", "content": "x"}) + "\n")
    tables = {"sql": {**datasets(data)["sql"], "query": "SELECT note_text, person_id FROM note"},
              "gone": {**datasets(data)["sql"], "database": str(tmp_path / "gone.sqlite")},
              "empty": {**datasets(data)["sql"], "query": SQL.replace("ORDER BY", "AND 1 = 0 ORDER BY")},
              "fhir": fhir_settings(tmp_path / "bad-fhir"),
              "pq": {"path": str(tmp_path / "missing.parquet")}}
    code, out, err = check_config(pki, tmp_path, tables, capsys)
    assert code == 1 and "5 problem(s) found" in out, err
    problems = {line.split("'")[1]: line for line in err.splitlines() if line.startswith("problem: dataset")}
    assert "no column(s) ['text', 'label']; found columns ['note_text', 'person_id']" in problems["sql"]
    assert "no such database file; check database =" in problems["gone"]
    assert "the query returns no rows; check its WHERE clause" in problems["empty"]
    assert "DocumentReference.ndjson: line 1: not a valid FHIR R4 DocumentReference: content:" in problems["fhir"]
    assert "missing.parquet: file not found" in problems["pq"]
