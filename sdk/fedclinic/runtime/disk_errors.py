"""Is an exception a full disk? One answer for the aggregator (which maps it to RESOURCE_EXHAUSTED) and the agent
(which declines the round for now, not for good, since space may come back)."""

from __future__ import annotations

import errno
import sqlite3

#: SQLite's primary result codes: SQLITE_IOERR (a write the OS refused, e.g. after ENOSPC in WAL mode), SQLITE_FULL
_SQLITE_IOERR = 10
_SQLITE_FULL = 13


def is_disk_full(exc: BaseException) -> bool:
    """``OSError`` ENOSPC / EDQUOT, or SQLite's "database or disk is full" (SQLITE_FULL)."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(exc, sqlite3.OperationalError) and (
        getattr(exc, "sqlite_errorcode", None) == _SQLITE_FULL or "disk is full" in str(exc))


def is_local_storage_failure(exc: BaseException) -> bool:
    """A full disk (:func:`is_disk_full`), any other ``OSError``, or SQLite failing to write its file
    (SQLITE_IOERR, "disk I/O error"): a problem of this host's storage, which may go away, never of what a peer
    sent."""
    if is_disk_full(exc) or isinstance(exc, OSError):
        return True
    return isinstance(exc, sqlite3.OperationalError) and (
        (getattr(exc, "sqlite_errorcode", 0) or 0) & 0xFF == _SQLITE_IOERR or "disk I/O error" in str(exc))
