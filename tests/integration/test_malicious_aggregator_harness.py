"""The malicious-aggregator harness itself (tests/helpers/malicious_aggregator.py): honest by default (a task
completes through it with real agent processes), and its hooks really reach the agents."""

from __future__ import annotations

import threading

import pytest

from fedclinic.client import state_name
from fedclinic.federation.local_federation import wait_until

from tests.helpers.malicious_aggregator import MaliciousAggregator, Tamper
from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package

pytestmark = pytest.mark.integration


class _Assignments(Tamper):
    """Counts the assignments each site receives; drops them when ``drop`` is set."""

    def __init__(self, drop: bool) -> None:
        self.drop = drop
        self.seen: set[str] = set()
        self.lock = threading.Lock()

    def work_item(self, caller, item):
        if item.WhichOneof("item") == "assignment":
            with self.lock:
                self.seen.add(caller)
            return [] if self.drop else [item]
        return [item]


def test_an_honest_harness_runs_a_task_and_a_dropping_one_starves_it(federation_factory):
    fed = federation_factory(2, start=False)
    fed.make_pki()
    honest = _Assignments(drop=False)
    with MaliciousAggregator(fed, honest):
        for site in fed.sites:
            fed.start_agent(site)
        with fed.client() as client:
            st = client.submit(make_task(num_rounds=1, min_sites=2), package=tiny_package("logreg"))
            final = client.wait(st.task_id, timeout=180, progress=False)
        assert state_name(final.state) == "completed", final.error
        assert honest.seen == {"agent site-a", "agent site-b"}
    for site in list(fed.agents):
        fed.signal_agent(site)

    dropping = _Assignments(drop=True)
    with MaliciousAggregator(fed, dropping):
        for site in fed.sites:
            fed.start_agent(site)
        with fed.client() as client:
            st = client.submit(make_task(num_rounds=1, min_sites=2, round_timeout_s=600), package=tiny_package("logreg"))
            wait_until(lambda: dropping.seen == {"agent site-a", "agent site-b"}, 60, "both assignments dropped")
            status = client.status(st.task_id)
        assert state_name(status.state) == "running" and not status.rounds[0].reports
