"""The fork server that LocalFederation starts its agents from (sdk/fedclinic/federation/fork_server.py), over real
processes: what a forked child sees, how it ends, and that no child outlives its server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from fedclinic.federation.fork_server import ForkServer, ForkServerError
from fedclinic.federation.local_federation import wait_until

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ENTRY = "tests.helpers.fork_entries"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def server(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FORK_TEST_MARK": "from the owner"}
    s = ForkServer(["numpy", "torch"], env=env, log=tmp_path / "fork-server.log", cwd=tmp_path)
    s.wait_ready(120)
    yield s
    s.close()


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_a_child_starts_as_a_fresh_process_would_and_reports_its_status(server, tmp_path):
    children = [server.spawn(f"{ENTRY}:report", [str(code), "--flag"], log=tmp_path / f"c{code}.log", cwd=tmp_path)
                for code in (0, 3)]
    assert [c.wait(60) for c in children] == [0, 3]
    facts = [json.loads(_lines(tmp_path / f"c{code}.log")[0]) for code in (0, 3)]
    for child, fact in zip(children, facts):
        assert fact["pid"] == child.pid != server.pid
        assert fact["sid"] == child.pid                     # a session of its own (start_new_session)
        assert fact["argv"] == [str(child.returncode), "--flag"]
        assert fact["cwd"] == str(tmp_path) and fact["stdin"] == "/dev/null"
        assert fact["env"] == "from the owner" and fact["sigterm_default"]
    # stdout and stderr both reach the log
    assert "to stderr" in (tmp_path / "c0.log").read_text()
    # the generators the server had seeded are seeded afresh in each child
    assert facts[0]["numpy"] != facts[1]["numpy"] and facts[0]["torch"] != facts[1]["torch"]


def test_signals_reach_the_child_and_its_status_says_which(server, tmp_path):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        log = tmp_path / f"wait-{sig}.log"
        child = server.spawn(f"{ENTRY}:wait_for_signal", [], log=log, cwd=tmp_path)
        wait_until(lambda: "ready" in _lines(log), 60, "the child to start")
        assert child.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(0.2)
        child.send_signal(sig)
        assert child.wait(30) == -sig
        child.send_signal(signal.SIGTERM)  # after the end: nothing happens, as with Popen
        assert child.poll() == -sig


def test_an_entry_point_that_raises_ends_with_status_1_and_its_traceback_in_the_log(server, tmp_path):
    child = server.spawn(f"{ENTRY}:fail", [], log=tmp_path / "fail.log", cwd=tmp_path)
    assert child.wait(60) == 1
    assert "RuntimeError: an entry point that fails" in (tmp_path / "fail.log").read_text()
    missing = server.spawn("tests.helpers.no_such_module:main", [], log=tmp_path / "missing.log", cwd=tmp_path)
    assert missing.wait(60) == 1
    assert "ModuleNotFoundError" in (tmp_path / "missing.log").read_text()
    # the server goes on serving
    assert server.spawn(f"{ENTRY}:report", ["0"], log=tmp_path / "after.log", cwd=tmp_path).wait(60) == 0


def test_a_malformed_request_is_refused_and_the_server_goes_on(server, tmp_path):
    server._proc.stdin.write(b'{"entry": 1}\nnot json\n')
    server._proc.stdin.flush()
    assert "not a request" in server._reply(30, "the refusal")["error"]
    assert "not a request" in server._reply(30, "the refusal")["error"]
    assert server.spawn(f"{ENTRY}:report", ["0"], log=tmp_path / "after.log", cwd=tmp_path).wait(60) == 0


def _server_with_a_running_child(tmp_path):
    """A server with no imports and one child that writes ``stopped`` when SIGTERM ends it: (server, child,
    the marker file)."""
    server = ForkServer([], env={**os.environ, "PYTHONPATH": str(ROOT)}, log=tmp_path / "fork-server.log",
                        cwd=tmp_path)
    log, marker = tmp_path / "child.log", tmp_path / "stopped"
    child = server.spawn(f"{ENTRY}:stop_cleanly_on_sigterm", [str(marker)], log=log, cwd=tmp_path)
    wait_until(lambda: "ready" in _lines(log), 60, "the child to start")
    return server, child, marker


def test_closing_the_server_stops_its_children_gracefully(tmp_path):
    server, child, marker = _server_with_a_running_child(tmp_path)
    server.close()
    assert marker.read_text() == "stopped cleanly"  # it got SIGTERM, and the server waited for it
    assert not _alive(child.pid)
    with pytest.raises(ForkServerError, match="ended"):
        server.spawn(f"{ENTRY}:report", ["0"], log=tmp_path / "late.log", cwd=tmp_path)


def test_no_child_outlives_a_server_that_is_killed(tmp_path):
    server, child, marker = _server_with_a_running_child(tmp_path)
    os.kill(server.pid, signal.SIGKILL)
    # the kernel sends the child SIGTERM when its parent dies (PR_SET_PDEATHSIG); it stops as it would on SIGTERM
    wait_until(lambda: not _alive(child.pid), 30, "the orphaned child to stop")
    assert marker.read_text() == "stopped cleanly"
    # nobody can report its status any more: the owner says so instead of waiting forever
    assert child.wait(10) == 255
    server.close()


def test_a_server_that_cannot_start_is_reported_with_its_log(tmp_path):
    server = ForkServer([], env={**os.environ, "PYTHONPATH": "/nonexistent", "PYTHONHOME": "/nonexistent"},
                        log=tmp_path / "fork-server.log", cwd=tmp_path)
    with pytest.raises(ForkServerError, match="fork-server.log"):
        server.wait_ready(60)
    server.close()


def _gated_server(tmp_path) -> tuple[ForkServer, Path]:
    """A server held in its imports until a word is written into the returned FIFO (tests/helpers/fork_gate.py)."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FORK_GATE": str(gate)}
    return ForkServer(["tests.helpers.fork_gate"], env=env, log=tmp_path / "fork-server.log", cwd=tmp_path), gate


def _open_gate(gate: Path, word: str) -> None:
    """Write ``word`` into the gate (the open waits until the server's import holds the FIFO's other end)."""
    with open(gate, "w") as fh:
        fh.write(word)


def test_children_asked_for_while_the_server_imports_are_forked_once_it_is_ready(tmp_path):
    server, gate = _gated_server(tmp_path)
    try:
        # spawn returns while the server is still importing: the requests wait on its pipe
        children = [server.spawn(f"{ENTRY}:report", [str(code)], log=tmp_path / f"q{code}.log", cwd=tmp_path)
                    for code in (0, 4)]
        assert [c.poll() for c in children] == [None, None]
        assert (tmp_path / "q0.log").read_text() == ""  # its log exists at once (as a Popen'd process's), still empty
        _open_gate(gate, "go")
        assert [c.wait(60) for c in children] == [0, 4]
        # each handle learnt its own child's pid (answers come in request order)
        assert [json.loads(_lines(tmp_path / f"q{code}.log")[0])["pid"] for code in (0, 4)] == [c.pid for c in children]
    finally:
        server.close()


def test_a_child_asked_of_a_server_that_ends_before_it_is_ready_fails_with_the_reason_in_its_log(tmp_path):
    server, gate = _gated_server(tmp_path)
    try:
        child = server.spawn(f"{ENTRY}:report", ["0"], log=tmp_path / "never.log", cwd=tmp_path)
        _open_gate(gate, "exit")  # the server ends in its imports
        assert child.wait(60) == 255
        assert "fork server ended" in (tmp_path / "never.log").read_text()
        with pytest.raises(ForkServerError, match="fork-server.log"):
            child.pid
        child.terminate()  # nothing to signal, as with an ended Popen
        with pytest.raises(ForkServerError, match="ended"):
            server.spawn(f"{ENTRY}:report", ["0"], log=tmp_path / "late.log", cwd=tmp_path)
    finally:
        server.close()
