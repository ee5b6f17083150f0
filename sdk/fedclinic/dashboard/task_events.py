"""The events of the tasks the page shows, followed in the background over ``Control.WatchTask``.

The control API gives a task's owner (and admins) the task's event trail: submitted, round opened, update
received, held, declined, round closed, failed, completed. The aggregator's audit log itself is not exposed over
the control API, so this trail is what the page shows as the task's audit events.

One daemon thread per task followed (at most :data:`MAX_FOLLOWED` at a time: past that the oldest finished one is
dropped, or the page says the limit is reached); each keeps the last :data:`KEEP_EVENTS` events. A thread ends when
its task ends (the stream ends) or the watch fails; the failure is shown as the list's note.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable, Iterable

from fedclinic.errors import FedclinicError

MAX_FOLLOWED = 16
KEEP_EVENTS = 200


class _Followed:
    def __init__(self) -> None:
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=KEEP_EVENTS)
        self.note = ""
        self.done = False


class TaskEvents:
    """Follows tasks' events with ``watch(task_id)`` (an iterator of TaskEvent, e.g. ``Client.watch``)."""

    def __init__(self, watch: Callable[[str], Iterable[Any]]) -> None:
        self._watch = watch
        self._lock = threading.Lock()
        self._tasks: dict[str, _Followed] = {}

    def events(self, task_id: str) -> tuple[list[dict[str, Any]], str]:
        """The events seen so far (oldest first) and a note (why the list may be incomplete); starts following
        the task on first use."""
        with self._lock:
            followed = self._tasks.get(task_id)
            if followed is None:
                if len(self._tasks) >= MAX_FOLLOWED:
                    done = next((t for t, f in self._tasks.items() if f.done), None)
                    if done is None:
                        return [], f"events are followed for {MAX_FOLLOWED} running tasks at most"
                    del self._tasks[done]
                followed = self._tasks[task_id] = _Followed()
                threading.Thread(target=self._follow, args=(task_id, followed), name=f"events-{task_id}",
                                 daemon=True).start()
            return list(followed.events), followed.note

    def _follow(self, task_id: str, followed: _Followed) -> None:
        try:
            for event in self._watch(task_id):
                with self._lock:
                    followed.events.append({"seq": event.seq, "kind": event.kind, "message": event.message,
                                            "unix_ms": event.unix_ms})
        except FedclinicError as exc:
            followed.note = f"events unavailable: {exc}"
        except Exception as exc:  # a defect or a dropped channel: shown on the page, never raised in a thread
            followed.note = f"events stopped: {type(exc).__name__}: {exc}"
        finally:
            followed.done = True
