"""The federation the kills, disk-full and load parts run against: a real :class:`LocalFederation` (fedclinic's own
PKI, the aggregator and hospital agents as processes on 127.0.0.1) whose sites hold the tiny two-label text set of
the integration tests, and the means to restart one of its processes with failpoints armed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from fedclinic.federation.local_federation import LocalFederation, SiteSetup

from tests.helpers.federation import keep_aggregator_address
from tests.helpers.text_models import make_examples, write_site_data

#: rows per site, in turn (different sizes: a sample-weighted mean differs from the plain one)
SAMPLES = (24, 32, 40, 48)


def site_name(i: int) -> str:
    return f"site-{i:02d}" if i >= 26 else f"site-{chr(ord('a') + i)}"


def site_rows(i: int) -> list[dict]:
    """The rows site ``i`` trains on (what :func:`make_federation` wrote to its dataset)."""
    return make_examples(SAMPLES[i % len(SAMPLES)], seed=i)


def make_federation(root: Path, n_sites: int, *, dp_budget: float | None = None,
                    aggregator_settings: dict | None = None, log_level: str = "info") -> LocalFederation:
    """A federation of ``n_sites`` sites (not started) under ``root``; each site's dataset ``notes`` carries a
    privacy budget of ``dp_budget`` epsilon (delta 1e-4) when given."""
    sites = []
    for i in range(n_sites):
        path = write_site_data(root / "data" / site_name(i), SAMPLES[i % len(SAMPLES)], seed=i)
        entry: dict = {"path": str(path), "format": "jsonl"}
        if dp_budget is not None:
            entry.update(privacy_epsilon=dp_budget, privacy_delta=1e-4)
        sites.append(SiteSetup(site_name(i), datasets={"notes": entry}))
    return LocalFederation(root / "fed", sites, agent_threads=1, aggregator_settings=aggregator_settings,
                           log_level=log_level)


def start_pinned(fed: LocalFederation) -> None:
    """PKI, the aggregator (pinned to its first port so that restarts come back there), then every agent."""
    fed.make_pki()
    fed.start_aggregator()
    keep_aggregator_address(fed)
    for site in fed.sites:
        fed.start_agent(site)


def _with_env(env: dict[str, str], start):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def restart(fed: LocalFederation, victim: str, failpoints: str = "", env: dict[str, str] | None = None
            ) -> subprocess.Popen:
    """(Re)start ``victim`` ("aggregator" or a site name) with ``FEDCLINIC_FAILPOINTS=failpoints`` (and ``env``)
    in its environment; the aggregator comes back on its pinned port. Returns the new process."""
    extra = {"FEDCLINIC_FAILPOINTS": failpoints, **(env or {})}
    if victim == "aggregator":
        _with_env(extra, fed.start_aggregator)
        assert fed.aggregator is not None
        return fed.aggregator
    return _with_env(extra, lambda: fed.start_agent(victim))


def process_of(fed: LocalFederation, victim: str) -> subprocess.Popen:
    proc = fed.aggregator if victim == "aggregator" else fed.agents[victim]
    assert proc is not None
    return proc
