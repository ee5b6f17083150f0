"""``fedclinic-aggregator``: run the aggregator service."""

from __future__ import annotations

import argparse
import sys

from fedclinic import logs
from fedclinic.errors import FedclinicError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fedclinic-aggregator", description="fedclinic aggregator service")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the service until SIGTERM/SIGINT")
    serve.add_argument("--config", required=True, help="path to aggregator.toml")
    args = parser.parse_args(argv)
    if args.command == "serve":
        from aggregator_service.config import AggregatorConfig
        from aggregator_service.server import Aggregator

        try:
            config = AggregatorConfig.load(args.config)
            logs.configure(config.log_level)
            Aggregator(config).serve_forever()
        except (FedclinicError, OSError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
