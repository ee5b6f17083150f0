"""``hospital-agent verify TASK --config agent.toml [--json]``: the site's own check of a task's rounds.

Reads the task's public records with the site's certificate (``AgentService.GetTaskRecords``: a task this site was
assigned to) and runs :func:`fedclinic.verification.verifier.verify_task` without recomputing aggregates: every
statement signed by the site it names, every site of a round given the same model (a split view names who got
which), the chain of models, the final model. Exit 0 when every check passes, 1 when one fails, 2 when the
records cannot be read.
"""

from __future__ import annotations

import json
import sys

from fedclinic.errors import FedclinicError
from fedclinic.verification.site_records import SiteRecords
from fedclinic.verification.verifier import verify_task

from hospital_agent.config import AgentConfig


def add_verify_command(sub) -> None:
    p = sub.add_parser("verify", help="check a task's rounds against the sites' signed statements (split view, "
                                      "chain of models)")
    p.add_argument("task_id")
    p.add_argument("--config", required=True)
    p.add_argument("--json", action="store_true", help="the verdict as JSON")


def run_verify(args) -> int:
    try:
        config = AgentConfig.load(args.config)
        with SiteRecords(config.aggregator, config.tls, server_name=config.server_name) as records:
            verdict = verify_task(records, args.task_id, str(config.tls.ca), recompute=False)
    except FedclinicError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(verdict.to_json(), indent=2) if args.json else verdict.text())
    return 0 if verdict.ok else 1


__all__ = ["add_verify_command", "run_verify"]
