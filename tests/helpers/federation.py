"""Running one task on a real LocalFederation, and reading back what its aggregator stored."""

from __future__ import annotations

import json
import queue
import threading
from pathlib import Path

import grpc

from fedclinic.federation.local_federation import LocalFederation
from fedclinic.proto import agent_pb2


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


def stored_update_tensors(fed: LocalFederation, task_id: str) -> dict[tuple[str, int], set[str]]:
    """(site, round) -> the tensor names of the update the aggregator stored (its state database, read-only)."""
    import sqlite3

    db = sqlite3.connect(f"file:{fed.root / 'aggregator-state' / 'aggregator.sqlite'}?mode=ro", uri=True)
    try:
        return {(site, rnd): {t[0] for t in json.loads(layout)} for site, rnd, layout in db.execute(
            "SELECT site, round, layout FROM updates WHERE task_id=?", (task_id,))}
    finally:
        db.close()


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
