"""Running one task on a real LocalFederation, and reading back what its aggregator stored."""

from __future__ import annotations

import json
import queue
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import grpc

from fedclinic.federation.local_federation import LocalFederation
from fedclinic.proto import agent_pb2

from aggregator_service.config import AggregatorConfig
from aggregator_service.store import open_store
from aggregator_service.store.sql_store import SqlStore


def run_task(root: Path, sites, task, package):
    """Start a federation of ``sites`` under ``root``, submit ``task`` with ``package``, wait for it to
    complete (asserting it did) and return ``(final status, round-1 global package)``."""
    from fedclinic.client import state_name

    with LocalFederation(root, sites, agent_threads=1) as fed:
        fed.start()
        with fed.client() as client:
            status = client.submit(task, package=package)
            final = client.wait(status.task_id, timeout=300, progress=False)
            assert state_name(final.state) == "completed", final.error
            return final, client.fetch_package(status.task_id, round=1)


@contextmanager
def aggregator_store(fed: LocalFederation) -> Iterator[SqlStore]:
    """The state of ``fed``'s aggregator as a store of its own, opened from the aggregator's configuration (its
    SQLite file or its PostgreSQL database, whichever the suite runs on), closed on exit. The aggregator may be
    running: read with the store's methods or ``one`` / ``all`` (``?`` placeholders, either database)."""
    config = AggregatorConfig.load(fed.root / "aggregator.toml")
    store = open_store(config.state, config.state_dir)
    try:
        yield store  # type: ignore[misc]
    finally:
        store.close()


def stored_update_tensors(fed: LocalFederation, task_id: str) -> dict[tuple[str, int], set[str]]:
    """(site, round) -> the tensor names of the update the aggregator stored (read from its state database)."""
    with aggregator_store(fed) as store:
        return {(r.site, r.round): {t[0] for t in json.loads(r.layout)} for r in store.all(
            "SELECT site, round, layout FROM updates WHERE task_id=?", (task_id,))}


def watch_assignments(stub) -> tuple[queue.Queue, object]:
    """Open a site's work stream on ``stub`` (an AgentService stub with a site's certificate); its assignments
    arrive on the returned queue. Cancel the returned call to end the stream."""
    work: queue.Queue = queue.Queue()
    watch = stub.WatchWork(agent_pb2.WatchWorkRequest(protocol_version=1))

    def collect() -> None:
        try:
            for item in watch:
                if item.WhichOneof("item") == "assignment":
                    work.put(item.assignment)
        except grpc.RpcError:  # cancelled at the end of the test
            pass

    threading.Thread(target=collect, daemon=True).start()
    return work, watch


def keep_aggregator_address(fed: LocalFederation) -> None:
    """Pin a started aggregator's listen address to the port it got, so that after a restart (a SIGKILL, a
    restore) it comes back where the agents reconnect."""
    port = fed.address.rsplit(":", 1)[1]
    fed.aggregator_settings["listen"] = f"127.0.0.1:{port}"


def streams_open(fed: LocalFederation) -> set[str]:
    """The sites whose work stream the aggregator has logged as opened (read from its JSON log)."""
    sites = set()
    for line in fed.log_text("aggregator").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "work stream opened":
            sites.add(entry.get("site"))
    return sites
