"""What every request to the dashboard must pass: the per-launch token and the Host check.

The dashboard reads tasks with its user's certificate, so whoever can talk to its port reads what that user
reads. Two checks keep it to the user who started it:

- **token**: a random 256-bit token made at launch (never stored; printed once inside the page's URL, like
  Jupyter's) must come with every request, as ``?token=...`` or the ``X-Fedclinic-Token`` header, compared in
  constant time. Another local user can connect to a loopback port, but without the token gets a 403.
- **Host**: the ``Host`` header must name this server (a loopback name or address with its port, or the bound
  address, or a name given with ``--allowed-host``). A web page from elsewhere that rebinds its DNS name to
  127.0.0.1 (DNS rebinding) sends its own name as Host, and is refused before the token is even looked at.
"""

from __future__ import annotations

import hmac
import secrets
from typing import Iterable, Mapping

TOKEN_HEADER = "x-fedclinic-token"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def new_token() -> str:
    """A fresh URL-safe token of 32 random bytes."""
    return secrets.token_urlsafe(32)


class RequestGuard:
    """Checks a request's token and Host header; ``port`` is the port the server listens on."""

    def __init__(self, token: str, port: int, *, bound_host: str = "127.0.0.1",
                 allowed_hosts: Iterable[str] = ()) -> None:
        if len(token) < 16:
            raise ValueError("the dashboard token must be at least 16 characters")
        self.token = token
        names = {*LOOPBACK_NAMES, *(h.lower() for h in allowed_hosts)}
        bound = bound_host.lower()
        names.add(f"[{bound}]" if ":" in bound and not bound.startswith("[") else bound)
        # a browser leaves the port out of Host only when it is the scheme's default
        self._hosts = frozenset({f"{n}:{port}" for n in names} | (names if port in (80, 443) else set()))

    def refusal(self, headers: Mapping[str, str], query: Mapping[str, str]) -> tuple[int, str] | None:
        """None when the request may be answered, else (HTTP status, why)."""
        host = headers.get("host", "").strip().lower()
        if host not in self._hosts:
            return 403, (f"Host {host!r} is not this dashboard's address; open the URL `fedclinic dashboard` "
                         "printed (names other than loopback need --allowed-host)")
        given = headers.get(TOKEN_HEADER) or query.get("token") or ""
        if not hmac.compare_digest(given.encode(), self.token.encode()):
            return 403, ("missing or wrong token: open the URL `fedclinic dashboard` printed when it started "
                         "(it ends with ?token=...)")
        return None
