"""``hospital-agent``: run the site agent, or check its configuration."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile

from fedclinic import logs
from fedclinic.errors import FedclinicError


def check_config(path: str) -> list[str]:
    """Everything wrong with an agent configuration, each with what to do; [] when all is well."""
    from hospital_agent.config import AgentConfig

    try:
        config = AgentConfig.load(path)
    except FedclinicError as exc:
        return [str(exc)]
    problems: list[str] = []
    try:
        from fedclinic.pki import check_own_certificate

        ident = check_own_certificate(config.tls.cert, config.tls.key, config.tls.ca, expected_role="agent")
        print(f"certificate: site {ident.name!r}, valid until {ident.not_after:%Y-%m-%d %H:%M} UTC")
    except FedclinicError as exc:
        problems.append(str(exc))
    try:
        config.work_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=config.work_dir):
            pass
    except OSError as exc:
        problems.append(f"work_dir {config.work_dir} is not writable ({exc.strerror}); create it and give the "
                        "agent's user write access")
    for name, entry in config.datasets.items():
        for label, p in (("path", entry.path), ("eval_path", entry.eval_path)):
            if p is None:
                continue
            if not p.is_file():
                problems.append(f"dataset {name!r}: {label} {p} does not exist")
            elif not os.access(p, os.R_OK):
                problems.append(f"dataset {name!r}: {label} {p} is not readable by this user")
        if name not in config.policy.allowed_datasets:
            print(f"note: dataset {name!r} is registered but the policy does not allow tasks on it")
    if not config.datasets:
        problems.append("no [datasets.NAME] registered: tasks will have nothing to train on")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hospital-agent", description="fedclinic hospital agent")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="connect to the aggregator and work until SIGTERM/SIGINT")
    run.add_argument("--config", required=True, help="path to agent.toml")
    chk = sub.add_parser("check-config", help="validate configuration, certificates and datasets")
    chk.add_argument("--config", required=True)
    args = parser.parse_args(argv)

    if args.command == "check-config":
        problems = check_config(args.config)
        for p in problems:
            print(f"problem: {p}", file=sys.stderr)
        print("configuration OK" if not problems else f"{len(problems)} problem(s) found")
        return 0 if not problems else 1

    from hospital_agent.config import AgentConfig
    from hospital_agent.worker import Agent

    try:
        config = AgentConfig.load(args.config)
        logs.configure(config.log_level)
        agent = Agent(config)
    except FedclinicError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    signal.signal(signal.SIGINT, lambda *_: agent.stop())
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
