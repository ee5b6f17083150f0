"""Which of several aggregator replicas on one PostgreSQL database serves: a leader elected through PostgreSQL.

Contract (``[ha] enabled = true``, PostgreSQL state only):

- **Election.** Each replica holds one dedicated connection (autocommit, TCP keepalives) and polls
  ``pg_try_advisory_lock(HA_CLASS, HA_OBJECT)`` on it every ``[ha] poll_s``. A session-level advisory lock is held
  by exactly one session at a time and is released by PostgreSQL when that session ends: when the leader's process
  dies (SIGKILL: the server notices the closed socket at once; node loss: the server's TCP keepalives, set for
  this session, after about ``KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S`` seconds), the next poll
  of a standby wins. (The lock connection's own ``options`` replace any ``options=`` of the configured URL.)
- **Standby.** Until it wins, a replica runs its gRPC server with the health service reporting NOT_SERVING and
  refuses every other call with UNAVAILABLE (:class:`StandbyGate`), so clients with several addresses move on.
  Its engine is not started: it folds, ticks and deletes nothing.
- **Takeover.** On winning, ``on_elected`` runs (the aggregator starts its engine: the state is loaded from the
  store and open rounds are recovered from their durable updates exactly as a restarted aggregator does), then
  the gate opens and health says SERVING.
- **Fencing.** The leader checks its lock connection every ``poll_s``; if the connection fails, ``on_lost`` runs
  (the aggregator closes the gate and exits). Independently, every store transaction of an HA aggregator checks
  inside the transaction that the lock is still held by *its* lock session (:meth:`LeaderElection.fence_sql`), so a
  leader that lost its session can no longer commit anything, even before its next poll.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from fedclinic.errors import ConfigError, FedclinicError

from aggregator_service.store.database_settings import DatabaseSettings

log = structlog.get_logger("fedclinic.aggregator.ha")

#: the two int4 keys of the leader lock ("fedc", "lead"); a different key space from the store's one-bigint
#: write lock (pg_locks.objsubid 2, not 1), so the two never collide
HA_CLASS = 0x66656463
HA_OBJECT = 0x6C656164
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 2
KEEPALIVE_COUNT = 3
CONNECT_TIMEOUT_S = 5

#: the methods a standby still answers (all others: UNAVAILABLE)
HEALTH_PREFIX = "/grpc.health.v1.Health/"


class NotLeader(FedclinicError):
    """This replica does not hold the leader lock (any more): it must not write."""


class LeaderElection:
    """Poll for the leader lock on a dedicated connection; see the module docstring for the contract."""

    def __init__(self, settings: DatabaseSettings, poll_s: float, *, on_elected: Callable[[], None],
                 on_lost: Callable[[str], None]) -> None:
        self.settings = settings
        self.poll_s = poll_s
        self._on_elected = on_elected
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._conn: Any = None
        #: the backend pid of the lock session once elected (what :meth:`fence_sql` checks)
        self.backend_pid: int | None = None
        self.elected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leader-election", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop polling and end the lock session (a clean stop hands the lock over at once)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(self.poll_s + CONNECT_TIMEOUT_S + 1)
        self._close()

    def fence(self, conn: Any) -> None:
        """Inside a store transaction on ``conn`` (a psycopg connection): raise :class:`NotLeader` unless this
        replica's lock session still holds the leader lock, so the transaction rolls back."""
        pid = self.backend_pid
        if pid is None:
            raise NotLeader("this aggregator is the standby: it does not hold the leader lock and writes nothing")
        row = conn.execute("SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND classid::bigint = %s AND objid::bigint = %s "
                           "AND objsubid = 2 AND granted AND pid = %s",
                           (HA_CLASS & 0xFFFFFFFF, HA_OBJECT & 0xFFFFFFFF, pid)).fetchone()
        if row is None:
            raise NotLeader("this aggregator lost the leader lock (its lock session ended): it writes nothing "
                            "more and stops; the standby takes over")

    # the election thread ------------------------------------------------------------------------------------
    def _connect(self) -> Any:
        import psycopg

        kwargs: dict[str, Any] = {"autocommit": True, "connect_timeout": CONNECT_TIMEOUT_S,
                                  "application_name": "fedclinic-aggregator-leader-lock",
                                  "keepalives": 1, "keepalives_idle": KEEPALIVE_IDLE_S,
                                  "keepalives_interval": KEEPALIVE_INTERVAL_S, "keepalives_count": KEEPALIVE_COUNT,
                                  # the server's side of this session: a leader whose host vanished (no FIN, no
                                  # RST) loses its session, hence the lock, in about 11 s, not the OS's 2 hours
                                  "options": (f"-c tcp_keepalives_idle={KEEPALIVE_IDLE_S} "
                                              f"-c tcp_keepalives_interval={KEEPALIVE_INTERVAL_S} "
                                              f"-c tcp_keepalives_count={KEEPALIVE_COUNT}")}
        password = self.settings.password()
        if password is not None:
            kwargs["password"] = password
        return psycopg.connect(self.settings.url, **kwargs)

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass

    def _run(self) -> None:
        import psycopg

        while not self._stop.is_set() and not self.elected.is_set():
            try:
                if self._conn is None:
                    self._conn = self._connect()
                won = self._conn.execute("SELECT pg_try_advisory_lock(%s, %s)", (HA_CLASS, HA_OBJECT)).fetchone()[0]
                if won:
                    self.backend_pid = int(self._conn.execute("SELECT pg_backend_pid()").fetchone()[0])
                    self.elected.set()
                    break
            except psycopg.Error as exc:
                log.warning("leader election: database not reachable, retrying", error=str(exc).strip(),
                            database=self.settings.where())
                self._close()
            self._stop.wait(self.poll_s)
        if self._stop.is_set():
            return
        log.info("elected leader", database=self.settings.where(), lock_backend_pid=self.backend_pid)
        try:
            self._on_elected()
        except Exception as exc:  # noqa: BLE001 - a takeover that fails must fence, not serve half-started
            log.exception("takeover failed")
            self._on_lost(f"the takeover failed: {exc}")
            return
        while not self._stop.wait(self.poll_s):
            try:
                self._conn.execute("SELECT 1").fetchone()
            except psycopg.Error as exc:
                self.backend_pid = None
                self._close()
                self._on_lost(f"the leader lock connection failed: {str(exc).strip()}")
                return


class StandbyGate(grpc.ServerInterceptor):
    """Refuse every call but the health service's with UNAVAILABLE while :attr:`open` is not set."""

    def __init__(self, message: str) -> None:
        self.open = threading.Event()
        self.message = message

    def intercept_service(self, continuation, handler_call_details):
        if self.open.is_set() or handler_call_details.method.startswith(HEALTH_PREFIX):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        message = self.message

        def refuse(_request, context):
            context.abort(grpc.StatusCode.UNAVAILABLE, message)

        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(refuse, handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(refuse, handler.request_deserializer,
                                                        handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(refuse, handler.request_deserializer,
                                                        handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(refuse, handler.request_deserializer, handler.response_serializer)


@dataclass(frozen=True)
class HaSettings:
    """The ``[ha]`` table of aggregator.toml::

        [ha]
        enabled = true      # run as one of several replicas on one PostgreSQL database (leader + standbys)
        poll_s = 1.0        # how often a standby tries the leader lock and the leader checks its lock session

    HA needs ``[state] database = "postgresql://..."`` and every replica's ``state_dir`` on one shared volume
    mounted at the same path (blobs and update spill files are shared; their paths are stored in the database).
    """

    enabled: bool = False
    poll_s: float = 1.0

    @classmethod
    def from_table(cls, table: Any, src: str, state: DatabaseSettings) -> "HaSettings":
        if table is None:
            return cls()
        if not isinstance(table, dict):
            raise ConfigError(f"{src}: [ha] must be a table")
        unknown = set(table) - {"enabled", "poll_s"}
        if unknown:
            raise ConfigError(f"{src}: [ha] has unknown keys {sorted(unknown)}; known: enabled, poll_s")
        enabled = table.get("enabled", False)
        if not isinstance(enabled, bool):
            raise ConfigError(f"{src}: [ha] enabled must be true or false, got {enabled!r}")
        poll_s = table.get("poll_s", 1.0)
        if isinstance(poll_s, bool) or not isinstance(poll_s, (int, float)) or not 0.05 <= poll_s <= 30:
            raise ConfigError(f"{src}: [ha] poll_s must be a number of seconds from 0.05 to 30, got {poll_s!r}")
        if enabled and not state.is_postgresql:
            raise ConfigError(f"{src}: [ha] enabled = true needs the state in PostgreSQL: set [state] database = "
                              "\"postgresql://...\" (the replicas elect their leader through it); SQLite state "
                              "cannot be shared by two aggregators")
        return cls(enabled=enabled, poll_s=float(poll_s))
