"""Partitioners that split one dataset over simulated sites (for experiments and the simulator).

Every partitioner is a pure function of its arguments: the same seed gives the same split on every machine
(``numpy.random.default_rng(seed)``, PCG64). Each returns ``list[list[int]]``: one sorted index list per site;
the lists are disjoint and together cover ``range(n)`` exactly once.
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

import numpy as np

from fedclinic.errors import ConfigError

#: Fresh Dirichlet draws tried before the deterministic repair step of :func:`dirichlet_label_skew`.
MAX_REDRAWS = 100


def _check(n: int, sites: int, min_per_site: int = 1) -> None:
    if not isinstance(sites, (int, np.integer)) or sites < 1:
        raise ConfigError(f"sites must be a positive integer, got {sites!r}")
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise ConfigError(f"the number of examples must be a non-negative integer, got {n!r}")
    if min_per_site < 0:
        raise ConfigError(f"min_per_site must be >= 0, got {min_per_site}")
    if n < sites * min_per_site:
        raise ConfigError(f"cannot give each of {sites} sites at least {min_per_site} example(s) from only {n}; "
                          "use fewer sites or a smaller min_per_site")


def _check_alpha(alpha: float) -> float:
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise ConfigError(f"alpha must be a finite number > 0, got {alpha!r} (small = more skew, large = near IID)")
    return float(alpha)


def _sorted_lists(parts: Sequence[np.ndarray]) -> list[list[int]]:
    return [sorted(int(i) for i in p) for p in parts]


def iid(n: int, sites: int, seed: int) -> list[list[int]]:
    """Uniform split: a random permutation ``pi`` of ``range(n)`` cut into ``sites`` contiguous blocks.

    Site ``k`` gets ``pi[b_k : b_{k+1}]`` with block sizes ``floor(n/K)`` or ``ceil(n/K)`` (the first
    ``n mod K`` sites get one more), so every site sees the same label distribution in expectation.
    """
    _check(n, sites, 1)
    perm = np.random.default_rng(seed).permutation(n)
    return _sorted_lists(np.array_split(perm, sites))


def quantity_skew(n: int, sites: int, alpha: float, seed: int, min_per_site: int = 1) -> list[list[int]]:
    """Unequal site sizes, IID content.

    Proportions ``q ~ Dirichlet(alpha * 1_K)``; site sizes ``|S_k| = m + M_k`` with
    ``(M_1..M_K) ~ Multinomial(n - K m, q)`` and ``m = min_per_site``; then a uniform random permutation of
    ``range(n)`` is cut into blocks of those sizes. Small ``alpha`` -> a few large sites; large ``alpha`` ->
    near-equal sizes.
    """
    _check(n, sites, min_per_site)
    alpha = _check_alpha(alpha)
    rng = np.random.default_rng(seed)
    q = rng.dirichlet(np.full(sites, alpha))
    sizes = min_per_site + rng.multinomial(n - sites * min_per_site, q)
    perm = rng.permutation(n)
    return _sorted_lists(np.split(perm, np.cumsum(sizes)[:-1]))


def dirichlet_label_skew(labels: Sequence[Hashable], sites: int, alpha: float, seed: int,
                         min_per_site: int = 1) -> list[list[int]]:
    """Label-distribution skew (Hsu et al. 2019): each class is spread over sites by its own Dirichlet draw.

    For every class ``c`` (in order of first appearance) with index set ``I_c`` (shuffled), draw
    ``p_c ~ Dirichlet(alpha * 1_K)`` and give site ``k`` the slice of ``I_c`` between cut points
    ``floor(|I_c| * cumsum(p_c)_{k-1})`` and ``floor(|I_c| * cumsum(p_c)_k)``. Small ``alpha`` -> each site
    holds few classes; large ``alpha`` -> near IID.

    ``min_per_site``: the whole draw is repeated (up to :data:`MAX_REDRAWS` times, i.e. conditioning on the
    event that every site gets at least ``m`` examples); if that never happens, a deterministic repair
    moves random examples from the currently largest site to each site that is short, so at most ``K * m``
    examples deviate from the Dirichlet split.
    """
    labels = list(labels)
    n = len(labels)
    _check(n, sites, min_per_site)
    alpha = _check_alpha(alpha)
    rng = np.random.default_rng(seed)
    classes: dict[Hashable, list[int]] = {}
    for i, lab in enumerate(labels):
        classes.setdefault(lab, []).append(i)
    class_idx = [np.asarray(v, dtype=np.int64) for v in classes.values()]
    parts: list[list[int]] = []
    for _ in range(MAX_REDRAWS):
        parts = [[] for _ in range(sites)]
        for idx in class_idx:
            shuffled = rng.permutation(idx)
            p = rng.dirichlet(np.full(sites, alpha))
            cuts = np.floor(np.cumsum(p)[:-1] * len(shuffled)).astype(np.int64)
            for k, chunk in enumerate(np.split(shuffled, cuts)):
                parts[k].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_per_site:
            return [sorted(p) for p in parts]
    # repair: move examples from the largest site to the short ones (always possible: n >= K * m)
    for k in range(sites):
        while len(parts[k]) < min_per_site:
            donor = max(range(sites), key=lambda j: (len(parts[j]), -j))
            j = int(rng.integers(len(parts[donor])))
            parts[k].append(parts[donor].pop(j))
    return [sorted(p) for p in parts]


__all__ = ["MAX_REDRAWS", "dirichlet_label_skew", "iid", "quantity_skew"]
