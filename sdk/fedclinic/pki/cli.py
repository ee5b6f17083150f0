"""The ``fedclinic pki`` commands (:func:`add_pki_commands`)."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import Any

from cryptography import x509

from fedclinic.errors import FedclinicError

from fedclinic.pki.common import CA_KEY, CRL_DAYS, CRL_FILE, ROLES, _REASONS, _fmt, _load_cert
from fedclinic.pki.authority import init_ca
from fedclinic.pki.leaf import issue, make_csr
from fedclinic.pki.rotation import install_credentials, renew
from fedclinic.pki.revocation import list_certs, refresh_crl, revoke
from fedclinic.pki.identity import _identity


def _cmd_init_ca(args: argparse.Namespace) -> int:
    ca_crt = init_ca(args.ca_dir, common_name=args.name, days=args.days)
    cert = x509.load_pem_x509_certificate(ca_crt.read_bytes())
    print(f"created CA {args.name!r} in {args.ca_dir} (valid until {_fmt(cert.not_valid_after_utc)})")
    print(f"  {Path(args.ca_dir) / CA_KEY}  (private, mode 0600: keep this folder offline and backed up)")
    print(f"  {ca_crt}  (give this to every participant)")
    print(f"  {Path(args.ca_dir) / CRL_FILE}  (revocation list for the aggregator)")
    return 0


def _cmd_issue(args: argparse.Namespace) -> int:
    res = issue(args.ca_dir, role=args.role, name=args.name, out_dir=args.out, days=args.days,
                dns=args.dns or (), ips=args.ip or (), csr_path=args.csr)
    print(f"issued {res.role} certificate {res.name!r}, serial {res.serial_hex}, valid until {_fmt(res.not_after)}")
    print(f"  certificate: {res.cert_path}")
    if res.key_path is not None:
        print(f"  private key: {res.key_path}  (mode 0600; move it only over a secure channel)")
    print(f"  CA:          {res.ca_path}")
    return 0


def _cmd_request(args: argparse.Namespace) -> int:
    key_path, csr_path = make_csr(role=args.role, name=args.name, out_dir=args.out, dns=args.dns or (),
                                  ips=args.ip or ())
    print(f"made a private key and a certificate request for {args.role} {args.name!r}")
    print(f"  private key: {key_path}  (mode 0600; it stays here)")
    print(f"  request:     {csr_path}")
    print(f"send {csr_path.name} to the fedclinic administrator, who runs: fedclinic pki issue --ca-dir CA_DIR "
          f"--role {args.role} --name {args.name} --csr {csr_path.name} --out DIR")
    return 0


def _cmd_revoke(args: argparse.Namespace) -> int:
    serial = revoke(args.ca_dir, serial_hex=args.serial, cert_path=args.cert, reason=args.reason)
    print(f"revoked certificate {serial}; the revocation list {Path(args.ca_dir) / CRL_FILE} was rewritten: "
          "copy it to the aggregator (it reloads the file when it changes)")
    return 0


def _cmd_renew(args: argparse.Namespace) -> int:
    old = _identity(_load_cert(args.cert, "certificate", "give the certificate file the service uses")).serial_hex
    res = renew(args.ca_dir, cert_path=args.cert, key_path=args.key, days=args.days, revoke_old=args.revoke_old)
    print(f"renewed {res.role} certificate {res.name!r}: new serial {res.serial_hex}, valid until "
          f"{_fmt(res.not_after)}")
    print(f"  certificate: {res.cert_path}")
    print(f"  private key: {res.key_path}  (new key, made here, mode 0600)")
    print("a running aggregator or agent picks the new pair up by itself (or on SIGHUP); open connections keep "
          "the old certificate until they reconnect" + ("" if args.revoke_old else
          f". Revoke the old one once the service logged the reload: fedclinic pki revoke --ca-dir {args.ca_dir} "
          f"--serial {old} --reason superseded"))
    return 0


def _cmd_install(args: argparse.Namespace) -> int:
    ident = install_credentials(args.cert, args.key, args.ca, to_cert=args.to_cert, to_key=args.to_key,
                                expected_role=args.role)
    print(f"installed {ident.role} certificate {ident.name!r} (serial {ident.serial_hex}, valid until "
          f"{_fmt(ident.not_after)}) as {args.to_cert} with its key {args.to_key}")
    return 0


def _cmd_refresh_crl(args: argparse.Namespace) -> int:
    path = refresh_crl(args.ca_dir, days=args.days)
    print(f"re-signed {path} with the same revoked serials, next update in {args.days} days: copy it to the "
          "aggregator if it does not read it from the CA folder")
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    rows = list_certs(args.ca_dir)
    if not rows:
        print(f"no certificates issued yet by the CA in {args.ca_dir}")
        return 0
    header = ("NAME", "ROLE", "STATUS", "NOT AFTER", "SERIAL", "SHA256")
    table = [header] + [(r["name"], r["role"], r["status"], r["not_after"], r["serial"],
                         r["fingerprint_sha256"][:16]) for r in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())
    return 0


def _guard(handler: Any) -> Any:
    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        try:
            return int(handler(args))
        except FedclinicError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return run


def add_pki_commands(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register ``pki`` and its subcommands (init-ca, issue, request, renew, install, revoke, refresh-crl, list) on
    an argparse ``add_subparsers()`` object. Each subcommand sets ``func`` to a handler ``(args) -> int`` that prints a
    short summary and returns 0, or prints ``error: <message>`` to stderr and returns 2."""
    pki = subparsers.add_parser("pki", help="certificates: create a CA, issue, request, renew, install, revoke, list",
                                description="Manage the fedclinic certificate authority and certificates.")
    sub = pki.add_subparsers(dest="pki_command", metavar="COMMAND", required=True)

    p = sub.add_parser("init-ca", help="create a new CA folder (ca.key, ca.crt, crl.pem, issued.json)")
    p.add_argument("--ca-dir", required=True, type=Path, help="folder to create the CA in (keep it offline)")
    p.add_argument("--name", default="fedclinic CA", help="CA common name (default: %(default)s)")
    p.add_argument("--days", type=int, default=3650, help="validity in days (default: %(default)s)")
    p.set_defaults(func=_guard(_cmd_init_ca))

    def sans(q: argparse.ArgumentParser) -> None:
        q.add_argument("--dns", action="extend", nargs="+", default=[], metavar="NAME",
                       help="DNS name(s) to put in the certificate (the aggregator's host names)")
        q.add_argument("--ip", action="extend", nargs="+", default=[], metavar="IP",
                       help="IP address(es) to put in the certificate")

    p = sub.add_parser("issue", help="issue a certificate (new key, or from a --csr)")
    p.add_argument("--ca-dir", required=True, type=Path)
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--name", required=True, help="site or user name, e.g. site-a")
    p.add_argument("--out", required=True, type=Path, help="folder to write <name>.crt, <name>.key, ca.crt to")
    p.add_argument("--days", type=int, default=30, help="validity in days (default: %(default)s)")
    sans(p)
    p.add_argument("--csr", type=Path, default=None, help="sign this request instead of making a key")
    p.set_defaults(func=_guard(_cmd_issue))

    p = sub.add_parser("request", help="make a private key and a certificate request (CSR) here")
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--name", required=True)
    p.add_argument("--out", required=True, type=Path, help="folder to write <name>.key and <name>.csr to")
    sans(p)
    p.set_defaults(func=_guard(_cmd_request))

    p = sub.add_parser("revoke", help="revoke a certificate and rewrite the CA's crl.pem")
    p.add_argument("--ca-dir", required=True, type=Path)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--serial", help="serial number in hex, as `pki list` shows it")
    which.add_argument("--cert", type=Path, help="the certificate file")
    p.add_argument("--reason", default="unspecified", help=f"one of: {', '.join(_REASONS)}")
    p.set_defaults(func=_guard(_cmd_revoke))

    p = sub.add_parser("renew", help="renew a certificate in place: new key here, same identity, new certificate")
    p.add_argument("--ca-dir", required=True, type=Path)
    p.add_argument("--cert", required=True, type=Path, help="the certificate file the service uses")
    p.add_argument("--key", type=Path, default=None, help="its key file (default: the certificate path with .key)")
    p.add_argument("--days", type=int, default=30, help="validity in days (default: %(default)s)")
    p.add_argument("--revoke-old", action="store_true", help="revoke the old certificate (reason superseded)")
    p.set_defaults(func=_guard(_cmd_renew))

    p = sub.add_parser("install", help="check a new certificate and key, then put them in place of the live ones")
    p.add_argument("--cert", required=True, type=Path, help="the new certificate (from `pki issue --csr`)")
    p.add_argument("--key", required=True, type=Path, help="its key (from `pki request`, made on this machine)")
    p.add_argument("--ca", required=True, type=Path, help="the CA certificate")
    p.add_argument("--to-cert", required=True, type=Path, help="the certificate file the service uses")
    p.add_argument("--to-key", required=True, type=Path, help="the key file the service uses")
    p.add_argument("--role", choices=ROLES, default=None, help="refuse a certificate for another role")
    p.set_defaults(func=_guard(_cmd_install))

    p = sub.add_parser("refresh-crl", help="re-sign crl.pem with a new next-update time (run weekly)")
    p.add_argument("--ca-dir", required=True, type=Path)
    p.add_argument("--days", type=int, default=CRL_DAYS, help="next update in this many days (default: %(default)s)")
    p.set_defaults(func=_guard(_cmd_refresh_crl))

    p = sub.add_parser("list", help="list issued certificates and their status")
    p.add_argument("--ca-dir", required=True, type=Path)
    p.set_defaults(func=_guard(_cmd_list))
