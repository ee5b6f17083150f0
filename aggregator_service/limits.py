"""Every per-peer limit of the aggregator in one place: defaults, the ``[limits]`` table of ``aggregator.toml``,
and validation (:class:`~fedclinic.errors.ConfigError` naming the key and what it takes).

What each limit guards and the status a caller gets when it is reached (SECURITY.md, "Per-peer limits"):

- concurrent calls per certificate identity, by class (``aggregator_service.peer_limits``): work streams
  (WatchWork, WatchTask, Health.Watch), uploads (SubmitUpdate, SubmitTask), downloads (the two FetchModel),
  unary calls (everything else) -> RESOURCE_EXHAUSTED at once;
- long-lived calls of all peers together: at most ``max_workers - unary_reserve`` (the reserve at most half the
  pool), so that ``unary_reserve`` worker threads always remain for Hello, ListTasks, GetTask, Decline, ...
  -> RESOURCE_EXHAUSTED at once;
- calls queued for a worker thread: ``max_concurrent_rpcs`` (gRPC's own server option) -> RESOURCE_EXHAUSTED;
- a client stream (SubmitUpdate, SubmitTask) that sends nothing for ``idle_timeout_s`` -> DEADLINE_EXCEEDED;
- field lengths (``aggregator_service.field_limits``): free-text reasons truncated with a marker at
  ``reason_chars``; any other string over ``string_chars``, bytes over ``bytes_field``, list or map over
  ``list_entries`` (or the field's own entry in the table) -> INVALID_ARGUMENT naming the field;
- a submitted model's files: at most ``model_files`` files and ``model_file_bytes`` bytes in all, declared in
  the manifest, streamed to disk (never held in memory) -> INVALID_ARGUMENT.

Sizing rule for ``max_workers`` (the gRPC thread pool): every connected agent holds one WatchWork stream and,
during a round, one upload or download; every watching scientist one WatchTask. So
``max_workers >= 2 x agents + watching scientists + unary_reserve`` (default 256: about 110 agents).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from fedclinic.errors import ConfigError


@dataclass(frozen=True)
class Limits:
    """The aggregator's per-peer limits (module docstring); every field is a ``[limits]`` key."""

    #: concurrent work streams (WatchWork, WatchTask, Health.Watch) per certificate identity
    work_streams_per_peer: int = 8
    #: concurrent uploads (SubmitUpdate, SubmitTask) per certificate identity
    uploads_per_peer: int = 4
    #: concurrent downloads (FetchModel of either service) per certificate identity
    downloads_per_peer: int = 4
    #: concurrent unary calls per certificate identity
    unary_per_peer: int = 16
    #: worker threads long-lived calls may never take: they stay free for unary calls (at most max_workers // 2)
    unary_reserve: int = 16
    #: calls admitted by gRPC at once (running or waiting for a thread); 0 = 2 x max_workers
    max_concurrent_rpcs: int = 0
    #: seconds a client stream (SubmitUpdate, SubmitTask) may send nothing before it is ended
    idle_timeout_s: float = 60.0
    #: free-text reasons (Decline, Hold, CancelTask) longer than this are truncated with a marker
    reason_chars: int = 2000
    #: any other string field (unless field_limits.FIELD_LIMITS says otherwise)
    string_chars: int = 4096
    #: any bytes field except tensor and file chunk data (bounded by the chunk size)
    bytes_field: int = 1 << 20
    #: entries of any list or map field (unless field_limits.FIELD_LIMITS says otherwise)
    list_entries: int = 10_000
    #: files of a submitted model
    model_files: int = 1000
    #: bytes of all files of a submitted model together
    model_file_bytes: int = 1 << 30

    def long_lived_cap(self, max_workers: int) -> int:
        """How many long-lived calls (streams, uploads, downloads) all peers together may hold: ``max_workers``
        less ``unary_reserve``, which is at most half of them."""
        return max_workers - min(self.unary_reserve, max_workers // 2)

    def concurrent_rpcs(self, max_workers: int) -> int:
        return self.max_concurrent_rpcs or 2 * max_workers

    def check(self, max_workers: int, where: str) -> None:
        """ConfigError when the limits cannot work with ``max_workers`` threads."""
        if self.max_concurrent_rpcs and self.max_concurrent_rpcs < max_workers:
            raise ConfigError(f"{where}: [limits] max_concurrent_rpcs = {self.max_concurrent_rpcs} is below "
                              f"max_workers = {max_workers}; set it to at least max_workers (or 0 for 2 x max_workers)")

    @classmethod
    def from_table(cls, table: Any, where: str) -> "Limits":
        """The ``[limits]`` table (absent keys keep their defaults). ConfigError for an unknown key or a value that
        is not a positive number of the right kind."""
        if table is None:
            return cls()
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [limits] must be a table, got {type(table).__name__}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(table) - set(known))
        if unknown:
            raise ConfigError(f"{where}: [limits] has unknown key(s) {unknown}; known: {', '.join(sorted(known))}")
        values: dict[str, Any] = {}
        for key, raw in table.items():
            is_float = known[key].type in ("float", float)
            ok_type = (int, float) if is_float else (int,)
            if isinstance(raw, bool) or not isinstance(raw, ok_type):
                kind = "a number of seconds" if is_float else "a whole number"
                raise ConfigError(f"{where}: [limits] {key} must be {kind}, got {raw!r}")
            floor = 0 if key == "max_concurrent_rpcs" else (0.1 if is_float else 1)
            if not raw >= floor or (is_float and raw > 86_400):
                bound = "at least 0" if floor == 0 else ("between 0.1 and 86400" if is_float else "at least 1")
                raise ConfigError(f"{where}: [limits] {key} must be {bound}, got {raw!r}")
            values[key] = float(raw) if is_float else int(raw)
        return cls(**values)
