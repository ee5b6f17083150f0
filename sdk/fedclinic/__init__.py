"""fedclinic: federated learning for hospitals.

Data scientists use :func:`connect` and :class:`Task`; the aggregator service and the hospital agent are
separate programs (``fedclinic-aggregator``, ``hospital-agent``) built on this library.
"""

from __future__ import annotations

__version__ = "0.1.0"
PROTOCOL_VERSION = 1

__all__ = ["__version__", "PROTOCOL_VERSION"]
