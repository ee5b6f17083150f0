"""``fedclinic dashboard``: its arguments and what it runs (the server loads only when the command runs).

The connection settings are those of the ``task`` commands (``--address/--cert/--key/--ca`` or
``FEDCLINIC_*``), added by :mod:`fedclinic.cli`, which hands this module a connected client.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_dashboard_arguments(p: argparse.ArgumentParser) -> None:
    """The dashboard's own flags (the connection flags are the ``task`` commands')."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only; any other "
                                                      "needs --allow-remote and HTTPS)")
    p.add_argument("--port", type=int, default=8765, help="port (default %(default)s; 0 = any free port)")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between the page's updates (default %(default)s)")
    sec = p.add_argument_group("listening beyond this machine (off by default)")
    sec.add_argument("--allow-remote", action="store_true",
                     help="allow a non-loopback --host; requires --https-cert/--https-key. The launch token is "
                          "still required on every request")
    sec.add_argument("--https-cert", help="serve HTTPS with this server certificate (PEM)")
    sec.add_argument("--https-key", help="its private key (PEM)")
    sec.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                     help="a host name the browser uses for this machine (the Host header is checked against "
                          "DNS rebinding; loopback names and --host are always allowed); repeatable")


def run_dashboard(args: Any, client: Any) -> int:
    """Serve the dashboard over ``client`` until Ctrl-C/SIGTERM; prints the page's URL (with its token) once."""
    # lazy: uvicorn and starlette load only for this command
    from fedclinic.dashboard.server import DashboardServer
    from fedclinic.pki import identity_from_pem

    ident = identity_from_pem(Path(args.cert).read_bytes())
    server = DashboardServer(client, args.host, args.port, identity=f"{ident.name} ({ident.role})",
                             allow_remote=args.allow_remote, https_cert=args.https_cert, https_key=args.https_key,
                             allowed_hosts=args.allowed_host, poll_s=args.poll)

    def ready(url: str) -> None:
        print(f"fedclinic dashboard (read-only) for {ident.role} {ident.name!r} on aggregator {client.address}:\n"
              f"    {url}\nopen this URL in a browser; the token in it is the only key to the page, keep it to "
              "yourself. Ctrl-C stops the dashboard.", flush=True)

    server.serve(ready)
    print("dashboard stopped", file=sys.stderr, flush=True)
    return 0
