"""SQL and OMOP sources on a real PostgreSQL server (tests/helpers/postgres_server.py): a role that may only
read, the read-only transaction refusing a write the query guard cannot see, and what check-config says about
an unreachable server, a superuser and a role that may write."""

from __future__ import annotations

import pytest

from fedclinic.data.sources import parse_source
from fedclinic.data.sources.database import REFUSED, UNREACHABLE, SourceUnavailable
from fedclinic.data.text import read_classification, read_source_classification
from fedclinic.errors import DatasetError
from hospital_agent.outgoing import declined_for_good, outgoing_reason

from tests.helpers.clinical_sources import clinical_records, jsonl_twin, load_postgres_omop, omop_settings

LABELS = ["cardio", "neuro"]


@pytest.fixture(scope="module")
def cdw(postgres_server, postgres_database):
    records = clinical_records(24, 0)
    return load_postgres_omop(postgres_server, postgres_database, records), records


def test_omop_on_postgresql_gives_the_rows_of_the_jsonl_twin(cdw, tmp_path):
    db, records = cdw
    source = parse_source("notes", {**omop_settings(), **db}, tmp_path, "x")
    twin = read_classification(jsonl_twin(records, tmp_path / "twin.jsonl"), label_set=LABELS)
    assert read_source_classification(source, label_set=LABELS) == twin
    assert [r.patient_id for r in source.records()] == [r["person_id"] for r in records]
    check = source.check()
    assert not check.problems, check.problems
    assert "read-only: every query runs in a READ ONLY transaction" in check.facts
    assert any("holds no write privilege on any table" in f for f in check.facts)
    assert "25 note(s), 24 with a mapped condition within 30 day(s); per label: cardio 12, neuro 12" in check.facts
    assert "password" not in source.where and db["password_file"] not in source.where


def test_a_write_hidden_from_the_guard_is_refused_by_the_read_only_transaction(cdw, postgres_server, tmp_path):
    db, _ = cdw
    table = {k: v for k, v in db.items() if k != "schema"}
    source = parse_source("n", {"source": "sql", **table,
                                "query": "SELECT nextval('cdm.note_seq')::text AS text, 'cardio' AS label"},
                          tmp_path, "x")
    with pytest.raises(DatasetError, match="read-only transaction") as caught:
        source.records()
    assert caught.value.rule == REFUSED and declined_for_good(caught.value)
    dbname = db["dsn"].split("dbname=")[1].split()[0]
    assert postgres_server.admin_sql("SELECT last_value, is_called FROM cdm.note_seq", dbname) == [(1, False)]


def test_an_unreachable_server_and_a_wrong_password_say_what_to_check(cdw, tmp_path):
    db, _ = cdw
    (tmp_path / "wrong").write_text("not-the-password\n")
    for table, says in (({**db, "dsn": "host=127.0.0.1 port=1 dbname=cdw user=reader", "connect_timeout_s": 5},
                         "cannot connect .*refused"),
                        ({**db, "password_file": str(tmp_path / "wrong")}, "password authentication failed")):
        source = parse_source("n", {**omop_settings(), **table}, tmp_path, "x")
        with pytest.raises(DatasetError, match=says) as caught:
            source.records()
        assert caught.value.rule == UNREACHABLE and "not-the-password" not in str(caught.value)
        # the agent declines the round, not the task: the database may be back for the next one
        assert isinstance(caught.value, SourceUnavailable) and not declined_for_good(caught.value)
        assert outgoing_reason(caught.value, dataset="notes") == (
            "the dataset 'notes' does not meet the task's data contract: the data source's database cannot be "
            "reached; the site's IT has the details in the agent log")
        assert any("check host, port, dbname, user and the password" in p for p in source.check().problems)


def test_check_config_refuses_a_superuser_and_notes_a_role_that_may_write(cdw, postgres_server, tmp_path):
    db, _ = cdw
    dbname = db["dsn"].split("dbname=")[1].split()[0]
    admin = {**db, "dsn": f"host=127.0.0.1 port={postgres_server.port} dbname={dbname} user=postgres",
             "password_file": str(postgres_server.password_file())}
    check = parse_source("n", {**omop_settings(), **admin}, tmp_path, "x").check()
    assert any("is a superuser; connect as a role that may only SELECT" in p for p in check.problems)
    role = db["dsn"].rsplit("user=", 1)[1]
    postgres_server.admin_sql(f"GRANT INSERT ON cdm.note TO {role}", dbname)
    try:
        check = parse_source("n", {**omop_settings(), **db}, tmp_path, "x").check()
    finally:
        postgres_server.admin_sql(f"REVOKE INSERT ON cdm.note FROM {role}", dbname)
    assert not check.problems and any("may write 1 table privilege(s)" in n for n in check.notes)
