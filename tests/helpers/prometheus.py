"""Scraping the Prometheus endpoints of the aggregator and the agents over loopback HTTP, and reading samples."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only, whatever the env says


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """Every sample of one scrape: (name, frozenset of label items) -> value."""
    with _NO_PROXY.open(url, timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    """The sample ``name`` with exactly ``labels`` in one scrape, 0.0 when absent."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def scrape_agent(fed, site: str) -> dict:
    """The agent's scrape, or {} while it has not published its endpoint yet."""
    try:
        url = fed.metrics_url(site)
    except FileNotFoundError:
        return {}
    return scrape(url)
