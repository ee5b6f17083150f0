"""The Prometheus endpoint of the services: where it listens, serving one registry, bounded task labels.

Both services (``aggregator_service.metrics``, ``hospital_agent.metrics``) define their metrics in a
:class:`prometheus_client.CollectorRegistry` of their own (never the process-global one, so several services
in one process do not collide) and expose it with :class:`MetricsServer` when ``metrics_address`` is set.

The endpoint is **off unless configured**. It serves plain HTTP ``GET /metrics`` to whoever can reach the
address and pushes nothing anywhere: no telemetry leaves the machine unless an operator's Prometheus scrapes
it. Give a loopback address (``127.0.0.1:9464``) unless a NetworkPolicy or firewall limits who may connect.
"""

from __future__ import annotations

import ipaddress
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, disable_created_metrics, start_http_server
from prometheus_client.metrics import MetricWrapperBase

from fedclinic.runtime.durable_file import write_atomically
from fedclinic.errors import ConfigError

# no "*_created" timestamp series beside each counter: half the series, nothing a dashboard needs
disable_created_metrics()

#: what a metrics_address looks like, for error messages
ADDRESS_HELP = 'HOST:PORT with HOST an IP address or "localhost", e.g. "127.0.0.1:9464" or "[::1]:9464"'


@dataclass(frozen=True)
class MetricsAddress:
    """Where the endpoint listens: ``host`` an IP literal or ``localhost``, ``port`` 0-65535 (0: a free port)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def loopback(self) -> bool:
        return self.host == "localhost" or ipaddress.ip_address(self.host).is_loopback


def parse_metrics_address(value: object, where: str) -> MetricsAddress | None:
    """``metrics_address`` from a config file or command line: None when it is absent or ``""`` (endpoint
    off); ConfigError naming ``where`` and the expected form for anything else that is not HOST:PORT."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{where}: metrics_address must be a string {ADDRESS_HELP}, got {type(value).__name__}")
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"{where}: metrics_address {value!r} is not HOST:PORT; write it as {ADDRESS_HELP}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"{where}: metrics_address {value!r}: put an IPv6 address in brackets, e.g. \"[::1]:9464\"")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"{where}: metrics_address {value!r}: the port must be a number from 0 to 65535 "
                          "(0 picks a free one)")
    if host != "localhost":
        try:
            host = str(ipaddress.ip_address(host))
        except ValueError:
            raise ConfigError(f"{where}: metrics_address {value!r}: {host!r} is not an IP address; give "
                              f"{ADDRESS_HELP} (host names are not resolved, so the bind address is unambiguous)"
                              ) from None
    return MetricsAddress(host, int(port_text))


class MetricsServer:
    """``GET /metrics`` over HTTP for ``registry`` on ``address``, served by a daemon thread until ``close``.
    OSError with what to do when the address cannot be bound."""

    def __init__(self, registry: CollectorRegistry, address: MetricsAddress) -> None:
        try:
            self._httpd, self._thread = start_http_server(address.port, addr=address.host, registry=registry)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot open the metrics endpoint on {address} ({exc.strerror}); choose "
                                     "another metrics_address or stop what is using that port") from None
        host, port = self._httpd.server_address[:2]
        self.address = MetricsAddress(str(host), int(port))
        self.loopback = address.loopback

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def publish(self, path: Path) -> None:
        """Write the bound address to ``path`` (JSON ``{"address", "pid"}``), e.g. for a port picked at random."""
        write_atomically(path, json.dumps({"address": str(self.address), "pid": os.getpid()}).encode(), mode=0o644)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


class TaskSeries:
    """Keeps the ``task_id`` label bounded. Task-labelled series are made through :meth:`labels`, which
    remembers them per task; when a task ends (:meth:`ended`) its series stay visible until ``keep_ended`` later
    tasks have ended, then they are removed. So a registry holds the series of the running tasks plus those of
    the last ``keep_ended`` ended tasks: at most (running + keep_ended) x (label combinations per task)."""

    def __init__(self, keep_ended: int = 20) -> None:
        self.keep_ended = keep_ended
        self._series: dict[str, set[tuple[MetricWrapperBase, tuple[str, ...]]]] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def labels(self, metric: MetricWrapperBase, task_id: str, *more: str):
        """``metric``'s child for (``task_id``, ``*more``): ``task_id`` is the metric's first label."""
        values = (task_id, *more)
        with self._lock:
            self._series.setdefault(task_id, set()).add((metric, values))
            return metric.labels(*values)

    def ended(self, task_id: str) -> None:
        with self._lock:
            self._ended[task_id] = None
            self._ended.move_to_end(task_id)
            while len(self._ended) > self.keep_ended:
                old, _ = self._ended.popitem(last=False)
                for metric, values in self._series.pop(old, ()):
                    try:
                        metric.remove(*values)
                    except KeyError:
                        pass

    def tracked(self) -> set[str]:
        """Task ids that carry labelled series now."""
        with self._lock:
            return set(self._series)
