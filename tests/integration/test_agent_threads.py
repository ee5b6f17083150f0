"""A real agent process runs torch with the threads its config asks for; LocalFederation splits the host."""

from __future__ import annotations

import json

import pytest

from fedclinic.federation.local_federation import LocalFederation, SiteSetup, wait_until
from fedclinic.runtime.cpu_cores import cores_per_process

pytestmark = pytest.mark.integration


def _thread_lines(fed: LocalFederation, site: str, event: str = "torch threads") -> list[dict]:
    out = []
    for line in fed.log_text(f"agent-{site}").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == event:
            out.append(entry)
    return out


def test_agents_run_with_their_configured_torch_threads_and_preload(tmp_path):
    data = {"notes": {"path": str(tmp_path / "notes.jsonl"), "format": "jsonl"}}
    sites = [SiteSetup("site-a", datasets=data),
             SiteSetup("site-b", datasets=data, extra={"torch_threads": 3, "preload_training_stack": True})]
    with LocalFederation(tmp_path / "fed", sites) as fed:  # default: each agent gets max(1, cores // 2)
        fed.start()
        wait_until(lambda: all(_thread_lines(fed, s) for s in ("site-a", "site-b")), 60,
                   "both agents to log their torch threads")
        split = cores_per_process(2)
        (a,), (b,) = _thread_lines(fed, "site-a"), _thread_lines(fed, "site-b")
        assert (a["threads"], a["interop_threads"]) == (split, split), a
        assert (b["threads"], b["interop_threads"]) == (3, 3), b
        # site-b imports its training stack at start-up (off the first round's path); site-a, as configured, not
        wait_until(lambda: _thread_lines(fed, "site-b", "training stack preloaded"), 60, "site-b's preload")
        assert not _thread_lines(fed, "site-a", "training stack preloaded")
        assert not _thread_lines(fed, "site-b", "training stack not preloaded")
