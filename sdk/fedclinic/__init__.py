"""fedclinic: federated learning for hospitals.

Data scientists use :func:`connect` and :class:`Task`; the aggregator service and the hospital agent are
separate programs (``fedclinic-aggregator``, ``hospital-agent``) built on this library::

    import fedclinic

    task = fedclinic.Task.from_toml("task.toml")
    with fedclinic.connect("aggregator:7443", cert="me.crt", key="me.key", ca="ca.crt") as client:
        status = client.submit(task)
        client.wait(status.task_id)

The public surface is what ``__all__`` lists: :func:`connect`, :class:`Client`, :class:`Task`, and the error
tree rooted at :class:`FedclinicError` (see :mod:`fedclinic.errors`). ``connect``, ``Client`` and ``Task``
load on first use, so ``import fedclinic`` stays cheap for the services and for serving, which need neither.
Everything else lives in subpackages by role; docs/architecture.md is their map.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedclinic import _moved
from fedclinic.errors import ConfigError, DatasetError, FedclinicError, IntegrityError, PolicyError
from fedclinic.version import PROTOCOL_VERSION, __version__

if TYPE_CHECKING:
    from fedclinic.client import Client, connect
    from fedclinic.spec.task import Task


#: public name -> module that defines it (loaded on first access)
_LAZY = {"connect": "fedclinic.client", "Client": "fedclinic.client", "Task": "fedclinic.spec.task"}

__all__ = [
    "__version__",
    "PROTOCOL_VERSION",
    "connect",
    "Client",
    "Task",
    "FedclinicError",
    "ConfigError",
    "DatasetError",
    "IntegrityError",
    "PolicyError",
]

_moved.install()


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fedclinic' has no attribute {name!r}")
    import importlib  # only on the first access of a lazy name

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
