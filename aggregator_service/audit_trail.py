"""The aggregator's audit trail: ``STATE_DIR/audit.jsonl``, append-only and hash-chained (fedclinic.runtime.audit_log).

What is recorded, and when:

- every task event the engine journals (task submitted / cancelled / failed / completed, round opened / closed
  with its model hash / missed quorum, site joined a round / declined / held it (e.g. awaiting approval),
  update received with its size and sha256): written right **after** the SQLite transaction that made the change commits
  (``Store.on_commit``), so the trail never claims a change the state does not hold;
- agents' work streams opening and closing (``site.connected`` / ``site.disconnected``);
- models downloaded, by whom (agents and data scientists), after the stream ends;
- calls refused by the certificate check (revoked certificate, wrong role, no certificate:
  ``auth.refused``). Connections the TLS handshake already refuses (unknown CA, expired certificate) never
  reach the service and are not in the trail.

A record that cannot be written is logged as an error and the service goes on; the log then refuses further
writes until the aggregator restarts (which checks the file's tail).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog

from fedclinic.runtime.audit_log import AuditError, AuditEvent, AuditLog

log = structlog.get_logger("fedclinic.aggregator.audit")

#: task-event kinds (Store.add_event) -> audit record kinds
EVENT_KINDS = {
    "submitted": "task.submitted",
    "cancelled": "task.cancelled",
    "failed": "task.failed",
    "completed": "task.completed",
    "round-opened": "round.opened",
    "round-closed": "round.closed",
    "round-failed": "round.missed_quorum",
    "site-assigned": "site.joined_round",
    "declined": "site.declined",
    "held": "site.held",
    "update-received": "update.received",
    "results-opened": "results.opened",
    "result-received": "result.received",
    "results-closed": "results.closed",
    "round-evaluated": "round.evaluated",
}


class AuditTrail:
    def __init__(self, path: str | Path) -> None:
        self.log = AuditLog(path, on_torn_tail="quarantine")

    def record(self, kind: str, *, actor: str, task_id: str | None = None, **details: Any) -> None:
        try:
            self.log.append(kind, actor=actor, task_id=task_id, **details)
        except AuditError as exc:
            log.error("audit record not written", kind=kind, error=str(exc))

    def on_commit(self, events: list[dict[str, Any]]) -> None:
        """Store.on_commit: one record per journaled task event, written with one fsync."""
        records = [AuditEvent(EVENT_KINDS.get(e["kind"], "task." + e["kind"].replace("-", "_")),
                              e["actor"] or "aggregator", e["task_id"],
                              {"message": e["message"], **e["details"]}) for e in events]
        try:
            self.log.append_many(records)
        except AuditError as exc:
            log.error("audit records not written", kinds=[r.kind for r in records], error=str(exc))

    def close(self) -> None:
        self.log.close()


class NoAudit:
    """Stands in where no trail is configured (unit tests that build the services by hand)."""

    def record(self, kind: str, *, actor: str, task_id: str | None = None, **details: Any) -> None:
        pass
