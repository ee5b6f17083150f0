"""Session parameters (chosen by the aggregator, checked by everyone) and the site's own policy.

Threshold rule
--------------
Each client's secrets are shared among its ``h = degree + 1`` holders (``h = n`` for the complete graph)
with threshold ``t``. We require ``2t > h``: a server that tells some holders "u dropped" (to collect
shares of u's mask key) and others "u survived" (to collect shares of u's self-mask seed) gets one kind
of share from each honest holder, so it can never collect ``t`` of both. The default is
``t = ceil(2h/3)``, the bound under which Bonawitz et al. prove security against an active server
colluding with fewer than ``h/3`` clients; the round then tolerates ``h - t`` dropouts per
neighbourhood (3 of 10 for a complete 10-site cohort).
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field
from functools import cached_property

from fedclinic.secagg.encoding import DOMAIN, encode
from fedclinic.secagg.errors import SecAggConfigError
from fedclinic.secagg.graph import check_degree, effective_degree
from fedclinic.secagg.masks import MAX_WORDS
from fedclinic.secagg.quantize import Quantizer

MIN_COHORT_FLOOR = 3
"""No policy may go below 3: with 2 survivors each learns the other's update by subtracting its own."""


def default_threshold(holders: int) -> int:
    """``ceil(2h/3)`` (never below the strict majority ``floor(h/2) + 1``)."""
    return max(math.ceil(2 * holders / 3), holders // 2 + 1)


@dataclass(frozen=True)
class SessionParams:
    """Everything that defines one secure-aggregation session (one round of one task).

    ``cohort`` is the set of invited sites (stored sorted); a site's Shamir abscissa is its 1-based
    position in it. ``degree=None`` means the complete graph (SecAgg); an even ``degree`` gives SecAgg+.
    ``threshold`` defaults to :func:`default_threshold` of the holder count. ``nonce`` is fresh per
    session so that a re-run of the same round (after an aggregator restart) gets new keys and masks.
    """

    task_id: str
    round: int
    cohort: tuple[str, ...]
    model_hash: bytes
    vector_length: int
    quantizer: Quantizer = field(default_factory=Quantizer)
    degree: int | None = None
    threshold: int = 0  # 0 = default_threshold(holders)
    nonce: bytes = field(default_factory=lambda: os.urandom(16))
    #: the input layout's digest (:meth:`fedclinic.secagg.vector_layout.VectorLayout.digest`; empty: a plain
    #: vector): sites given different layouts derive different session ids, so their masks never cancel
    layout_digest: bytes = b""

    def __post_init__(self) -> None:
        if not isinstance(self.task_id, str) or not self.task_id:
            raise SecAggConfigError("task_id must be a non-empty string")
        if not isinstance(self.round, int) or self.round < 0:
            raise SecAggConfigError(f"round must be a non-negative integer, got {self.round!r}")
        cohort = tuple(self.cohort)
        if any(not isinstance(c, str) or not c for c in cohort):
            raise SecAggConfigError("cohort members must be non-empty strings")
        if len(set(cohort)) != len(cohort):
            raise SecAggConfigError("cohort members must be distinct")
        if len(cohort) < 2:
            raise SecAggConfigError("secure aggregation needs a cohort of at least 2 sites (3 by policy)")
        object.__setattr__(self, "cohort", tuple(sorted(cohort)))
        if not isinstance(self.model_hash, bytes) or len(self.model_hash) != 32:
            raise SecAggConfigError("model_hash must be the 32-byte SHA-256 of the global model")
        if not isinstance(self.vector_length, int) or not 1 <= self.vector_length <= MAX_WORDS:
            raise SecAggConfigError(f"vector_length must be in [1, {MAX_WORDS}], got {self.vector_length!r}")
        if not isinstance(self.quantizer, Quantizer):
            raise SecAggConfigError("quantizer must be a fedclinic.secagg.Quantizer")
        check_degree(self.degree)
        if not isinstance(self.nonce, bytes) or len(self.nonce) < 16:
            raise SecAggConfigError("the session nonce must be at least 16 random bytes")
        h = self.holders
        if self.threshold == 0:
            object.__setattr__(self, "threshold", default_threshold(h))
        t = self.threshold
        if not isinstance(t, int) or isinstance(t, bool) or not 2 <= t <= h or 2 * t <= h:
            raise SecAggConfigError(
                f"threshold {t!r} is unsafe or unreachable for {h} share holders per client: it must satisfy "
                f"2*t > {h} (so the server can never collect both shares of one client) and t <= {h}; "
                f"the default is {default_threshold(h)}")
        self.quantizer.check_cohort(len(self.cohort))

    @property
    def holders(self) -> int:
        """Nominal share holders per client (neighbours + itself) in the full cohort."""
        return effective_degree(len(self.cohort), self.degree) + 1

    @property
    def consistency_quorum(self) -> int:
        """Survivor attestations a site needs before it releases any share: ``max(threshold, n // 2 + 1)``
        of the ``n``-site cohort. Each site attests one survivor set per session, so two different survivor
        sets can never both gather a quorum of honest signers (for the complete graph, ``2t > n`` already
        makes this ``t``; for SecAgg+ the majority term adds it)."""
        return max(self.threshold, len(self.cohort) // 2 + 1)

    @property
    def tolerated_dropouts(self) -> int:
        """Dropouts per neighbourhood the round survives: ``holders - threshold``."""
        return self.holders - self.threshold

    @cached_property
    def session_id(self) -> bytes:
        """SHA-256 over every parameter (task, round, cohort, threshold, graph, quantizer, model hash,
        nonce, input layout): 32 bytes that salt every key derivation and appear in every message."""
        q = self.quantizer
        parts = encode(DOMAIN, "session", self.task_id, self.round, len(self.cohort), *self.cohort,
                       self.threshold, 0 if self.degree is None else self.degree, self.vector_length,
                       q.clip, q.bits, q.rounding, self.model_hash, self.nonce,
                       *(() if (q.ring_bits, q.weight_cap) == (32, 1) else ("ring", q.ring_bits, q.weight_cap)),
                       *(("layout", self.layout_digest) if self.layout_digest else ()))
        return hashlib.sha256(parts).digest()

    def x_of(self, member: str) -> int:
        """Shamir abscissa of ``member``: its 1-based position in the sorted cohort."""
        try:
            return self.cohort.index(member) + 1
        except ValueError:
            raise SecAggConfigError(f"{member!r} is not in this session's cohort") from None


@dataclass(frozen=True)
class ClientPolicy:
    """What a site accepts, enforced by the client whatever the server says.

    - ``min_cohort``: refuse cohorts, advertised key sets and survivor sets smaller than this (>= 3).
    - ``min_threshold_fraction``: refuse a threshold ``t <= fraction * holders`` (>= 0.5, the
      both-shares defence; raise it to 2/3 for the active-adversary bound).
    - ``min_degree``: refuse sparse graphs in which a client masks with fewer neighbours than this.
    """

    min_cohort: int = MIN_COHORT_FLOOR
    min_threshold_fraction: float = 0.5
    min_degree: int = 2

    def __post_init__(self) -> None:
        if not isinstance(self.min_cohort, int) or self.min_cohort < MIN_COHORT_FLOOR:
            raise SecAggConfigError(
                f"min_cohort must be an integer >= {MIN_COHORT_FLOOR}: with 2 sites each learns the other's "
                "update from the sum")
        if not 0.5 <= self.min_threshold_fraction < 1:
            raise SecAggConfigError("min_threshold_fraction must be in [0.5, 1)")
        if not isinstance(self.min_degree, int) or self.min_degree < 2:
            raise SecAggConfigError("min_degree must be an integer >= 2")
