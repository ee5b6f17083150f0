"""A SIGTERM to the process that owns a LocalFederation stops the services it started (real processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from fedclinic.federation.local_federation import LocalFederation, wait_until

pytestmark = pytest.mark.integration

OWNER = textwrap.dedent("""
    import json, signal, sys
    from fedclinic.federation.local_federation import LocalFederation
    with LocalFederation(sys.argv[1], [], log_level="warning", aggregator_settings=json.loads(sys.argv[2])) as fed:
        fed.make_pki()
        fed.start_aggregator()
        print(fed.aggregator.pid, flush=True)
        signal.pause()  # until a signal arrives: the test sends SIGTERM
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for this purpose (its parent has not reaped it yet)
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_to_the_owner_stops_the_aggregator_it_started(tmp_path):
    # the owner is another process: it gets the suite's store (SQLite or PostgreSQL) from here
    settings = LocalFederation(tmp_path / "fed", []).aggregator_state(tmp_path / "fed" / "aggregator-state")
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path / "fed"), json.dumps(settings)],
                             stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    aggregator = 0
    try:
        line = owner.stdout.readline()
        assert line.strip().isdigit(), f"the owner printed {line!r}; see {tmp_path / 'fed' / 'logs'}"
        aggregator = int(line)
        assert _alive(aggregator)
        owner.send_signal(signal.SIGTERM)
        assert owner.wait(60) == 128 + signal.SIGTERM
        wait_until(lambda: not _alive(aggregator), 30, "the aggregator to stop after its owner got SIGTERM")
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(10)
        if aggregator and _alive(aggregator):  # only when the test failed: do not leave it running
            os.kill(aggregator, signal.SIGKILL)
