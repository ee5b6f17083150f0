"""Evaluation over real processes (one federation): a training task ends with the final model's site x model
matrix, an "evaluate" task of that model returns the same matrix, a small site's cells are suppressed, a site
whose policy forbids evaluation declines, SubmitResult refuses callers and values it must not take (nothing
written); a "statistics" task returns per-site and pooled tables, a small site's cells suppressed."""

from __future__ import annotations

import math

import grpc
import pytest

from fedclinic import pki
from fedclinic.client import connect, results_lines, state_name
from fedclinic.federation.local_federation import LocalFederation, SiteSetup, wait_until
from fedclinic.pki.signed_statement import Signer
from fedclinic.proto import agent_pb2, agent_pb2_grpc, control_pb2, control_pb2_grpc
from fedclinic.spec.signed_task import sign_task
from fedclinic.transport.rpc import TlsFiles, secure_channel

from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package, write_site_data

pytestmark = pytest.mark.integration

#: site -> (training rows, held-out rows, policy); site-c's 6 and 4 rows are fewer than k = 10
SITES = {"site-a": (24, 24, {}), "site-b": (24, 20, {}), "site-c": (6, 4, {}),
         "site-d": (24, 12, {"allow_evaluation": False, "allow_statistics": False})}


@pytest.fixture(scope="module")
def fed(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("evaluation")
    sites = []
    for i, (name, (n, m, policy)) in enumerate(SITES.items()):
        train = write_site_data(tmp_path / "data" / name, n, seed=i)
        held = write_site_data(tmp_path / "held" / name, m, seed=10 + i)
        sites.append(SiteSetup(name, datasets={"notes": {"path": str(train), "format": "jsonl",
                                                         "eval_path": str(held)}},
                               policy={"allowed_families": ["text-classification"], **policy} if policy else None))
    with LocalFederation(tmp_path / "fed", sites, agent_threads=1) as f:
        f.start()
        yield f


def _site_stub(fed: LocalFederation, site: str):
    c = fed.creds(site)
    channel = secure_channel(fed.address, TlsFiles(c["cert"], c["key"], c["ca"]), server_name="localhost")
    return agent_pb2_grpc.AgentServiceStub(channel), channel


def _matrix(st: control_pb2.TaskStatus) -> dict[tuple[str, str], control_pb2.ResultCell]:
    return {(c.site_id, c.model): c for c in st.results.cells}


def _check_matrix(st: control_pb2.TaskStatus, model: str) -> None:
    cells = _matrix(st)
    assert set(cells) == {("site-a", model), ("site-b", model), ("site-c", model)}
    assert cells["site-a", model].rows == 24 and cells["site-b", model].rows == 20
    assert 0 <= cells["site-a", model].values["accuracy"] <= 1
    small = cells["site-c", model]  # 4 rows < k = 10: nothing of it is shown, and it is in no pool
    assert small.suppressed and not small.values and small.rows == 0
    (pooled,) = st.results.pooled
    assert pooled.model == model and pooled.sites == 2 and pooled.values["eval_rows"] == 44
    expected = (24 * cells["site-a", model].values["accuracy"] + 20 * cells["site-b", model].values["accuracy"]) / 44
    assert math.isclose(pooled.values["accuracy"], expected, rel_tol=1e-9)
    assert len(st.results.declined) == 1 and st.results.declined[0].startswith("site-d: ")
    assert "allow_evaluation = false" in st.results.declined[0]


def test_final_and_evaluate_only_tasks_return_the_matrix_and_refuse_what_they_must(fed, tmp_path):
    with fed.client() as client:
        # a training task: after its last round every site that trained evaluates the final model
        st = client.submit(make_task(num_rounds=1, min_sites=4), package=tiny_package("logreg"))
        final = client.wait(st.task_id, timeout=180, progress=False)
        assert state_name(final.state) == "completed", final.error
        assert final.results.work == "evaluate" and not final.results.open
        assert final.results.model_hash == final.final_model_hash
        _check_matrix(final, "final")
        # the round's site evaluation (sent after the updates) is of the model it started from; site-c's 4 rows: out
        assert final.rounds[0].eval_sites == 3 and final.rounds[0].eval_model_hash == final.initial_model_hash
        reports = {r.site_id: r for r in final.rounds[0].reports}
        assert reports["site-c"].eval_suppressed and not reports["site-c"].eval_metrics
        assert reports["site-a"].eval_rows == 24 and final.rounds[0].metrics["eval_rows"] == 24 + 20 + 12
        events = [e for e in client.watch(st.task_id)]
        assert [e.kind for e in events][-2:] == ["results-closed", "completed"]
        closed = events[-2].message  # the final line says it is the final model, and over what
        assert "final model: acc" in closed and "on 44 rows over 2 site(s)" in closed, closed
        assert any(e.kind in ("round-closed", "round-evaluated") and "site-eval of the model it started from (the "
                   "initial model)" in e.message for e in events), [e.message for e in events]
        text = "\n".join(results_lines(final))
        assert "evaluation of the final model" in text and "site-c x final: suppressed" in text

        # an evaluation-only task of that model: the same matrix, no training
        ev = client.submit(make_task(kind="evaluate", evaluation={"model_task": st.task_id}, min_sites=1))
        done = client.wait(ev.task_id, timeout=120, progress=False)
        assert state_name(done.state) == "completed", done.error
        assert not done.rounds and done.results.model_hash == final.final_model_hash
        _check_matrix(done, "model")
        assert _matrix(done)["site-a", "model"].values == _matrix(final)["site-a", "final"].values

        # a phase that waits for a site that never comes: site-a's answer is in, the phase stays open
        open_task = client.submit(make_task(kind="evaluate", evaluation={"model_task": st.task_id, "timeout_s": 120},
                                            min_sites=1, sites=["site-a", "site-z"]))
        wait_until(lambda: _matrix(client.status(open_task.task_id)), 60, "site-a's evaluation")
        before = client.status(open_task.task_id)
        assert before.results.open and set(_matrix(before)) == {("site-a", "model")}

        stub, channel = _site_stub(fed, "site-a")
        other, other_channel = _site_stub(fed, "site-b")
        good = agent_pb2.SubmitResultRequest(task_id=open_task.task_id, round=1, work="evaluate",
                                             model_hash=final.final_model_hash, results=[agent_pb2.ResultValues(
                                                 model="model", values={"eval_rows": 50.0, "accuracy": 1.0})])
        try:
            # a site never assigned to the task: PERMISSION_DENIED, nothing written
            with pytest.raises(grpc.RpcError) as exc:
                other.SubmitResult(good, timeout=30)
            assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED and "never assigned" in exc.value.details()
            for bad, words in (
                    ({"eval_rows": 50.0, "accuracy": float("nan")}, "finite"),
                    ({"eval_rows": 50.0, "x" * 201: 1.0}, "printable ASCII"),
                    ({f"k{i}": 1.0 for i in range(16_385)}, "at most 16384")):
                req = agent_pb2.SubmitResultRequest()
                req.CopyFrom(good)
                req.results[0].values.clear()
                req.results[0].values.update(bad)
                with pytest.raises(grpc.RpcError) as exc:
                    stub.SubmitResult(req, timeout=30)
                assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in exc.value.details()
            req = agent_pb2.SubmitResultRequest()
            req.CopyFrom(good)
            req.results[0].model = "final"
            with pytest.raises(grpc.RpcError) as exc:
                stub.SubmitResult(req, timeout=30)
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "takes ['model']" in exc.value.details()
            assert stub.SubmitResult(good, timeout=30).stored == 0  # a second copy of a cell: kept as first sent
        finally:
            channel.close()
            other_channel.close()
        after = client.status(open_task.task_id)
        assert _matrix(after) == _matrix(before)
        client.cancel(open_task.task_id, "test over")

    # another owner may not name the task's model: an id (or a hash) is not a capability
    pki.issue(fed.ca_dir, role="scientist", name="bob", out_dir=tmp_path / "bob", days=1)
    bob = TlsFiles(tmp_path / "bob" / "bob.crt", tmp_path / "bob" / "bob.key", tmp_path / "bob" / "ca.crt")
    spec = make_task(kind="evaluate", evaluation={"model_task": st.task_id}, min_sites=1).to_spec()
    signed = sign_task(Signer(key_path=bob.key, cert_path=bob.cert), spec, model_hash=final.final_model_hash,
                       idempotency_key="k", owner="bob")
    header = control_pb2.SubmitTaskHeader(spec=spec, idempotency_key="k", signed_task=signed.to_proto())
    channel = secure_channel(fed.address, bob, server_name="localhost")
    try:
        with pytest.raises(grpc.RpcError) as exc:
            control_pb2_grpc.ControlStub(channel).SubmitTask(iter([
                control_pb2.SubmitTaskChunk(header=header),
                control_pb2.SubmitTaskChunk(commit=control_pb2.SubmitTaskCommit())]), timeout=30)
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED and "not a task of yours" in exc.value.details()
    finally:
        channel.close()
    with connect(fed.address, cert=bob.cert, key=bob.key, ca=bob.ca, server_name="localhost") as c:
        assert c.list(include_finished=True) == []  # nothing was created for bob


def test_a_statistics_task_returns_per_site_and_pooled_tables(fed):
    pytest.importorskip("hospital_agent.site_statistics")  # the statistics computation (issue 19, stats)
    with fed.client() as client:
        st = client.submit(make_task(kind="statistics", min_sites=1), package=tiny_package("logreg"))
        done = client.wait(st.task_id, timeout=120, progress=False)
    assert state_name(done.state) == "completed", done.error
    assert done.results.work == "statistics" and not done.rounds
    cells = {c.site_id: c for c in done.results.cells}
    assert set(cells) == {"site-a", "site-b", "site-c"} and all(c.model == "statistics" for c in cells.values())
    assert cells["site-a"].values["rows"] == 24 and cells["site-a"].values["label/cardio"] == 12
    small = cells["site-c"]  # 6 rows < k = 10: its counts are withheld at the site, listed as suppressed
    assert small.suppressed and "rows" not in small.values and small.values["suppressed/rows"] == 1
    (pooled,) = done.results.pooled
    assert pooled.model == "statistics" and pooled.values["rows"] >= 48
    assert len(done.results.declined) == 1 and "allow_statistics = false" in done.results.declined[0]
