"""Stake checks: a site writes only into what it was assigned.

Every AgentService call that writes something about a task (Decline, Hold, SecAggRespond; SubmitUpdate through
its header check in aggregator_service.update_admission and secure_rounds.check_masked_header) first asks
:func:`require_assignment`. A site never assigned to the task is refused PERMISSION_DENIED, the same answer
whether the task exists or not (a site learns nothing about other tasks); a site assigned to the task but not
to that round gets FAILED_PRECONDITION. Nothing is written for a refused call.
"""

from __future__ import annotations

import grpc

from fedclinic.errors import Refused

from aggregator_service.store import Store


def require_assignment(store: Store, site: str, task_id: str, rnd: int, what: str) -> None:
    """Refused unless ``site`` has an assignment to round ``rnd`` of ``task_id`` (module docstring); ``what``
    names the call for the message (e.g. "decline")."""
    if store.assignment(task_id, rnd, site) is not None:
        return
    if store.is_assigned(task_id, site):
        raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                      f"{site} has no assignment to round {rnd} of task {task_id}; it can only {what} the rounds it "
                      "was assigned")
    raise Refused(grpc.StatusCode.PERMISSION_DENIED,
                  f"{site} was never assigned to task {task_id!r}; a site can only {what} tasks it was assigned")
