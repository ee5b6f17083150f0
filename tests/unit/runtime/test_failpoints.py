"""Failpoints in a real child process: the abrupt exit, and the stop that lets a test send a real SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from fedclinic.federation.local_federation import wait_until

CHILD = """
from fedclinic.runtime.failpoints import failpoint
for i in range(5):
    print(i, flush=True)
    failpoint("test.point")
print("done", flush=True)
"""


def _child(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD], env={**os.environ, **env}, stdout=subprocess.PIPE,
                            text=True)


def test_an_unarmed_point_does_nothing_and_an_armed_one_exits_97_at_its_count():
    assert subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if not k.startswith("FEDCLINIC_FAILPOINT")},
                          timeout=60).stdout.split() == ["0", "1", "2", "3", "4", "done"]
    proc = _child({"FEDCLINIC_FAILPOINTS": "other.point,test.point:3"})
    out, _ = proc.communicate(timeout=60)
    assert (proc.returncode, out.split()) == (97, ["0", "1", "2"])


def test_a_paused_point_publishes_the_marker_and_holds_until_sigkill(tmp_path):
    marker = tmp_path / "paused"
    proc = _child({"FEDCLINIC_FAILPOINTS": "test.point:2", "FEDCLINIC_FAILPOINT_PAUSE": str(marker)})
    try:
        wait_until(marker.exists, 60, "the failpoint's marker", check=lambda: proc.poll() is None or pytest.fail("the child exited"))
        assert marker.read_text().split() == ["test.point", str(proc.pid)]
        assert proc.poll() is None  # held at the point, not exited
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert (proc.returncode, out.split()) == (-signal.SIGKILL, ["0", "1"])
    assert [p.name for p in tmp_path.iterdir()] == ["paused"]  # no temporary file left beside it
