"""An exception no handler mapped becomes a status that says what to do, never its own text (a server path)."""

from __future__ import annotations

import errno
import sqlite3

import grpc
import pytest

from aggregator_service.rpc_errors import status_for

SECRET = "/srv/aggregator-state/blobs/ab/cdef"


@pytest.mark.parametrize("exc,code", [
    (OSError(errno.ENOSPC, "No space left on device", SECRET), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (sqlite3.OperationalError("database or disk is full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (MemoryError(), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", SECRET), grpc.StatusCode.FAILED_PRECONDITION),
    (OverflowError(f"cannot convert float infinity to integer {SECRET}"), grpc.StatusCode.INTERNAL),
])
def test_unmapped_failures_get_a_status_and_an_error_id_never_their_text(exc, code):
    got, message = status_for(exc, "e1")
    assert got == code and "e1" in message and SECRET not in message and "operator" in message
