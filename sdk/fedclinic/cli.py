"""``fedclinic``: the data scientist's and administrator's command line.

    fedclinic pki init-ca | issue | request | renew | install | revoke | refresh-crl | list
    fedclinic task submit task.toml | status ID | list | watch ID [--eval TEST] | cancel ID | download ID OUT | verify ID [--json]
    fedclinic demo [--report report.json]
    fedclinic simulate task.toml --site NAME=TRAIN[:EVAL] ... [--eval TEST] [--json FILE]
    fedclinic privacy plan --epsilon E --rows N [--rows N ...] --rounds R [--model FOLDER --labels K]
    fedclinic audit verify FILE [--expect-head SEQ:HASH]
    fedclinic dashboard [--port P]    (a read-only web page of your tasks; loopback, token in the URL)

Connection settings for ``task`` commands come from flags or the environment:
FEDCLINIC_ADDRESS, FEDCLINIC_CERT, FEDCLINIC_KEY, FEDCLINIC_CA.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from fedclinic.dashboard.command import add_dashboard_arguments, run_dashboard
from fedclinic.errors import FedclinicError
from fedclinic.export.onnx_export import add_export_commands
from fedclinic.federation.demo import add_demo_arguments, run_demo
from fedclinic.federation.experiment import add_experiment_commands
from fedclinic.federation.simulate_command import add_simulate_command
from fedclinic.models.mean_pooling import pooling_notice
from fedclinic.pki import add_pki_commands
from fedclinic.privacy.plan_command import add_privacy_commands
from fedclinic.runtime.audit_log import add_audit_commands
from fedclinic.runtime.proto_json import message_to_dict, message_to_json
from fedclinic.serving.serve_command import add_serve_command
from fedclinic.spec.task import Task


def _connection_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=os.environ.get("FEDCLINIC_ADDRESS"), help="aggregator host:port; a hot-standby pair as a:7443,b:7443 (tried in turn)")
    p.add_argument("--cert", default=os.environ.get("FEDCLINIC_CERT"), help="your certificate (PEM)")
    p.add_argument("--key", default=os.environ.get("FEDCLINIC_KEY"), help="your private key (PEM)")
    p.add_argument("--ca", default=os.environ.get("FEDCLINIC_CA"), help="the fedclinic CA certificate (PEM)")


def _client(args):
    # lazy: grpc loads only for the task subcommands (every other command starts without it)
    from fedclinic.client import connect

    missing = [n for n in ("address", "cert", "key", "ca") if not getattr(args, n)]
    if missing:
        raise FedclinicError(f"missing connection setting(s) {missing}: pass --{missing[0]} or set "
                             f"FEDCLINIC_{missing[0].upper()}")
    return connect(args.address, cert=args.cert, key=args.key, ca=args.ca)


def _print_status(st, as_json: bool) -> None:
    # lazy: grpc loads only for the task subcommands (every other command starts without it)
    from fedclinic.client import evaluated_model, held_sites, state_name, waiting_sites

    if as_json:  # 64-bit fields (byte counts, times, the seed) as numbers, not json_format's strings
        print(message_to_json(st))
        return
    print(f"{st.task_id}  {st.spec.name!r}  {state_name(st.state)}  round {st.current_round}/"
          f"{st.spec.rounds.num_rounds}  owner {st.owner}" + ("" if st.signed else "  UNSIGNED"))
    if not st.signed:
        print("  unsigned: submitted without the owner's signature; sites that require signed tasks (the default) "
              "decline it. Submit it with the fedclinic SDK, which signs it")
    if st.error:
        print(f"  error: {st.error}")
    for r in st.rounds:
        # per-label figures (eval_f1/<label>, eval_auc/<label>) stay in --json and the model card
        per_label = sum(1 for k in r.metrics if "/" in k)
        metrics = " ".join(f"{k}={v:.4g}" for k, v in sorted(r.metrics.items()) if "/" not in k)
        if per_label:
            metrics += f" (+{per_label} per-label: --json)"
        of = (f" (eval_*: {evaluated_model(r.round)}, the one the round started from, evaluated by {r.eval_sites} "
              "site(s))" if r.eval_sites else "")
        print(f"  round {r.round}: {len(r.reports)}/{r.sites_target} sites, up {r.uplink_bytes} B, "
              f"down {r.downlink_bytes} B {metrics}{of}")
        for d in r.declined:
            print(f"    declined: {d}")
    if st.HasField("results"):
        from fedclinic.client import results_lines  # with the client, as above

        for line in results_lines(st):
            print(line)
    waiting = waiting_sites(st)
    held = held_sites(st)
    for site in waiting:  # who to ask when a round stalls, and why when the site said so
        if site in held:
            print(f"    held by {site}: {held[site]}")
    others = [s for s in waiting if s not in held]
    if others:
        print(f"    waiting for: {', '.join(others)} (no update or refusal yet: still training or offline)")
    if st.site_statistics:  # a statistics task: the sites' values as a table, with what to act on
        # lazy: the statistics modules (~0.2 s of imports) load only for a statistics task's status
        from fedclinic.evaluation.statistics_table import statistics_report

        print(statistics_report({s: dict(v.values) for s, v in st.site_statistics.items()},
                                dict(st.pooled_statistics), list(st.spec.labels), multi_label=st.spec.multi_label))


def pooling_notice_for(task: Task) -> str | None:
    """The notice ``task submit`` prints when a text-classification transformer task's model folder declares
    another pooling (its sentence-transformers config) than the task chose (``[model_config] pooling``, default
    ``cls``); None otherwise."""
    if (task.family, task.architecture) != ("text-classification", "transformer") or not task.model:
        return None
    return pooling_notice(task.model, str(task.model_config.get("pooling", "cls")))


def _task_command(args) -> int:
    # lazy: grpc loads only for the task subcommands (every other command starts without it)
    from fedclinic.client import state_name

    task = Task.from_toml(args.file) if args.task_cmd == "submit" else None
    notice = pooling_notice_for(task) if task is not None else None
    if notice:  # before packaging: the scientist may still switch (stderr: stdout's first line stays the task id)
        print(f"note: {notice}", file=sys.stderr, flush=True)
    with _client(args) as client:
        if task is not None:
            st = client.submit(task)
            print(f"submitted {st.task_id} ({st.spec.name!r})")
            if args.wait:
                st = client.wait(st.task_id, progress=True)
                _print_status(st, False)
                return 0 if state_name(st.state) == "completed" else 1
        elif args.task_cmd == "status":
            _print_status(client.status(args.task_id), args.json)
        elif args.task_cmd == "list":
            tasks = list(client.list(include_finished=args.all))
            if args.json:  # one JSON document: an array of task statuses
                print(json.dumps([message_to_dict(st) for st in tasks], indent=2))
                return 0
            for st in tasks:
                _print_status(st, False)
            if not tasks:
                print("no tasks" if args.all else "no queued or running tasks (--all lists finished ones too)")
        elif args.task_cmd == "watch" and args.eval:
            from fedclinic.client import ProgressDisplay
            from fedclinic.federation.round_scoring import watch_and_score  # torch loads when a model is scored

            events = ProgressDisplay(sys.stderr, tty=False)  # a line per event: the scores go to stdout between them
            st = watch_and_score(client, args.task_id, args.eval, out=sys.stdout, on_event=events.update).status
            _print_status(st, False)
        elif args.task_cmd == "watch":
            st = client.wait(args.task_id, progress=True)
            _print_status(st, False)
        elif args.task_cmd == "cancel":
            _print_status(client.cancel(args.task_id, args.reason), False)
        elif args.task_cmd == "download":
            path = client.download(args.task_id, args.out, round=args.round, allow_unsigned=args.allow_unsigned,
                                   thresholds=args.thresholds)
            print(f"model written to {path} (model card: {path / 'MODEL_CARD.md'})")
            if args.thresholds:
                print(f"per-label thresholds set in the model card ({args.thresholds}); `fedclinic export onnx` "
                      "carries them into the bundle")
    return 0


def _verify_command(args) -> int:
    """``fedclinic task verify``: exit 0 when every check passes, 1 when one fails (fedclinic.verification)."""
    from fedclinic.verification.verifier import verify_task

    with _client(args) as client:
        verdict = verify_task(client, args.task_id, args.ca)
    print(json.dumps(verdict.to_json(), indent=2) if args.json else verdict.text())
    return 0 if verdict.ok else 1


def _dashboard_command(args) -> int:
    """``fedclinic dashboard``: the page reads with the same certificate and settings as ``task status``."""
    with _client(args) as client:
        return run_dashboard(args, client)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedclinic", description="fedclinic: federated learning for hospitals")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    add_pki_commands(sub)

    task = sub.add_parser("task", help="submit and follow federated tasks",
                          description="Submit a task.toml to the aggregator and follow, cancel, download and "
                                      "verify your tasks. Connection settings: --address/--cert/--key/--ca or "
                                      "FEDCLINIC_ADDRESS, FEDCLINIC_CERT, FEDCLINIC_KEY, FEDCLINIC_CA.")
    tsub = task.add_subparsers(dest="task_cmd", metavar="COMMAND", required=True)
    p = tsub.add_parser("submit", help="validate and package task.toml's model, sign the task and submit it; prints "
                                       "the task id")
    p.add_argument("file", help="the task.toml (every key: docs/task-reference.md)")
    p.add_argument("--wait", action="store_true", help="follow progress until the task ends")
    _connection_args(p)
    for name, what in (("status", "a task's state, rounds, metrics and the sites it waits for"),
                       ("watch", "follow a task's progress until it ends, then print its status"),
                       ("cancel", "stop a queued or running task; the sites are told")):
        p = tsub.add_parser(name, help=what)
        p.add_argument("task_id", help="the id `task submit` printed (t-...)")
        _connection_args(p)
        if name == "status":
            p.add_argument("--json", action="store_true", help="the status as JSON (64-bit numbers as numbers)")
        if name == "cancel":
            p.add_argument("--reason", default="", help="why (recorded with the task)")
        if name == "watch":
            p.add_argument("--eval", metavar="TEST", help="score every round's model on your own test file (JSONL, "
                                                          "CSV or TSV) as the round closes, beside the sites' figures")
    p = tsub.add_parser("list", help="your queued and running tasks (--all: finished ones too)")
    p.add_argument("--all", action="store_true", help="include finished tasks")
    p.add_argument("--json", action="store_true", help="the statuses as one JSON array")
    _connection_args(p)
    p = tsub.add_parser("download", help="download the final model (or a round's), check the aggregator's signature "
                                         "and write it with its model card")
    p.add_argument("task_id", help="the task's id (t-...)")
    p.add_argument("out", help="the folder to write the model into")
    p.add_argument("--round", type=int, default=0, help="a round's global model instead of the final one")
    p.add_argument("--allow-unsigned", action="store_true",
                   help="accept a model the aggregator sent no signature for (an older aggregator); a signature "
                        "that does not verify is refused regardless")
    p.add_argument("--thresholds", metavar="FILE|tuned",
                   help="multi-label models: per-label decision thresholds for the card, the ONNX bundle and serve: "
                        "'tuned' (F1-best from the final model's evaluation at the sites) or a JSON file (a list in "
                        "label order, or an object label -> threshold); default: 0.5 for every label")
    _connection_args(p)
    for p in tsub.choices.values():
        p.set_defaults(func=_task_command)
    p = tsub.add_parser("verify", help="check a task's rounds against the sites' signed statements")
    p.add_argument("task_id", help="the task's id (t-...)")
    p.add_argument("--json", action="store_true", help="the verdict as JSON")
    _connection_args(p)
    p.set_defaults(func=_verify_command)

    add_experiment_commands(sub)
    add_simulate_command(sub)
    add_export_commands(sub)
    add_serve_command(sub)

    add_audit_commands(sub)
    add_privacy_commands(sub)

    p = sub.add_parser("dashboard", help="a local, read-only web page of your tasks: rounds, the sites a round waits "
                                         "for, plots, results (prints its URL with a one-time token)")
    add_dashboard_arguments(p)
    _connection_args(p)
    p.set_defaults(func=_dashboard_command)

    demo = sub.add_parser("demo", help="run a local 3-hospital federation on real data")
    add_demo_arguments(demo)
    demo.set_defaults(func=run_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except FedclinicError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
