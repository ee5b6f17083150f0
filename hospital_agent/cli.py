"""``hospital-agent``: run the site agent, or check its configuration."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile

import structlog

from fedclinic.runtime import logs
from fedclinic.errors import FedclinicError
from hospital_agent.config import AgentConfig
from fedclinic.pki import check_own_certificate
from hospital_agent.privacy_ledger import PrivacyLedger
from fedclinic.runtime.audit_log import AuditLog
from hospital_agent.tasks_cli import add_commands as add_task_commands
from hospital_agent.verify_cli import add_verify_command, run_verify
from hospital_agent.worker import Agent
from fedclinic.runtime.metrics_endpoint import MetricsServer
from hospital_agent.install import install_service
from hospital_agent.site_model import export_site_model
from hospital_agent.tasks_cli import run as run_tasks
from hospital_agent.torch_threads import apply_torch_threads
from hospital_agent.warm_start import preload_training_stack

log = structlog.get_logger("fedclinic.agent")

#: WORK_DIR/metrics.addr: the metrics endpoint's bound address (JSON), e.g. when metrics_address asks for port 0
METRICS_ADDRESS_FILE = "metrics.addr"


def check_config(path: str) -> list[str]:
    """Everything wrong with an agent configuration, each with what to do; [] when all is well."""
    try:
        config = AgentConfig.load(path)
    except FedclinicError as exc:
        return [str(exc)]
    problems: list[str] = []
    try:
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
        if entry.source is not None:
            problems += check_source(name, entry.source)
            if name not in config.policy.allowed_datasets:
                print(f"note: dataset {name!r} is registered but the policy does not allow tasks on it")
            continue
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
    if config.devices is not None:  # a multi-device site: the GPUs it names must be visible here
        from fedclinic.federation.distributed_round import resolve_devices  # torch: only when devices is set

        try:
            print(f"devices: {', '.join(resolve_devices(config.devices))}")
        except FedclinicError as exc:
            problems.append(str(exc))
    return problems


def check_source(name: str, source) -> list[str]:
    """Check one data source (reachable, read-only, columns present, row counts: DataSource.check), print what
    it found and return its problems, each prefixed with the dataset and saying what to fix."""
    report = source.check()
    print(f"dataset {name!r}: {source.kind} source")
    for fact in report.facts:
        print(f"  ok: {fact}")
    for note in report.notes:
        print(f"  note: {note}")
    return [f"dataset {name!r}: {p}" for p in report.problems]


def privacy_status(config_path: str) -> int:
    """Print the privacy ledger: per dataset its budget, what has left the site, what running tasks may still
    spend; per task planned vs spent epsilon and the rounds charged. Reads the ledger only (no network)."""

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
                  f"(delta {t.delta:.1e}) per {t.unit} over {t.rounds_charged} round(s), {state}")
    return 0


def privacy_finish(config_path: str, task_id: str) -> int:
    """Release a task's unspent privacy reservation by hand (it completed without this site in its last round,
    or ended while the agent was offline): the ledger keeps what it spent and charges it no more (a later
    round of it would be withheld and declined). Audited; no network."""
    import getpass


    try:
        config = AgentConfig.load(config_path)
    except FedclinicError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    datasets = PrivacyLedger(config.work_dir / "privacy-ledger.sqlite").finish_task(task_id)
    if not datasets:
        print(f"error: task {task_id} holds no running reservation in the privacy ledger (finished already, or "
              "never admitted here); see `hospital-agent privacy status`", file=sys.stderr)
        return 1
    by = f"site-admin:{getpass.getuser()}"
    with AuditLog(config.work_dir / "audit.jsonl", on_torn_tail="quarantine") as audit:
        audit.append("privacy.reservation_released", actor=by, task_id=task_id, datasets=datasets,
                     reason="finished by the site admin")
    print(f"task {task_id} finished on {', '.join(datasets)}: its unspent reservation is released; it keeps what "
          "it spent and is charged no more")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``hospital-agent`` command line: every subcommand with its one-line help."""
    parser = argparse.ArgumentParser(prog="hospital-agent", description="fedclinic hospital agent")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = sub.add_parser("run", help="connect to the aggregator and work until SIGTERM/SIGINT (SIGHUP: reload certificates)")
    run.add_argument("--config", required=True, help="path to agent.toml")
    run.add_argument("--metrics-address", metavar="HOST:PORT",
                     help='Prometheus endpoint, overriding metrics_address of the config ("" turns it off)')
    chk = sub.add_parser("check-config", help="validate configuration, certificates and datasets")
    chk.add_argument("--config", required=True)
    priv = sub.add_parser("privacy", help="the site's differential-privacy budgets and spend")
    priv_sub = priv.add_subparsers(dest="privacy_command", required=True)
    pst = priv_sub.add_parser("status", help="budget, spent and committed epsilon per dataset, and per task")
    pst.add_argument("--config", required=True)
    pfin = priv_sub.add_parser("finish", help="release an ended task's unspent reservation (the agent was not told "
                                              "it ended); it is charged no more")
    pfin.add_argument("task_id")
    pfin.add_argument("--config", required=True)
    model = sub.add_parser("model", help="this site's own model of a task (global model + its private modules)")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    mexp = model_sub.add_parser("export", help="fetch the task's final (or newest) global model, put this site's "
                                               "private modules in it and write a package folder for "
                                               "`fedclinic export onnx` or serving")
    mexp.add_argument("task_id")
    mexp.add_argument("out_dir", help="a new (or empty) folder")
    mexp.add_argument("--config", required=True)

    add_task_commands(sub)
    add_verify_command(sub)
    ins = sub.add_parser("install-service", help="lay out the systemd service: user, directories, permissions, unit")
    ins.add_argument("--root", default="/", help="install under this prefix instead of / (staging, tests)")
    ins.add_argument("--dry-run", action="store_true", help="print what would be done, change nothing")
    ins.add_argument("--unit", help="the unit file to install (default: deploy/systemd/hospital-agent.service)")
    ins.add_argument("--site", default="SITE", help="site name used in the example agent.toml")
    ins.add_argument("--aggregator", default="aggregator.example.org:7443", help="for the example agent.toml")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    if args.command == "install-service":
        try:
            return install_service(args.root, unit=args.unit, dry_run=args.dry_run, site=args.site,
                                   aggregator=args.aggregator)
        except FedclinicError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    if args.command == "privacy":
        if args.privacy_command == "finish":
            return privacy_finish(args.config, args.task_id)
        return privacy_status(args.config)

    if args.command == "model":
        return export_site_model(args.config, args.task_id, args.out_dir)

    if args.command == "tasks":
        return run_tasks(args)

    if args.command == "verify":
        return run_verify(args)

    if args.command == "check-config":
        problems = check_config(args.config)
        for p in problems:
            print(f"problem: {p}", file=sys.stderr)
        print("configuration OK" if not problems else f"{len(problems)} problem(s) found")
        return 0 if not problems else 1


    try:
        config = AgentConfig.load(args.config)
        if args.metrics_address is not None:
            config = config.with_metrics_address(args.metrics_address, "--metrics-address")
        logs.configure(config.log_level)
        # glibc's mmap threshold is left dynamic here (the aggregator pins it): pinned at 128 KiB, every tensor a
        # training step allocates became a fresh mapping with its page faults (the overhead bench's training 2x slower)
        apply_torch_threads(config.torch_threads)  # before any training: the inter-op pool is sized only once
        if config.preload_training_stack:
            preload_training_stack()  # before connecting, in this thread (not beside a round's own imports)
        agent = Agent(config)
        endpoint = (MetricsServer(agent.metrics.registry, config.metrics_address)
                    if config.metrics_address is not None else None)
    except (FedclinicError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if endpoint is not None:
        endpoint.publish(config.work_dir / METRICS_ADDRESS_FILE)
        log.info("metrics endpoint listening", url=endpoint.url,
                 **({} if endpoint.loopback else
                    {"warning": "reachable from other machines: limit who may connect (firewall, NetworkPolicy)"}))
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    signal.signal(signal.SIGINT, lambda *_: agent.stop())
    signal.signal(signal.SIGHUP, lambda *_: agent.reload_requested.set())  # re-read the certificate files now
    try:
        agent.run()
    finally:
        if endpoint is not None:
            endpoint.close()
            (config.work_dir / METRICS_ADDRESS_FILE).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
