"""What a site says about data that breaks the task's data contract names the rule and the row, never the site's
file paths or what the rows hold: scanned in everything that reaches the aggregator (the scientist's view of the
task and its events, the aggregator's state folder - database, audit trail, spill files - its log and its
metrics), while the site's own log keeps the full detail."""

from __future__ import annotations

import json
import sqlite3
import urllib.request
from pathlib import Path

import pytest

from fedclinic.client import state_name
from fedclinic.federation.local_federation import LocalFederation, SiteSetup

from aggregator_service.store import PostgresStore
from tests.helpers.federation import aggregator_store
from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package

pytestmark = pytest.mark.integration

GOOD = {"text": "chest pain radiating to the left arm", "label": "cardio"}

# site -> (what its file holds, the rule and row the task owner must see, sentinels that must not leave the site,
#          what the site's own log must show besides the file's path)
CASES = {
    "site-a": ([GOOD, {"text": "SENTINEL-ROW-A patient Jane Roe MRN 4417", "label": ["cardio", "neuro"]}],
               "row 2: more than one label in a single-label task", ["SENTINEL-ROW-A", "Jane Roe", "4417"],
               ["row 2: 2 labels ['cardio', 'neuro']"]),
    "site-b": ([GOOD, GOOD, {"text": "SENTINEL-ROW-B seizure at home", "label": "SENTINEL-LABEL-B"}],
               "row 3: a label is not in the task's label set", ["SENTINEL-ROW-B", "SENTINEL-LABEL-B"],
               ["row 3: unknown label 'SENTINEL-LABEL-B'"]),
    "site-c": ([{"text": "   ", "label": "SENTINEL-LABEL-C"}], "row 1: the text is empty", ["SENTINEL-LABEL-C"],
               ["row 1: empty text"]),
    "site-d": (['{"text": "SENTINEL-ROW-D John Doe DOB 1961-02-03", "label": "neuro"'],
               "row 1: the row is not valid JSON", ["SENTINEL-ROW-D", "John Doe", "1961-02-03"],
               ["row 1: invalid JSON"]),
    "site-e": (None, "the dataset file is missing", [], ["file not found"]),
}


def _write(folder: Path, rows) -> Path:
    folder.mkdir(parents=True)
    path = folder / "SENTINEL-FILE-notes.jsonl"
    if rows is not None:
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _aggregator_state_text(state: Path, fed: LocalFederation) -> str:
    """Every byte the aggregator keeps (database and its WAL, audit trail, blobs, spill files) as text, and every
    text value of its database read through sqlite (read-only), or of its PostgreSQL database's tables."""
    parts = [p.read_bytes().decode("utf-8", "replace") for p in sorted(state.rglob("*")) if p.is_file()]
    with aggregator_store(fed) as store:
        if isinstance(store, PostgresStore):
            for t in store.all("SELECT tablename FROM pg_tables WHERE schemaname='public'"):
                for row in store.all(f'SELECT * FROM "{t.tablename}"'):
                    parts.extend(str(v) if not isinstance(v, bytes) else v.decode("utf-8", "replace")
                                 for v in row._r)
    for db in sorted(state.rglob("*.db")) + sorted(state.rglob("*.sqlite*")):
        if db.suffix not in (".db", ".sqlite", ".sqlite3"):
            continue
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")]
            for t in tables:
                for row in con.execute(f'SELECT * FROM "{t}"'):
                    parts.extend(str(v) if not isinstance(v, bytes) else v.decode("utf-8", "replace") for v in row)
        finally:
            con.close()
    return "\n".join(parts)


def test_declined_data_contract_names_rule_and_row_but_no_site_data(tmp_path):
    data = tmp_path / "SENTINEL-SITE-DIR"
    sites, paths = [], {}
    for site, (rows, *_) in CASES.items():
        paths[site] = _write(data / site, rows)
        sites.append(SiteSetup(site, datasets={"notes": {"path": str(paths[site]), "format": "jsonl"}}))
    with LocalFederation(tmp_path / "fed", sites, agent_threads=1, metrics_address="127.0.0.1:0") as fed:
        fed.start()
        with fed.client() as client:
            # the task names its sites: once every one declined it for good (a data contract is not met) it fails
            # at once instead of at its round deadline
            st = client.submit(make_task(min_sites=1, num_rounds=1, round_timeout_s=300, sites=list(CASES)),
                               package=tiny_package("logreg"))
            final = client.wait(st.task_id, timeout=180, progress=False)
            watched = list(client.watch(st.task_id))
            events = [str(e) for e in watched] + [e.message for e in watched]
            listed = [str(t) for t in client.list(include_finished=True)]
            status = str(client.status(st.task_id))
        metrics = urllib.request.urlopen(fed.metrics_url(), timeout=10).read().decode()
        state_text = _aggregator_state_text(Path(fed.root / "aggregator-state"), fed)
        aggregator_log = fed.log_text("aggregator")
        agent_logs = {site: fed.log_text(f"agent-{site}") for site in CASES}

    assert state_name(final.state) == "failed", final.error
    declined = list(final.rounds[0].declined)
    seen = "\n".join([*declined, final.error, status, *events, *listed, metrics, state_text, aggregator_log])

    # no site path, no row content, no label set read from the data reaches the aggregator
    forbidden = ["SENTINEL", str(data), "['cardio', 'neuro']"]
    for site, (_, _, sentinels, _) in CASES.items():
        forbidden += [str(paths[site]), *sentinels]
    leaked = [s for s in forbidden if s in seen]
    assert not leaked, f"site data reached the aggregator: {leaked}\n{declined}"

    # the rule and the row do reach the task owner, one refusal per site
    assert len(declined) == len(CASES), declined
    for site, (_, rule, _, _) in CASES.items():
        mine = [d for d in declined if d.startswith(f"{site}: ")]
        assert len(mine) == 1 and rule in mine[0] and "'notes'" in mine[0] and "data contract" in mine[0], declined
        assert rule in "\n".join(events), (site, events)

    # the site's own log keeps the detail: its path and what the row held
    for site, (*_, local) in CASES.items():
        for detail in [str(paths[site]), *local]:
            assert detail in agent_logs[site], (site, detail)
