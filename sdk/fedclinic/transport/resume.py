"""Resuming a cut model stream from the last verified chunk (``FetchModel``'s resume_tensor / resume_offset).

A receiver keeps its :class:`~fedclinic.transport.wire.ChunkAssembler` across the cut: the tensors completed
(verified against their sha256) and the verified prefix of the one being received, whose running hash goes on
with the resumed bytes. :func:`resume_point` says where to ask the sender to continue; :func:`is_cut` which
failures are a cut connection (worth resuming) rather than a refusal. A sender that ignores the resume fields
(an older aggregator) starts its stream over: :func:`honoured` tells, from the first tensor chunk of the resumed
stream, and the receiver then starts over too.
"""

from __future__ import annotations

from typing import Sequence

import grpc

from fedclinic.proto import tensors_pb2
from fedclinic.transport.wire import CHUNK_BYTES, ChunkAssembler

#: how many times one transfer is resumed before its failure is reported to the caller
MAX_RESUMES = 8
#: status codes of a connection that broke (reset, half-open connection found dead by keepalive, proxy gone)
CUT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL})


def is_cut(exc: grpc.RpcError) -> bool:
    """The call failed because the connection broke, not because the peer refused it."""
    return exc.code() in CUT_CODES


def resume_point(assembler: ChunkAssembler, order: Sequence[str]) -> tuple[str, int] | None:
    """(tensor, byte) where a cut stream of the tensors ``order`` (stream order) continues, or None when every
    one of them is complete. A partial tensor whose verified bytes do not end on a chunk boundary (a sender
    with other chunk sizes) is dropped and asked for from its first byte."""
    part = assembler.partial
    if part is not None:
        name, got = part
        if got % CHUNK_BYTES == 0:
            return name, got
        assembler.abort()
        return name, 0
    return next(((name, 0) for name in order if name not in assembler.done), None)


def honoured(chunk: tensors_pb2.TensorChunk, point: tuple[str, int]) -> bool:
    """Whether the first tensor chunk of a resumed stream starts where it was asked to."""
    return (chunk.name, int(chunk.offset)) == point
