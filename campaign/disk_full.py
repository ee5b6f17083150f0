"""Disk full at the aggregator and at an agent: a clear error, nothing corrupted, recovery once space is back.

    python -m campaign.disk_full [--smoke] [--out FILE] [--injected]

For each side (the aggregator's state folder, then one agent's work folder) a federation of two sites runs a
multi-round task; after its first round the side's disk is filled (campaign.full_disk: a real tmpfs filled to the
last byte where the campaign may mount one, else the injected ENOSPC of fedclinic.runtime.failpoints). While it is
full: the processes must stay up; at the aggregator a scientist's submit must be answered RESOURCE_EXHAUSTED with
a message that says the disk is full (and no server path), and the agents must report the refusal of their
upload; at the agent its log must say the disk is full. Then space comes back and the task must complete. At
the end the stores are checked: every blob's content matches its hash, SQLite's integrity check passes, no update
is stored twice and every acknowledged update is stored (campaign.ledger_checks).
"""

from __future__ import annotations

import argparse
import hashlib
import sqlite3
import tempfile
import time
from contextlib import closing
from pathlib import Path

import grpc

from fedclinic.errors import FedclinicError
from fedclinic.federation.local_federation import wait_until
from fedclinic.proto import control_pb2

from campaign.fragment import Fragment
from campaign.full_disk import FullDisk, can_mount
from campaign.ledger_checks import update_problems
from campaign.state_reader import StateReader
from campaign.task_watch import TERMINAL, poll_status, submit
from campaign.testbed import make_federation, restart, site_name

from tests.helpers.federation import keep_aggregator_address
from tests.helpers.tasks import make_task

DISK_WORDS = ("disk is full", "no space left")
#: what this part found when it first ran, and the fixes (each covered by a test that fails without it)
FIXED = [
    "fixed: an agent on a full disk declined the round for good blaming the task (\"the task's spec or model "
    "cannot be handled here\": SQLite's 'database or disk is full' is no OSError), and a round declined for now was "
    "never offered again at its next attempt, so the task could not finish once space was back; now the agent "
    "declines for now naming its disk and the retried round is offered again (tests/integration/"
    "test_agent_disk_full.py)",
    "fixed (with h16-limits): an upload refused RESOURCE_EXHAUSTED 'disk is full' was dropped by the agent, whose "
    "round then never completed; it now stays in the outbox and is retried with backoff",
]


def blob_problems(folder: Path) -> tuple[list[str], int]:
    """Blobs (``ab/cdef...`` files under ``folder``) whose content does not hash to their name; and how many."""
    problems, n = [], 0
    if not folder.exists():
        return problems, n
    for path in folder.glob("??/*"):
        if len(path.parent.name) != 2 or len(path.name) != 62:
            continue
        n += 1
        if hashlib.sha256(path.read_bytes()).hexdigest() != path.parent.name + path.name:
            problems.append(f"blob {path.parent.name}{path.name[:10]}... does not match its hash")
    return problems, n


def sqlite_problems(path: Path) -> list[str]:
    if not path.exists():
        return []
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)) as db:
        result = db.execute("PRAGMA integrity_check").fetchone()[0]
    return [] if result == "ok" else [f"{path.name}: integrity check says {result}"]


def _says_disk_full(text: str) -> bool:
    return any(w in text.lower() for w in DISK_WORDS)


def run_side(side: str, root: Path, *, real: bool, frag: Fragment, rounds: int) -> list[str]:
    """One side's scenario (module docstring); returns its problems and adds its rows to ``frag``."""
    problems: list[str] = []
    victim = "aggregator" if side == "aggregator" else site_name(1)
    state_dir = root / "aggregator-state"
    fed = make_federation(root, 2, aggregator_settings={"state_dir": str(state_dir)})
    folder = state_dir if side == "aggregator" else fed.root / f"agent-{victim}"
    disk = FullDisk(folder, real=real)
    try:
        with fed:
            fed.make_pki()
            restart(fed, "aggregator", env=disk.env() if side == "aggregator" else None)
            keep_aggregator_address(fed)
            for site in fed.sites:
                restart(fed, site, env=disk.env() if site == victim else None)

            def task(name: str, **kw):
                return make_task(name=f"disk-full-{side}-{name}", num_rounds=rounds, min_sites=2,
                                 round_timeout_s=20, on_quorum_miss="retry", max_round_retries=20, local_epochs=1,
                                 **kw)

            def ended(task_id: str, timeout: float, what: str):
                wait_until(lambda: (st := poll_status(fed, task_id)) is not None and st.state in TERMINAL, timeout,
                           what)
                return poll_status(fed, task_id)

            ended(submit(fed, task("before")), 120, "a task before the disk fills")  # models and updates stored
            log_name = "aggregator" if side == "aggregator" else f"agent-{victim}"
            if side == "aggregator":
                other = site_name(1)
                fed.signal_agent(other)                    # round 1 of the next task waits for it
                task_id = submit(fed, task("during"))
                disk.fill()
                found, answer = _refused_submit(fed)        # the scientist's write: a clear refusal
                problems += found
                frag.rows.append(("aggregator: a submit while full is answered", answer[:240]))
                restart(fed, other)                         # its upload meets the full disk
                wait_until(lambda: _says_disk_full(fed.log_text(f"agent-{other}")), 90,
                           "the agent to report that the aggregator's disk is full")
            else:
                disk.fill()
                # another learning rate: from round 2 on, models the agent does not hold yet (blobs to write)
                task_id = submit(fed, task("during", learning_rate=0.07))
                wait_until(lambda: _says_disk_full(fed.log_text(log_name)), 90,
                           "the agent to log that its disk is full")
            frag.rows.append((f"{side}: free bytes once filled", str(disk.free_bytes()) if real else "n/a (injected)"))
            for name, proc in [("aggregator", fed.aggregator), *fed.agents.items()]:
                if proc.poll() is not None:
                    problems.append(f"{name} exited (status {proc.returncode}) while the {side}'s disk was full")
            disk.free()
            t0 = time.monotonic()
            final = ended(task_id, 240, "the task to end once space was back")
            frag.rows.append((f"{side}: task after space came back",
                              f"{'completed' if final.state == control_pb2.TASK_STATE_COMPLETED else final.error[:200]} "
                              f"({time.monotonic() - t0:.0f} s)"))
            if final.final_model_hash == "":
                problems.append(f"{side}: the task did not complete once space was back: {final.error}")
        agent_dirs = {s: fed.root / f"agent-{s}" for s in fed.sites}
        found, acks = update_problems(StateReader.of_config(fed.root / "aggregator.toml"), agent_dirs)
        problems += found
        n_blobs = 0
        for d in [state_dir / "blobs", *(a / "cache" for a in agent_dirs.values())]:
            found, n = blob_problems(d)
            problems += found
            n_blobs += n
        problems += sqlite_problems(state_dir / "aggregator.sqlite")
        for a in agent_dirs.values():
            problems += sqlite_problems(a / "privacy-ledger.sqlite")
    finally:
        disk.close()  # after the checks: the tmpfs holds what they read
    frag.rows.append((f"{side}: blobs verified / acknowledged updates checked", f"{n_blobs} / {acks}"))
    return [f"{side}: {p}" for p in problems]


def _refused_submit(fed) -> tuple[list[str], str]:
    """A scientist's submit while the aggregator's disk is full: RESOURCE_EXHAUSTED, 'disk is full', no path.
    Returns the problems and the answer."""
    from tests.helpers.text_models import tiny_package

    try:
        with fed.client() as client:
            client.submit(make_task(name="while-full"), package=tiny_package("logreg"))
    except (grpc.RpcError, FedclinicError) as exc:
        text = str(exc)
        bad = []
        if not _says_disk_full(text):
            bad.append(f"a submit on a full disk was refused without saying so: {text[:300]}")
        if str(fed.root) in text or "/tmp/" in text:
            bad.append(f"a submit on a full disk was answered with a server path: {text[:300]}")
        return bad, text
    return ["a submit on a full disk was accepted"], "accepted"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m campaign.disk_full", description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--injected", action="store_true", help="the injected full disk even where a tmpfs can be mounted")
    ap.add_argument("--sides", default="aggregator,agent")
    ap.add_argument("--keep", type=Path, help="run under this folder and keep it (logs, stores)")
    args = ap.parse_args(argv)
    frag = Fragment("disk_full", "Disk full (aggregator and agent)", args.smoke)
    real = not args.injected and can_mount()
    frag.rows.append(("full disk", "a real tmpfs filled to the last byte" if real else
                      "injected ENOSPC on durable writes (FEDCLINIC_DISK_FULL; no permission to mount a tmpfs)"))
    problems: list[str] = []
    with tempfile.TemporaryDirectory(prefix="campaign-disk-full-") as tmp:
        tmp = args.keep or tmp
        for side in args.sides.split(","):
            try:
                problems += run_side(side, Path(tmp) / side, real=real, frag=frag, rounds=2 if args.smoke else 4)
            except (TimeoutError, FedclinicError) as exc:
                problems.append(f"{side}: {exc}")
    frag.findings += FIXED + problems
    frag.ok = not problems
    frag.figures.update(sides=2, problems=len(problems), real_disk=int(real))
    frag.summary = ("clear error, nothing corrupted, recovery once space is back, at the aggregator and at an agent"
                    if not problems else f"{len(problems)} problem(s): " + "; ".join(problems)[:300])
    return frag.finish(args.out)


if __name__ == "__main__":
    import sys

    sys.exit(main())
