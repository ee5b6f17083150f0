"""The masking / secret-sharing graph: complete (SecAgg) or a random k-regular Harary graph (SecAgg+).

SecAgg (Bonawitz et al. 2017) lets every client mask with, and share its secrets among, every other
client: per-client cost O(n) keys and shares, O(n P) mask expansion. SecAgg+ (Bell et al. 2020) replaces
the complete graph by a random k-regular graph with k = O(log n): each client only agrees keys with, masks
with and shares to its k neighbours, so its cost is O(k P). With ``degree=None`` (or ``degree >= n-1``)
this module gives the complete graph, i.e. SecAgg is the special case.

Construction (as in Google's ``SecretSharingHararyGraph``): order the members by a uniformly random
permutation ``pi`` and connect each member to the ``k/2`` members before and after it on the ring
(the Harary graph H_{k,n}, k even). ``pi`` is a Fisher-Yates shuffle driven by a SHA-256 counter-mode
stream of ``seed``; the session derives ``seed`` from the session id *and all advertised public keys*
(:meth:`KeyDirectory.graph_seed <fedclinic.secagg.messages.KeyDirectory.graph_seed>`), so every client
recomputes the same graph on its own and the server cannot pick neighbourhoods without first seeing
(and being bound to) every key. A server can still re-draw the graph by choosing *which* advertising
clients to keep; that is why hospital federations (tens of sites) should use the complete graph, which
leaves nothing to choose, and why :func:`suggested_degree` is only a starting point for large cohorts.

Each member's *holders* are its neighbours plus itself: it Shamir-shares its two secrets among them
(so ``|holders| = k + 1``), and the threshold ``t`` is relative to that size.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fedclinic.secagg.errors import SecAggConfigError


def suggested_degree(n: int) -> int | None:
    """An even degree ``k ~ 2 ceil(log2 n)`` for ``n`` clients, or ``None`` (complete graph) when that
    is not sparser than complete.

    A heuristic in the spirit of Bell et al.; their exact parameters depend on the tolerated corrupt and
    dropout fractions and a statistical security parameter (Google's finder uses 2^-40 and gives up on
    sparse graphs below ~500 clients). For hospital-scale cohorts prefer the complete graph.
    """
    if n < 2:
        raise SecAggConfigError("a secure-aggregation cohort needs at least 2 clients")
    k = 2 * math.ceil(math.log2(n))
    return None if k >= n - 1 else k


def effective_degree(n: int, degree: int | None) -> int:
    """Neighbours per member in an ``n``-member graph: ``n-1`` for the complete graph."""
    return n - 1 if degree is None or degree >= n - 1 else degree


def check_degree(degree: int | None) -> None:
    """Refuse degrees that do not give a regular Harary graph (odd, or below 2)."""
    if degree is None:
        return
    if not isinstance(degree, int) or isinstance(degree, bool) or degree < 2 or degree % 2:
        raise SecAggConfigError(f"neighbour degree must be an even integer >= 2 (or None for the complete "
                                f"graph), got {degree!r}")


class _Stream:
    """Deterministic uniform integers from SHA-256(seed || counter) with rejection sampling."""

    def __init__(self, seed: bytes) -> None:
        self._seed, self._counter, self._buf = seed, 0, b""

    def _word(self) -> int:
        if len(self._buf) < 8:
            self._buf += hashlib.sha256(self._seed + self._counter.to_bytes(8, "big")).digest()
            self._counter += 1
        w, self._buf = int.from_bytes(self._buf[:8], "big"), self._buf[8:]
        return w

    def below(self, m: int) -> int:
        limit = (1 << 64) - (1 << 64) % m  # largest multiple of m: no modulo bias
        while True:
            w = self._word()
            if w < limit:
                return w % m


def _permutation(members: Sequence[str], seed: bytes) -> list[str]:
    perm = list(members)
    stream = _Stream(hashlib.sha256(b"fedclinic-secagg/v1/graph-permutation" + seed).digest())
    for i in range(len(perm) - 1, 0, -1):
        j = stream.below(i + 1)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


@dataclass(frozen=True)
class NeighbourGraph:
    """An undirected regular graph over ``members`` (sorted); ``degree`` is the effective degree."""

    members: tuple[str, ...]
    degree: int
    adjacency: Mapping[str, frozenset[str]]

    @classmethod
    def build(cls, members: Sequence[str], degree: int | None, seed: bytes) -> NeighbourGraph:
        """The complete graph (``degree`` None or ``>= n-1``) or the seeded random Harary graph H_{k,n}."""
        check_degree(degree)
        ms = tuple(sorted(set(members)))
        if len(ms) != len(members):
            raise SecAggConfigError("graph members must be distinct")
        n = len(ms)
        k = effective_degree(n, degree)
        if k == n - 1:
            adj = {u: frozenset(ms) - {u} for u in ms}
        else:
            perm = _permutation(ms, seed)
            half = k // 2
            adj = {perm[i]: frozenset(perm[(i + d) % n] for d in range(-half, half + 1) if d != 0)
                   for i in range(n)}
        return cls(members=ms, degree=k, adjacency=adj)

    @property
    def is_complete(self) -> bool:
        return self.degree == len(self.members) - 1

    def neighbours(self, member: str) -> frozenset[str]:
        """The members ``member`` masks with (excluding itself)."""
        try:
            return self.adjacency[member]
        except KeyError:
            raise SecAggConfigError(f"{member!r} is not a member of this session's graph") from None

    def holders(self, member: str) -> frozenset[str]:
        """The members that hold shares of ``member``'s secrets: its neighbours and itself."""
        return self.neighbours(member) | {member}
