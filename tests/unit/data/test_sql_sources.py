"""SQL and OMOP data sources on SQLite (the same SQL as on PostgreSQL, tests/integration/test_postgres_sources.py):
the guard on the admin's query, the read-only transaction, column mapping, the OMOP label window, and errors
that say what to fix."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from fedclinic.data.sources import OmopSource, parse_source
from fedclinic.data.sources.database import REFUSED, UNREACHABLE, Database
from fedclinic.data.sources.sql_guard import check_select
from fedclinic.data.text import read_classification, read_source_classification
from fedclinic.errors import ConfigError, DatasetError

from tests.helpers.clinical_sources import clinical_records, jsonl_twin, omop_settings, write_sqlite_omop

LABELS = ["cardio", "neuro"]


@pytest.mark.parametrize("query", [
    "SELECT note_text AS text, 'cardio' AS label FROM note",
    "  select * from note where note_text <> 'drop table note; delete' ;  ",
    'WITH n AS (SELECT * FROM note) SELECT "update" FROM n -- insert into x',
    "SELECT replace(note_text, 'a', 'b') AS text FROM note /* ; create */",
])
def test_the_guard_lets_one_select_through(query):
    assert check_select(query, "q").lower().startswith(("select", "with"))
    assert not check_select(query, "q").endswith(";")


@pytest.mark.parametrize("query, says", [
    ("SELECT 1; SELECT 2", "exactly one SELECT"),
    ("SELECT 1; DROP TABLE note", "exactly one SELECT"),
    ("DELETE FROM note", "must be a SELECT"),
    ("WITH gone AS (DELETE FROM note RETURNING *) SELECT * FROM gone", "DELETE"),
    ("SELECT * INTO copy_of_notes FROM note", "INTO"),
    ("SELECT * FROM note FOR UPDATE", "row locks"),
    ("SELECT 'unterminated FROM note", "unterminated"),
    ("", "non-empty"),
])
def test_the_guard_refuses_what_is_not_one_read_only_select(query, says):
    with pytest.raises(ConfigError, match=says):
        check_select(query, "agent.toml: [datasets.notes] query")


@pytest.fixture(scope="module")
def omop(tmp_path_factory):
    folder = tmp_path_factory.mktemp("omop")
    records = clinical_records(24, 0)
    return folder, write_sqlite_omop(folder / "cdw.sqlite", records), records


def sql_source(folder: Path, db: Path, **entry):
    table = {"source": "sql", "engine": "sqlite", "database": str(db),
             "query": "SELECT note_text AS text, CASE c.condition_concept_id WHEN 316139 THEN 'cardio' ELSE 'neuro' "
                      "END AS label, n.person_id FROM note n JOIN condition_occurrence c ON c.person_id = n.person_id "
                      "AND c.condition_concept_id IN (316139, 380378) AND c.condition_start_date <= "
                      "date(n.note_date, '+30 days') ORDER BY n.note_id", "group_field": "person_id", **entry}
    return parse_source("notes", table, folder, "agent.toml: [datasets.notes]")


def test_a_sql_source_gives_the_rows_of_its_jsonl_twin(omop):
    folder, db, records = omop
    source = sql_source(folder, db)
    twin = read_classification(jsonl_twin(records, folder / "twin.jsonl"), label_set=LABELS)
    assert read_source_classification(source, label_set=LABELS) == twin
    assert [r.patient_id for r in source.records()] == [r["person_id"] for r in records]
    check = source.check()
    assert not check.problems, check.problems
    assert "query: 24 row(s)" in check.facts and any("mode=ro" in f for f in check.facts)


def test_sqlite_is_opened_read_only_so_a_write_is_refused_by_the_database(omop):
    folder, db, _ = omop
    with Database("sqlite", path=db).read_only() as run:  # past the guard: the connection itself refuses
        with pytest.raises(DatasetError, match="readonly|read-only") as caught:
            run("INSERT INTO person VALUES (1, 0, 1950, 0, 0)")
    assert caught.value.rule == REFUSED
    assert sqlite3.connect(db).execute("SELECT count(*) FROM person WHERE person_id = 1").fetchone() == (0,)


def test_a_query_that_writes_is_refused_when_the_configuration_loads(omop):
    folder, db, _ = omop
    with pytest.raises(ConfigError, match="UPDATE"):
        sql_source(folder, db, query="WITH x AS (UPDATE note SET note_text = '' RETURNING *) SELECT * FROM x")


def test_a_missing_column_names_what_the_query_gives_and_what_to_set(omop):
    folder, db, _ = omop
    source = sql_source(folder, db, query="SELECT note_text, person_id FROM note ORDER BY note_id")
    with pytest.raises(DatasetError, match=r"no column\(s\) \['text', 'label'\]; found columns \['note_text', "
                                           r"'person_id'\]") as caught:
        read_source_classification(source, label_set=LABELS)
    assert caught.value.public == "the query result lacks a column the site configuration names"
    assert any("no column(s) ['text', 'label']" in p for p in source.check().problems)


def test_an_empty_result_is_an_empty_dataset_and_check_config_says_so(omop):
    folder, db, _ = omop
    source = sql_source(folder, db, query="SELECT note_text AS text, 'cardio' AS label, person_id FROM note "
                                          "WHERE note_id < 0")
    with pytest.raises(DatasetError, match="the dataset is empty"):
        read_source_classification(source, label_set=LABELS)
    assert any("returns no rows" in p for p in source.check().problems)


def test_an_unreachable_database_says_where_and_what_to_check(tmp_path):
    source = sql_source(tmp_path, tmp_path / "nowhere.sqlite")
    with pytest.raises(DatasetError, match="no such database file") as caught:
        source.records()
    assert caught.value.rule == UNREACHABLE
    assert any("no such database file" in p for p in source.check().problems)


def test_passwords_never_live_in_the_configuration(tmp_path, monkeypatch):
    base = {"source": "sql", "engine": "postgresql", "query": "SELECT 1"}
    with pytest.raises(ConfigError, match="do not put the database password in agent.toml"):
        parse_source("n", {**base, "dsn": "host=db", "password": "s3cret"}, tmp_path, "x")
    with pytest.raises(ConfigError, match="the dsn holds a password") as caught:
        parse_source("n", {**base, "dsn": "host=db user=r password=s3cret"}, tmp_path, "x")
    assert "s3cret" not in str(caught.value)
    source = parse_source("n", {**base, "dsn": "host=db user=r", "password_env": "FEDCLINIC_TEST_PW"}, tmp_path, "x")
    monkeypatch.delenv("FEDCLINIC_TEST_PW", raising=False)
    with pytest.raises(DatasetError, match="FEDCLINIC_TEST_PW .* is not set"):
        source.db.password()
    monkeypatch.setenv("FEDCLINIC_TEST_PW", "s3cret")
    assert source.db.password() == "s3cret" and "s3cret" not in source.where
    (tmp_path / "pw").write_text("from-file\n")
    source = parse_source("n", {**base, "dsn": "host=db", "password_file": "pw"}, tmp_path, "x")
    assert source.db.password() == "from-file"


def test_omop_labels_come_from_mapped_conditions_inside_the_window(omop):
    folder, db, records = omop
    source = parse_source("notes", omop_settings(engine="sqlite", database=str(db)), folder, "x")
    assert isinstance(source, OmopSource)
    twin = read_classification(jsonl_twin(records, folder / "twin.jsonl"), label_set=LABELS)
    assert read_source_classification(source, label_set=LABELS) == twin  # the unmapped note is left out
    assert [r.patient_id for r in source.records()] == [r["person_id"] for r in records]
    # a window wide enough to reach the other label's condition (400 days later) makes every note two-labelled
    wide = parse_source("notes", {**omop_settings(engine="sqlite", database=str(db)), "window_days": 400}, folder, "x")
    assert all(sorted(e.labels) == LABELS
               for e in read_source_classification(wide, label_set=LABELS, multi_label=True))
    with pytest.raises(DatasetError, match="2 labels .* in a single-label task"):
        read_source_classification(wide, label_set=LABELS)
    # unmapped_label keeps the note without a mapped condition
    kept = parse_source("notes", {**omop_settings(engine="sqlite", database=str(db)), "unmapped_label": "other"},
                        folder, "x")
    rows = read_source_classification(kept, label_set=LABELS + ["other"])
    assert len(rows) == 25 and rows[-1].labels == ("other",)


def test_omop_eval_share_holds_out_whole_patients(omop):
    folder, db, records = omop
    source = parse_source("notes", {**omop_settings(engine="sqlite", database=str(db)), "eval_share": 0.3}, folder, "x")
    train, held = source.records("train"), source.records("eval")
    assert len(train) + len(held) == 24 and held and train
    assert not {r.patient_id for r in train} & {r.patient_id for r in held}
    assert [r.row for r in source.records("eval")] == [r.row for r in held]  # the same split on every read


def test_omop_check_reports_counts_and_a_table_that_is_not_omop(omop, tmp_path):
    folder, db, _ = omop
    check = parse_source("notes", omop_settings(engine="sqlite", database=str(db)), folder, "x").check()
    assert not check.problems, check.problems
    assert "25 note(s), 24 with a mapped condition within 30 day(s); per label: cardio 12, neuro 12" in check.facts
    assert any("1 note(s) have no mapped condition" in n for n in check.notes)
    bad = tmp_path / "not-omop.sqlite"
    con = sqlite3.connect(bad)
    con.executescript("CREATE TABLE note (note_id INTEGER, person_id INTEGER, note_date TEXT);"
                      "CREATE TABLE condition_occurrence (person_id INTEGER, condition_concept_id INTEGER, "
                      "condition_start_date TEXT);")
    con.close()
    check = parse_source("notes", omop_settings(engine="sqlite", database=str(bad)), tmp_path, "x").check()
    assert any("table note has no column(s) ['note_text']" in p for p in check.problems)


@pytest.mark.parametrize("entry, says", [
    ({"labels": {}}, "a \\[labels\\] table"),
    ({"labels": {"heart failure": "cardio"}}, "is not a code"),
    ({"window_days": -1}, "window_days"),
    ({"schema": "cdm; drop"}, "plain identifier"),
    ({"engine": "oracle"}, "engine must be one of"),
    ({"eval_share": 1.5}, "eval_share"),
])
def test_omop_settings_are_checked_with_what_to_write(entry, says, tmp_path):
    with pytest.raises(ConfigError, match=says):
        parse_source("n", {**omop_settings(engine="sqlite", database="x.sqlite"), **entry}, tmp_path, "x")


def test_an_empty_omop_database_is_an_empty_dataset_with_what_to_check(tmp_path):
    empty = write_sqlite_omop(tmp_path / "empty.sqlite", [])
    sqlite3.connect(empty).executescript("DELETE FROM condition_occurrence; DELETE FROM note;").close()
    source = parse_source("notes", omop_settings(engine="sqlite", database=str(empty)), tmp_path, "x")
    with pytest.raises(DatasetError, match="the dataset is empty .*check-config"):
        read_source_classification(source, label_set=LABELS)
    assert any("the note table returns no rows" in p for p in source.check().problems)
