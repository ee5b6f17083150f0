"""``fedclinic-aggregator``: run the aggregator service; back up, verify and restore its state."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedclinic.runtime import logs
from fedclinic.errors import FedclinicError
from aggregator_service.config import AggregatorConfig
from aggregator_service.backup import create_backup, refuse_postgresql, restore_backup, signed_by, verify_backup
from aggregator_service.server import Aggregator
from aggregator_service.preflight import check_config


def _state_dir(args: argparse.Namespace) -> Path:
    if args.state_dir is not None:
        return Path(args.state_dir)

    return AggregatorConfig.load(args.config).state_dir


def _backup(args: argparse.Namespace) -> int:
    signer = None
    if args.config is not None:  # the aggregator's own TLS pair signs the manifest
        config = AggregatorConfig.load(args.config)
        refuse_postgresql(config.state, args.config)
        signer = (config.tls.cert, config.tls.key)
    m = create_backup(_state_dir(args), args.dest, signer=signer)
    how = "signed by the aggregator" if signer else "not signed (--state-dir: no key; back up with --config to sign)"
    print(f"backup written to {args.dest}: {len(m.files)} files, {m.nbytes} bytes, schema version "
          f"{m.schema_version}, taken {m.created}; verified; {how}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    m = verify_backup(args.src)
    signed = (f"; signed by the aggregator {signed_by(args.src, args.ca)!r} (certificate from {args.ca})"
              if args.ca else "; signature not checked (give --ca CA_CERT to require the aggregator's signature)")
    print(f"backup {args.src} is complete and intact: {len(m.files)} files, {m.nbytes} bytes, schema version "
          f"{m.schema_version}, taken {m.created} from {m.source_state_dir}{signed}")
    return 0


def _restore(args: argparse.Namespace) -> int:
    m = restore_backup(args.src, args.state_dir, ca=args.ca)
    print(f"restored {len(m.files)} files ({m.nbytes} bytes, taken {m.created}) into {args.state_dir}; point the "
          "aggregator's state_dir at it and start it")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``fedclinic-aggregator`` command line: every subcommand with its one-line help."""
    parser = argparse.ArgumentParser(prog="fedclinic-aggregator", description="fedclinic aggregator service")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    serve = sub.add_parser("serve", help="run the service until SIGTERM/SIGINT (SIGHUP: reload certificates, CRL)")
    serve.add_argument("--config", required=True, help="path to aggregator.toml")
    serve.add_argument("--metrics-address", metavar="HOST:PORT",
                       help='Prometheus endpoint, overriding metrics_address of the config ("" turns it off)')
    check = sub.add_parser("check-config", help="check aggregator.toml, certificates, CRL and state_dir; serve nothing")
    check.add_argument("--config", required=True, help="path to aggregator.toml")
    backup = sub.add_parser("backup", help="back up the state (online: the service may run) into a new folder DEST")
    where = backup.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", help="aggregator.toml (its state_dir is backed up)")
    where.add_argument("--state-dir", help="the state folder to back up")
    backup.add_argument("dest", help="a new or empty folder for the backup")
    verify = sub.add_parser("verify-backup", help="check a backup's manifest, file hashes and database")
    verify.add_argument("src", help="the backup folder")
    restore = sub.add_parser("restore", help="verify a backup and restore it into a new or empty state folder")
    restore.add_argument("src", help="the backup folder")
    restore.add_argument("state_dir", help="the new state folder (must not exist, or be empty)")
    for command in (verify, restore):
        command.add_argument("--ca", metavar="CA_CERT", help="the fedclinic CA certificate: also require the "
                             "aggregator's signature of the backup (backups taken with --config are signed)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        try:
            config = AggregatorConfig.load(args.config)
            if args.metrics_address is not None:
                config = config.with_metrics_address(args.metrics_address, "--metrics-address")
            logs.configure(config.log_level)
            Aggregator(config).serve_forever()
        except (FedclinicError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.command == "check-config":
        notes, problems = check_config(args.config)
        for note in notes:
            print(note)
        for problem in problems:
            print(f"problem: {problem}", file=sys.stderr)
        print("configuration OK" if not problems else f"{len(problems)} problem(s) found")
        return 0 if not problems else 1
    logs.configure("warning")
    handler = {"backup": _backup, "verify-backup": _verify, "restore": _restore}[args.command]
    try:
        return handler(args)
    except (FedclinicError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
