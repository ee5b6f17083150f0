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


def privacy_status(config_path: str) -> int:
    """Print the privacy ledger: per dataset its budget, what has left the site, what running tasks may still
    spend; per task planned vs spent epsilon and the rounds charged. Reads the ledger only (no network)."""
    from hospital_agent.config import AgentConfig
    from hospital_agent.privacy_ledger import PrivacyLedger

    try:
        config = AgentConfig.load(config_path)
    except FedclinicError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    ledger = PrivacyLedger(config.work_dir / "privacy-ledger.sqlite")
    for entry in config.datasets.values():
        if entry.privacy_epsilon is not None and entry.privacy_delta is not None:
            ledger.set_budget(entry.name, entry.privacy_epsilon, entry.privacy_delta)
    rows = ledger.status()
    if not rows:
        print("no dataset has a privacy budget; set privacy_epsilon and privacy_delta under [datasets.NAME]")
        return 0
    print(f"{'dataset':<20} {'budget eps':>10} {'delta':>8} {'spent':>8} {'committed':>10} {'left':>8}")
    for d in rows:
        budget = d.budget
        print(f"{d.dataset:<20} {budget.epsilon if budget else float('nan'):>10.3f} "
              f"{budget.delta if budget else float('nan'):>8.1e} {d.spent_epsilon:>8.3f} {d.committed_epsilon:>10.3f} "
              f"{d.remaining_epsilon if d.remaining_epsilon is not None else float('nan'):>8.3f}")
        for t in d.tasks:
            state = "finished" if t.finished else "running"
            print(f"  task {t.task_id}: planned {t.planned_epsilon:.3f}, spent {t.spent_epsilon:.3f} "
                  f"(delta {t.delta:.1e}) over {t.rounds_charged} round(s), {state}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hospital-agent", description="fedclinic hospital agent")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="connect to the aggregator and work until SIGTERM/SIGINT")
    run.add_argument("--config", required=True, help="path to agent.toml")
    chk = sub.add_parser("check-config", help="validate configuration, certificates and datasets")
    chk.add_argument("--config", required=True)
    priv = sub.add_parser("privacy", help="the site's differential-privacy budgets and spend")
    priv_sub = priv.add_subparsers(dest="privacy_command", required=True)
    pst = priv_sub.add_parser("status", help="budget, spent and committed epsilon per dataset, and per task")
    pst.add_argument("--config", required=True)
    from hospital_agent.tasks_cli import add_commands as add_task_commands

    add_task_commands(sub)
    ins = sub.add_parser("install-service", help="lay out the systemd service: user, directories, permissions, unit")
    ins.add_argument("--root", default="/", help="install under this prefix instead of / (staging, tests)")
    ins.add_argument("--dry-run", action="store_true", help="print what would be done, change nothing")
    ins.add_argument("--unit", help="the unit file to install (default: deploy/systemd/hospital-agent.service)")
    ins.add_argument("--site", default="SITE", help="site name used in the example agent.toml")
    ins.add_argument("--aggregator", default="aggregator.example.org:7443", help="for the example agent.toml")
    args = parser.parse_args(argv)

    if args.command == "install-service":
        from hospital_agent.install import install_service

        try:
            return install_service(args.root, unit=args.unit, dry_run=args.dry_run, site=args.site,
                                   aggregator=args.aggregator)
        except FedclinicError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    if args.command == "privacy":
        return privacy_status(args.config)

    if args.command == "tasks":
        from hospital_agent.tasks_cli import run as run_tasks

        return run_tasks(args)

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
