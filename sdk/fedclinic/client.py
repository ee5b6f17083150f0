"""The data scientist's client: submit tasks, watch them, fetch results.

    import fedclinic
    client = fedclinic.connect("agg.example.org:7443", cert="me.crt", key="me.key", ca="ca.crt")
    status = client.submit(fedclinic.Task(name="demo", dataset="notes", labels=["a", "b"], model="/models/minilm"))
    final = client.wait(status.task_id)          # live progress in a terminal
    client.download(status.task_id, "final-model/")   # the package + model_card.json and MODEL_CARD.md
"""

from __future__ import annotations

import hashlib
import sys
import time
import uuid
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Iterator

import grpc

from fedclinic.evaluation.statistics_table import coverage_warning
from fedclinic.errors import FedclinicError, IntegrityError
from fedclinic.pki.common import PkiError
from fedclinic.pki.model_signatures import check_aggregator_statement, countersign
from fedclinic.pki.signed_statement import SignedStatement, Signer
from fedclinic.transport.package import SIGNATURES_FILE, Manifest, ModelPackage, raw_bytes
from fedclinic.proto import control_pb2, control_pb2_grpc
from fedclinic.control_channel import ControlChannel
from fedclinic.transport.rpc import TlsFiles, explain_rpc_error
from fedclinic.spec.task import Task
from fedclinic.transport.resume import receive_resuming
from fedclinic.transport.wire import encoded_tensor_chunks, file_chunks, header_of, manifest_to_proto
from fedclinic.pki import check_own_certificate, identity_from_pem
from fedclinic.spec.signed_task import sign_task
from fedclinic.spec.model_card import build_card, write_card

_SUBMIT_TENSOR_FIELD = control_pb2.SubmitTaskChunk.DESCRIPTOR.fields_by_name["tensor"].number
TERMINAL = (control_pb2.TASK_STATE_COMPLETED, control_pb2.TASK_STATE_FAILED, control_pb2.TASK_STATE_CANCELLED)


def state_name(state: int) -> str:
    return control_pb2.TaskState.Name(state).removeprefix("TASK_STATE_").lower()


def waiting_sites(status: control_pb2.TaskStatus) -> list[str]:
    """The sites the open round still waits for: assigned, with neither an update nor a refusal yet (sorted).
    A site holding the task says so and why (:func:`held_sites`, e.g. awaiting approval by its IT); for the
    others the aggregator cannot tell whether they are training or offline. Empty when no round is open, and for
    secure aggregation, whose rounds report no per-site updates."""
    if not status.rounds or status.spec.secure_aggregation.enabled:
        return []
    r = status.rounds[-1]
    if r.state != control_pb2.ROUND_STATE_OPEN:
        return []
    done = {rep.site_id for rep in r.reports} | {d.split(":", 1)[0] for d in r.declined}
    return sorted(set(r.sites_assigned) - done)


def held_sites(status: control_pb2.TaskStatus) -> dict[str, str]:
    """Site -> reason, for the sites that hold the open round's assignment without refusing it (e.g. awaiting
    approval by their IT) and have not reported; empty when no round is open."""
    if not status.rounds or status.rounds[-1].state != control_pb2.ROUND_STATE_OPEN:
        return {}
    return dict(entry.split(": ", 1) for entry in status.rounds[-1].held if ": " in entry)


class Client:
    def __init__(self, address: str | Sequence[str], tls: TlsFiles, *, server_name: str | None = None) -> None:
        """``address``: ``"host:port"``, or several (a hot-standby pair) as ``"a:port,b:port"`` or a list, tried in
        turn on UNAVAILABLE (fedclinic.control_channel)."""
        self._tls = tls
        self._conn = ControlChannel(address, tls, server_name=server_name)

    @property
    def address(self) -> str:
        """The aggregator address in use."""
        return self._conn.address

    @property
    def _stub(self) -> control_pb2_grpc.ControlStub:
        return self._conn.stub

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._conn.close()

    def _call(self, method: str, *args, **kwargs):
        """The Control RPC ``method`` (a stub attribute, or "SubmitTask" with an iterator factory as its one
        argument), with failover across the addresses."""
        def once():
            if method == "SubmitTask":
                return self._conn.submit_raw(args[0](), **kwargs)
            return getattr(self._conn.stub, method)(*args, **kwargs)

        try:
            return self._conn.retrying(once)
        except grpc.RpcError as exc:
            raise explain_rpc_error(exc, self.address) from None

    # tasks ------------------------------------------------------------------------------------------------
    def submit(self, task: Task, *, package: ModelPackage | None = None, manifest: Manifest | None = None,
               idempotency_key: str | None = None) -> control_pb2.TaskStatus:
        """Package the initial model (unless given), stream it with the spec; returns the new task's status.

        ``manifest`` may be passed when the caller already hashed ``package`` (saves one pass over it).
        Retrying with the same ``idempotency_key`` returns the task the first call created.

        The spec, the initial model's hash and the idempotency key are signed with this client's certificate key
        (:mod:`fedclinic.spec.signed_task`); the sites check that signature before they train, so neither the
        aggregator nor anyone else can alter the task, swap its model or run it under another task id.
        """
        task.validate()
        if isinstance(task.pos_weight, str):  # "from-statistics:<task id>": weights from that task's label counts
            from fedclinic.evaluation.class_weights import resolve_task_pos_weight

            task = resolve_task_pos_weight(task, self.status)
        named = task.evaluation.get("model_task", "") if task.kind == "evaluate" else ""
        if named:
            return self._submit_evaluation_of(task, named, idempotency_key)
        if package is None:
            # lazy: the model families (and torch, when packaging) load only when a task is packaged here
            from fedclinic.models import package_for_task

            package = package_for_task(task)
        manifest = manifest or package.manifest()

        tok = package.files.get("tokenizer.json")
        spec = task.to_spec(tokenizer_sha256=hashlib.sha256(tok).hexdigest() if tok else "")
        key = idempotency_key or uuid.uuid4().hex
        owner = identity_from_pem(self._tls.cert.read_bytes()).name
        signed = sign_task(Signer(key_path=self._tls.key, cert_path=self._tls.cert), spec,
                           model_hash=manifest.model_hash, idempotency_key=key, owner=owner)
        header = control_pb2.SubmitTaskHeader(spec=spec, idempotency_key=key, model=manifest_to_proto(manifest),
                                              signed_task=signed.to_proto())

        return self._call("SubmitTask", lambda: submission_stream(header, package, manifest), timeout=3600)

    def _submit_evaluation_of(self, task: Task, named: str, idempotency_key: str | None) -> control_pb2.TaskStatus:
        """Submit an "evaluate" task of the final model of ``named`` (a completed task of this client's owner):
        no model travels, the signature covers that model's hash, the aggregator checks the ownership."""
        source = self.status(named)
        if not source.final_model_hash:
            raise FedclinicError(f"task {named} has no final model yet ({state_name(source.state)}); evaluate it "
                                 "once it completed")
        spec = task.to_spec(tokenizer_sha256=source.spec.tokenizer_sha256)
        key = idempotency_key or uuid.uuid4().hex
        owner = identity_from_pem(self._tls.cert.read_bytes()).name
        signed = sign_task(Signer(key_path=self._tls.key, cert_path=self._tls.cert), spec,
                           model_hash=source.final_model_hash, idempotency_key=key, owner=owner)
        header = control_pb2.SubmitTaskHeader(spec=spec, idempotency_key=key, signed_task=signed.to_proto())
        chunks = [control_pb2.SubmitTaskChunk(header=header).SerializeToString(),
                  control_pb2.SubmitTaskChunk(commit=control_pb2.SubmitTaskCommit()).SerializeToString()]
        return self._call("SubmitTask", lambda: iter(chunks), timeout=600)

    def status(self, task_id: str) -> control_pb2.TaskStatus:
        return self._call("GetTask", control_pb2.GetTaskRequest(task_id=task_id), timeout=60)

    def list(self, include_finished: bool = False) -> list[control_pb2.TaskStatus]:
        resp = self._call("ListTasks", control_pb2.ListTasksRequest(include_finished=include_finished),
                          timeout=60)
        return list(resp.tasks)

    def cancel(self, task_id: str, reason: str = "") -> control_pb2.TaskStatus:
        return self._call("CancelTask", control_pb2.CancelTaskRequest(task_id=task_id, reason=reason),
                          timeout=60)

    def watch(self, task_id: str, after_seq: int = 0) -> Iterator[control_pb2.TaskEvent]:
        """Progress events until the task ends. Reconnects and resumes after the last event seen."""
        seq = after_seq
        failures = 0
        while True:
            try:
                for event in self._stub.WatchTask(control_pb2.WatchTaskRequest(task_id=task_id, after_seq=seq)):
                    failures = 0
                    seq = event.seq
                    yield event
                return
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or failures >= 10:
                    raise explain_rpc_error(exc, self.address) from None
                if len(self._conn.ring.addresses) > 1:  # a standby pair: the next address (and back) at once
                    self._conn.failover()
                    time.sleep(0.2 if failures < 2 * len(self._conn.ring.addresses) else min(2 ** failures, 8))
                    failures += 1
                    continue
                failures += 1
                time.sleep(min(2 ** failures, 30))  # reconnect backoff while the aggregator restarts

    def wait(self, task_id: str, *, timeout: float | None = None, progress: bool | None = None,
             out=None) -> control_pb2.TaskStatus:
        """Block until the task ends, drawing progress (a bar in a terminal, lines otherwise)."""
        out = out or sys.stderr
        progress = out.isatty() if progress is None else progress
        deadline = None if timeout is None else time.monotonic() + timeout
        display = ProgressDisplay(out, tty=out.isatty()) if progress else None
        status = None
        for event in self.watch(task_id):
            status = event.status
            if display:
                display.update(event)
            if deadline is not None and time.monotonic() > deadline:
                raise FedclinicError(f"task {task_id} did not finish within {timeout:g} s; it keeps running "
                                     "(watch it with `fedclinic task watch`)")
        if display:
            display.close()
        return status if status is not None else self.status(task_id)

    # models -----------------------------------------------------------------------------------------------
    def fetch_package(self, task_id: str, round: int = 0, *, allow_unsigned: bool = False) -> ModelPackage:
        """The final model (round=0), the model after ``round``, or the initial one (round=-1), checked against
        the aggregator's signature over it (see :meth:`download`)."""
        return self._fetch(task_id, round, allow_unsigned=allow_unsigned)[0]

    def _fetch(self, task_id: str, round: int, *, allow_unsigned: bool
               ) -> tuple[ModelPackage, str, SignedStatement | None]:
        """The package, its verified model hash and the aggregator's verified statement on it (None only when
        the aggregator sent none and ``allow_unsigned``)."""
        def open_stream(point: tuple[str, int]):
            return self._stub.FetchModel(control_pb2.ControlFetchModelRequest(
                task_id=task_id, round=round, resume_tensor=point[0], resume_offset=point[1]))

        try:  # a cut connection resumes from the last verified chunk (fedclinic.transport.resume)
            got = self._conn.retrying(lambda: receive_resuming(open_stream))
        except grpc.RpcError as exc:
            raise explain_rpc_error(exc, self.address) from None
        statement = SignedStatement.from_proto(got.statement) if got.statement is not None else None
        if statement is None and allow_unsigned:
            return got.package, got.model_hash, None
        try:
            check_aggregator_statement(statement, ca_path=self._tls.ca, task_id=task_id, round=round,
                                       model_hash=got.model_hash)
        except PkiError as exc:
            raise IntegrityError(f"download of task {task_id} refused: {exc}") from None
        return got.package, got.model_hash, statement

    def fetch_model(self, task_id: str, round: int = 0) -> tuple[ModelPackage, str]:
        """The model of :meth:`fetch_package` and the model hash its tensors and files verified to (the
        aggregator's signature on it checked as for a download)."""
        package, model_hash, _ = self._fetch(task_id, round, allow_unsigned=False)
        return package, model_hash

    # verifiable rounds (fedclinic.verification) -------------------------------------------------------------
    def task_records(self, task_id: str) -> control_pb2.TaskRecords:
        """The task's public round records: statements, models, secure sums (``Control.GetTaskRecords``, asked
        again from ``next_round`` until every round is in)."""
        from fedclinic.verification.records import all_rounds  # only `task verify` needs it

        return all_rounds(lambda first: self._call("GetTaskRecords", control_pb2.GetTaskRecordsRequest(
            task_id=task_id, first_round=first)))

    def fetch_task_blob(self, task_id: str, sha256: str) -> bytes:
        """A blob the task's records name (a published update tensor, a secure sum); the caller checks its hash."""
        try:
            return self._conn.retrying(lambda: b"".join(c.data for c in self._stub.FetchTaskBlob(
                control_pb2.FetchTaskBlobRequest(task_id=task_id, sha256=sha256))))
        except grpc.RpcError as exc:
            raise explain_rpc_error(exc, self.address) from None

    def download(self, task_id: str, out_dir: str | Path, round: int = 0, *,
                 status: control_pb2.TaskStatus | None = None, allow_unsigned: bool = False,
                 thresholds: Any = None) -> Path:
        """Write the model as a package folder (``model.safetensors`` + config + tokenizer) with its model card
        (``model_card.json`` and ``MODEL_CARD.md``, see :mod:`fedclinic.spec.model_card`) and its signatures
        (``SIGNATURES.json``, :mod:`fedclinic.pki.model_signatures`) beside the files.

        The aggregator's signature over the model is checked against the CA before anything is written (an
        IntegrityError saying why otherwise: a model the aggregator did not sign, or signed for another task,
        round or model), then countersigned with this client's key. ``allow_unsigned`` accepts a model the
        aggregator sent no signature for (an older aggregator); the folder then has no ``SIGNATURES.json``.
        The card is built from ``status`` when given, else from the task's status fetched after the model (so
        it knows every round that went into it). ``thresholds`` (multi-label models) sets the per-label decision
        thresholds the card, the ONNX bundle and ``serve`` carry: ``"tuned"`` (F1-best from the final model's pooled
        evaluation in the status), a JSON file, a list in label order or a mapping label -> threshold
        (:func:`fedclinic.evaluation.thresholds.write_model_thresholds`).
        """
        package, model_hash, statement = self._fetch(task_id, round, allow_unsigned=allow_unsigned)
        signatures = None
        if statement is not None:
            signatures = countersign(Signer(key_path=self._tls.key, cert_path=self._tls.cert), statement,
                                     task_id=task_id, manifest=package.manifest())
        folder = package.save(out_dir)
        if signatures is not None:
            signatures.save(folder)
        else:
            (folder / SIGNATURES_FILE).unlink(missing_ok=True)  # an earlier download's, of another model
        if status is None:
            status = self.status(task_id)
        write_card(folder, build_card(package.meta, model_hash=model_hash, status=status, requested_round=round))
        if thresholds is not None:
            # lazy: numpy metrics load only when thresholds are set
            from fedclinic.evaluation.thresholds import write_model_thresholds

            write_model_thresholds(folder, thresholds, status=status,
                                   source=f"the final model's evaluation at the sites of task {task_id}"
                                   if thresholds == "tuned" else "")
        return folder


def submission_stream(header: control_pb2.SubmitTaskHeader, package: ModelPackage,
                      manifest: Manifest) -> Iterator[bytes]:
    """The serialized SubmitTask messages: ``header``, every file and tensor of ``package`` (as ``manifest`` lists
    them), the commit. Pre-serialized: tensor payloads are copied once (see fedclinic.transport.wire)."""
    yield control_pb2.SubmitTaskChunk(header=header).SerializeToString()
    for f in manifest.files:
        for c in file_chunks(f.path, package.files[f.path]):
            yield control_pb2.SubmitTaskChunk(file=c).SerializeToString()
    for t in manifest.tensors:
        yield from encoded_tensor_chunks(_SUBMIT_TENSOR_FIELD, header_of(t), raw_bytes(package.tensors[t.name]))
    yield control_pb2.SubmitTaskChunk(commit=control_pb2.SubmitTaskCommit()).SerializeToString()


def connect(address: str | Sequence[str], *, cert: str | Path, key: str | Path, ca: str | Path,
            server_name: str | None = None, check: bool = True) -> Client:
    """Open an mTLS connection to an aggregator with a ``scientist`` (or ``admin``) certificate.

    ``address``: ``"host:port"``; a hot-standby pair as ``"a:7443,b:7443"`` or ``["a:7443", "b:7443"]``
    (tried in turn: a call refused with UNAVAILABLE by a standby, or to an address nobody listens on, goes to the
    next; fedclinic.control_channel).

    With ``check`` (default) the local credentials are verified first, so an expired or mismatched
    certificate is reported plainly instead of as a failed TLS handshake.
    """
    tls = TlsFiles(Path(cert), Path(key), Path(ca))
    if check:
        ident = check_own_certificate(tls.cert, tls.key, tls.ca)
        if ident.role not in ("scientist", "admin"):
            raise FedclinicError(f"certificate {cert} has role {ident.role!r}; the control API needs a 'scientist' "
                                 "or 'admin' certificate (`fedclinic pki issue --role scientist ...`)")
    return Client(address, tls, server_name=server_name)


#: round metric -> how the progress line names it (the first one a round has is shown)
HEADLINE_METRICS = (("eval_macro_auc", "macro AUC"), ("eval_accuracy", "acc"),
                    ("eval_strict_f1", "entity F1"), ("eval_rougeL", "ROUGE-L"))


def evaluated_model(round_: int) -> str:
    """Which model a round's site evaluation is of: the one the round started from."""
    return "the initial model" if round_ <= 1 else f"the round-{round_ - 1} model"


def _headline(metrics, round_: int = 0) -> str:
    """The round's headline metric (the sites' evaluation of the model the round started from), then its privacy
    spend when the task is private."""
    of = f" (of {evaluated_model(round_)})" if round_ else ""
    text = next((f" site-eval{of} {name} {metrics[key]:.3f}" for key, name in HEADLINE_METRICS if key in metrics),
                "")
    if "eval_macro_auc" in metrics and "eval_macro_f1" in metrics:  # multi-label: exact match says little
        text = (f" site-eval{of} macro-F1 {metrics['eval_macro_f1']:.3f} "
                f"macro-AUC {metrics['eval_macro_auc']:.3f}")
    if "dp_epsilon" in metrics:  # sample-level DP: the largest cumulative spend of any site
        text += f" eps {metrics['dp_epsilon']:.2f} (delta {metrics.get('dp_delta', 0.0):.0e})"
    elif "client_dp_epsilon" in metrics:
        text += f" client-DP eps {metrics['client_dp_epsilon']:.2f}"
    elif "ddp_epsilon" in metrics:  # distributed DP: the sites' noise shares, accounted at the aggregator
        text += f" distributed-DP eps {metrics['ddp_epsilon']:.2f} (delta {metrics.get('ddp_delta', 0.0):.0e})"
    layers = sorted((int(k[len("safl_layer_"):-len("_sites")]), int(v)) for k, v in metrics.items()
                    if k.startswith("safl_layer_") and k.endswith("_sites"))
    if layers:  # SAFL: how many sites sent each layer this round
        text += " layers " + " ".join(f"{layer}:{n}" for layer, n in layers)
    return text


#: the values the matrix shows first for an evaluation (then up to RESULT_COLUMNS in name order)
RESULT_FIRST = ("eval_rows", "accuracy", "macro_f1", "macro_auc", "strict_f1", "rougeL", "loss")
RESULT_COLUMNS = 6


def results_lines(status: control_pb2.TaskStatus) -> list[str]:
    """The task's result phase as text: which model, one line per (site, model) cell (a suppressed cell says so),
    the pooled values per model, the sites that declined and those it still waits for."""
    ph = status.results
    what = ("statistics of the sites' data" if ph.work == "statistics" else
            f"evaluation of the final model {ph.model_hash[:12]}" if not status.spec.kind else
            f"evaluation of model {ph.model_hash[:12]}")
    lines = [f"  {what}: {'open' if ph.open else 'closed'}, {len({c.site_id for c in ph.cells})} site(s) answered"]

    def shown(values) -> str:
        keys = [k for k in RESULT_FIRST if k in values] + sorted(k for k in values if k not in RESULT_FIRST)
        more = len(keys) - RESULT_COLUMNS
        text = " ".join(f"{k}={values[k]:.4g}" for k in keys[:RESULT_COLUMNS])
        return text + (f" (+{more} more: --json)" if more > 0 else "")

    if ph.work == "statistics":  # the table is printed from site_statistics / pooled_statistics
        return lines + [f"    declined: {d}" for d in ph.declined] + (
            [f"    waiting for: {', '.join(ph.waiting)}"] if ph.waiting else [])
    for c in ph.cells:
        body = "suppressed (fewer evaluated rows than the site's min_cell_rows)" if c.suppressed else shown(c.values)
        lines.append(f"    {c.site_id} x {c.model}: {body}")
    for p in ph.pooled:
        lines.append(f"    pooled {p.model} ({p.sites} site(s)): " + (shown(p.values) if p.values else p.note))
    lines += [f"    declined: {d}" for d in ph.declined]
    if ph.waiting:
        lines.append(f"    waiting for: {', '.join(ph.waiting)}")
    return lines


class ProgressDisplay:
    """Renders task events: a one-line bar on a terminal, one line per event otherwise."""

    def __init__(self, out, *, tty: bool) -> None:
        self.out = out
        self.tty = tty
        self._coverage_warned: set[str] = set()  # sites whose tokenizer coverage warning is shown

    def update(self, event: control_pb2.TaskEvent) -> None:
        st = event.status
        total = st.spec.rounds.num_rounds or 1
        done = sum(1 for r in st.rounds if r.state == control_pb2.ROUND_STATE_CLOSED)
        current = st.rounds[-1] if st.rounds else None
        reported = len(current.reports) if current else 0
        target = current.sites_target if current else 0
        closed = [r for r in st.rounds if r.state == control_pb2.ROUND_STATE_CLOSED]
        acc_txt = _headline(closed[-1].metrics, closed[-1].round) if closed else ""
        if closed and closed[-1].metrics.get("uplink_fp32_bytes"):  # update codecs: bytes sent vs fp32 deltas
            m = closed[-1].metrics
            acc_txt += f" up {closed[-1].uplink_bytes:,} B (fp32 {int(m['uplink_fp32_bytes']):,} B"
            acc_txt += f", {m['uplink_reduction']:.1f}x)" if m.get("uplink_reduction") else ")"
        if closed and closed[-1].downlink_bytes:
            acc_txt += f" down {closed[-1].downlink_bytes:,} B"
        if self.tty:
            width = 20
            filled = int(width * done / total)
            bar = "#" * filled + "-" * (width - filled)
            waiting = waiting_sites(st) if reported else []  # once some sites are in: who the round waits for
            held = held_sites(st)
            wait_txt = (f" (waiting for {', '.join(s + ' [held]' if s in held else s for s in waiting)})"
                        if waiting else "")
            line = (f"\r{st.task_id} [{bar}] round {min(done + 1, total)}/{total} sites {reported}/{target}"
                    f"{wait_txt}{acc_txt} {state_name(st.state)}")
            self.out.write(line.ljust(100))
            if event.kind in ("declined", "held", "round-failed", "failed"):
                self.out.write(f"\n  {event.message}\n")
        else:
            suffix = acc_txt if event.kind == "round-closed" else ""
            self.out.write(f"[{st.task_id}] {event.kind}: {event.message}{suffix}\n")
        for warning in self._coverage_warnings(st):
            self.out.write(f"\n  warning: {warning}\n" if self.tty else f"[{st.task_id}] warning: {warning}\n")
        self.out.flush()

    def _coverage_warnings(self, st: control_pb2.TaskStatus) -> list[str]:
        """Once per site: the warning for the tokenizer coverage (``tokenizer_unk_rate``) it reported with its
        first update, when above 5 % (fedclinic.evaluation.statistics_table.coverage_warning)."""
        out = []
        for r in st.rounds:
            for rep in r.reports:
                rate = rep.metrics.get("tokenizer_unk_rate")
                warning = coverage_warning(rep.site_id, rate) if rate is not None else None
                if warning and rep.site_id not in self._coverage_warned:
                    self._coverage_warned.add(rep.site_id)
                    out.append(warning)
        return out

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()
