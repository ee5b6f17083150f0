"""The dashboard's server: where it may listen, and uvicorn serving :class:`~fedclinic.dashboard.app.DashboardApp`.

Binding rules (checked before anything listens; a ConfigError says what to do):

- the default is ``127.0.0.1``: only this machine can connect, and only with the launch token;
- a non-loopback address needs ``allow_remote`` (``--allow-remote``) **and** HTTPS (``--https-cert`` /
  ``--https-key``, e.g. a server certificate from ``fedclinic pki issue``): the token and the task data then never
  cross the network in clear; the token and the Host check stay on (``--allowed-host`` adds the names the
  browser will use for this machine).

The HTTP stack is the one of ``fedclinic serve`` (uvicorn with :class:`~fedclinic.serving.guarded_h11.
GuardedH11Protocol`, whose header deadline stops idle connections from holding the server); uvicorn's access log
is off, so the token in the page's URL is written nowhere but the one line printed at launch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any, Callable, Iterable

import uvicorn

from fedclinic.dashboard.app import DashboardApp
from fedclinic.dashboard.request_guard import RequestGuard, new_token
from fedclinic.errors import ConfigError
from fedclinic.serving.guarded_h11 import GuardedH11Protocol
from fedclinic.serving.http_server import UvicornServer, bind_listener, server_ssl_context
from fedclinic.serving.serve_command import is_loopback

#: open connections at most (a page polls over one or two)
MAX_CONNECTIONS = 64
GRACEFUL_STOP_S = 5


class _TlsFiles:
    def __init__(self, cert: str, key: str) -> None:
        self.cert, self.key, self.ca = Path(cert), Path(key), None


def check_binding(host: str, *, allow_remote: bool, https_cert: str | None, https_key: str | None) -> None:
    """ConfigError unless ``host`` may be bound with these settings (module doc)."""
    if bool(https_cert) != bool(https_key):
        raise ConfigError("give both --https-cert and --https-key, or neither")
    if is_loopback(host):
        return
    if not allow_remote:
        raise ConfigError(f"refusing to listen on {host}, which is not a loopback address: the dashboard shows "
                          "your tasks to whoever has its URL. Keep the default 127.0.0.1 (and reach it over an SSH "
                          "tunnel), or pass --allow-remote with --https-cert/--https-key")
    if not https_cert:
        raise ConfigError(f"--allow-remote on {host} needs HTTPS: give --https-cert and --https-key (a server "
                          "certificate for this machine's name, e.g. from `fedclinic pki issue`) so the token and "
                          "the task data do not cross the network in clear")


class DashboardServer:
    """One dashboard: the socket is bound at construction (:attr:`port` and :attr:`url` are known at once),
    :meth:`serve` runs until SIGTERM/SIGINT or :meth:`stop`."""

    def __init__(self, client: Any, host: str = "127.0.0.1", port: int = 8765, *, identity: str = "",
                 allow_remote: bool = False, https_cert: str | None = None, https_key: str | None = None,
                 allowed_hosts: Iterable[str] = (), poll_s: float = 2.0, token: str | None = None) -> None:
        check_binding(host, allow_remote=allow_remote, https_cert=https_cert, https_key=https_key)
        if not 0.2 <= poll_s <= 3600:
            raise ConfigError(f"--poll must be between 0.2 and 3600 seconds, got {poll_s:g}")
        ssl_context = server_ssl_context(_TlsFiles(https_cert, https_key), client_certificates=False) if https_cert \
            else None
        self.host = host
        self._socket = bind_listener(host, port)
        self.port: int = self._socket.getsockname()[1]
        self.token = token or new_token()
        self.guard = RequestGuard(self.token, self.port, bound_host=host, allowed_hosts=allowed_hosts)
        self.app = DashboardApp(client, self.guard, identity=identity, poll_s=poll_s)
        self.scheme = "https" if ssl_context else "http"
        config = uvicorn.Config(self.app.asgi, http=GuardedH11Protocol.with_header_timeout(10.0), loop="asyncio",
                                lifespan="off", ws="none", interface="asgi3", limit_concurrency=MAX_CONNECTIONS,
                                timeout_keep_alive=5, timeout_graceful_shutdown=GRACEFUL_STOP_S, log_config=None,
                                access_log=False, server_header=False, proxy_headers=False,
                                ssl_context_factory=(lambda _c, _d: ssl_context) if ssl_context else None)
        self._started = threading.Event()
        self._on_ready: Callable[[str], None] | None = None
        self._uvicorn = UvicornServer(config, self._now_ready)

    @property
    def url(self) -> str:
        """The page's address with the token: the one thing to open (and to keep to oneself)."""
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{shown}:{self.port}/?token={self.token}"

    def serve(self, on_ready: Callable[[str], None] | None = None) -> None:
        """Serve until stopped; ``on_ready(url)`` once it accepts requests."""
        logging.getLogger("uvicorn.error").setLevel(logging.ERROR)
        self._on_ready = on_ready
        try:
            asyncio.run(self._uvicorn.serve(sockets=[self._socket]))
        finally:
            self._socket.close()

    def _now_ready(self) -> None:
        self._started.set()
        if self._on_ready is not None:
            self._on_ready(self.url)

    def start_in_thread(self, timeout: float = 30.0) -> threading.Thread:
        """:meth:`serve` in a daemon thread, returned once it accepts requests (for scripts and embedding)."""
        thread = threading.Thread(target=self.serve, name="fedclinic-dashboard", daemon=True)
        thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError(f"the dashboard did not start within {timeout} s")
        return thread

    def stop(self) -> None:
        """Ask :meth:`serve` to stop (returns at once)."""
        self._uvicorn.should_exit = True
