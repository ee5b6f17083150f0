"""Fixtures for integration tests: real processes, real certificates, loopback only, tiny models."""

from __future__ import annotations

import pytest

from fedclinic.federation.local_federation import LocalFederation, SiteSetup

from tests.helpers.text_models import write_site_data

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _no_sqlite_state_on_postgresql(request, aggregator_store):
    """With ``FEDCLINIC_TEST_STORE=postgresql`` a test whose aggregator still wrote an SQLite state file under its
    ``tmp_path`` kept its state off the database under test (a configuration written by hand without
    ``fed.aggregator_state``, a federation built in another process): that test errors, naming the file."""
    if aggregator_store == "sqlite" or request.node.get_closest_marker("sqlite_state"):
        yield
        return
    tmp_path = request.getfixturevalue("tmp_path")
    yield
    stray = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("aggregator.sqlite"))
    assert not stray, (f"an aggregator kept its state in SQLite ({stray}) under FEDCLINIC_TEST_STORE=postgresql: give "
                       "its configuration the suite's [state] (LocalFederation.aggregator_state)")


@pytest.fixture
def federation_factory(tmp_path, request):
    """Build LocalFederations with N sites holding synthetic clinical-ish text; torn down after the test."""
    made: list[LocalFederation] = []

    def make(n_sites: int = 3, *, samples=(24, 32, 40), start: bool = True, **kwargs) -> LocalFederation:
        sites = []
        for i in range(n_sites):
            name = f"site-{chr(ord('a') + i)}"
            path = write_site_data(tmp_path / "data" / name, samples[i % len(samples)], seed=i)
            sites.append(SiteSetup(name, datasets={"notes": {"path": str(path), "format": "jsonl"}}))
        fed = LocalFederation(tmp_path / "fed", sites, agent_threads=1, **kwargs)
        made.append(fed)
        if start:
            fed.start()
        return fed

    yield make
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    for fed in made:
        fed.close()
        if failed:
            for log in sorted(fed.logs.glob("*.log")):
                print(f"----- {log.name} -----\n{log.read_text(errors='replace')[-4000:]}")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
