"""The sites' path to :class:`fedclinic.strategies.secure_random.SecureRandom`.

The CSPRNG is torch-free and serves both sides -- the aggregator's client-level DP noise
(:mod:`fedclinic.strategies.client_dp`) and the sites' DP-SGD noise -- so it lives below the strategies, as the
accounting does (:mod:`fedclinic.privacy.accounting`); it is re-exported here.
"""

from __future__ import annotations

from fedclinic.strategies.secure_random import SecureRandom

__all__ = ["SecureRandom"]
