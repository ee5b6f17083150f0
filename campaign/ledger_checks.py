"""What the kill and disk-full parts check after every fault, read from the processes' own files (read-only):

* the aggregator's store (SQLite or PostgreSQL, :class:`~campaign.state_reader.StateReader`): every
  (task, round, site) holds at most one update (none counted twice);
* the agents' audit trails: every update an agent was told was acknowledged (``update.sent``) is the one the store
  holds for its (task, round, site), under the same update id (none lost);
* the agents' privacy ledgers: what every dataset has spent and committed stays within its budget;
* the final model of a task equals the replay of the updates its rounds counted (:func:`replay_problems`).

Each check returns a list of problems (one sentence each); empty means it holds.
"""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from pathlib import Path

from campaign.state_reader import StateReader

#: the ledger's own tolerance for float sums (hospital_agent.privacy_ledger)
SLACK = 1e-9


def _ro(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)


def stored_updates(state: StateReader) -> dict[tuple[str, int, str], list[str]]:
    """(task, round, site) -> the update ids the aggregator's store holds for it."""
    out: dict[tuple[str, int, str], list[str]] = {}
    for uid, task, rnd, site in state.rows("SELECT update_id, task_id, round, site FROM updates"):
        out.setdefault((task, rnd, site), []).append(uid)
    return out


def acknowledged(agent_dir: Path) -> list[dict]:
    """The ``update.sent`` records of an agent's audit trail: what it was told the aggregator acknowledged (a
    torn last line, from a kill mid-append, is skipped: the agent quarantines it at its next start)."""
    path = agent_dir / "audit.jsonl"
    out = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("kind") == "update.sent":
            out.append(rec)
    return out


def _field(rec: dict, key: str):
    return rec.get(key, rec.get("details", {}).get(key))


def update_problems(state: StateReader, agent_dirs: dict[str, Path]) -> tuple[list[str], int]:
    """Double-counted and lost updates (module docstring); also returns how many acknowledgements were checked."""
    stored = stored_updates(state)
    problems = [f"{site} has {len(ids)} updates stored for round {rnd} of {task}: {ids}"
                for (task, rnd, site), ids in stored.items() if len(ids) > 1]
    checked = 0
    for site, d in agent_dirs.items():
        for rec in acknowledged(d):
            if _field(rec, "masked"):
                continue  # a masked input is not an update of the store: the secure round's replay checks it
            checked += 1
            task, rnd, uid = _field(rec, "task_id"), _field(rec, "round"), _field(rec, "update_id")
            ids = stored.get((task, rnd, site), [])
            if uid not in ids:
                problems.append(f"{site}'s acknowledged update {uid} of round {rnd} of {task} is not in the store "
                                f"(it holds {ids or 'none'})")
    return problems, checked


def ledger_problems(agent_dirs: dict[str, Path]) -> list[str]:
    """Datasets whose spent or committed epsilon/delta exceed their budget, in any agent's ledger."""
    problems = []
    for site, d in agent_dirs.items():
        path = d / "privacy-ledger.sqlite"
        if not path.exists():
            continue
        with closing(_ro(path)) as db:
            budgets = {ds: (eps, dlt) for ds, eps, dlt in db.execute("SELECT dataset, epsilon, delta FROM budgets")}
            for ds, spent, committed, dlt in db.execute(
                    "SELECT dataset, SUM(spent_epsilon), SUM(CASE WHEN finished THEN spent_epsilon ELSE "
                    "MAX(planned_epsilon, spent_epsilon) END), SUM(delta) FROM tasks GROUP BY dataset"):
                eps_budget, delta_budget = budgets.get(ds, (0.0, 0.0))
                if spent > eps_budget + SLACK or committed > eps_budget + SLACK or dlt > delta_budget + SLACK:
                    problems.append(f"{site}'s ledger: dataset {ds} spent {spent:.4g} / committed {committed:.4g} "
                                    f"epsilon (delta {dlt:.3g}) of a budget of {eps_budget:.4g} ({delta_budget:.3g})")
    return problems


def ledger_spent(agent_dirs: dict[str, Path]) -> float:
    """The largest epsilon any dataset of any agent has spent (for the report)."""
    top = 0.0
    for d in agent_dirs.values():
        path = d / "privacy-ledger.sqlite"
        if path.exists():
            with closing(_ro(path)) as db:
                for (spent,) in db.execute("SELECT SUM(spent_epsilon) FROM tasks GROUP BY dataset"):
                    top = max(top, spent or 0.0)
    return top
