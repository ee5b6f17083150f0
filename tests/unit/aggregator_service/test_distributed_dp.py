"""The aggregator's side of distributed DP: its submit check is the one validator (a spec no SDK checked is refused
with the reason), the setup carries the plan, and a round's epsilon composes every closed round with the noise of
its own survivors (read back from the store), into the summary's fields 20-24."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from aggregator_service import distributed_dp
from aggregator_service.rounds import validate_spec
from aggregator_service.status import status_of
from aggregator_service.store import SqliteStore
from fedclinic.errors import Refused
from fedclinic.proto import control_pb2 as S
from fedclinic.proto import task_pb2
from fedclinic.secagg.task_config import layout_for
from fedclinic.transport.package import ModelPackage

from tests.helpers.tasks import make_task
from tests.helpers.text_models import tiny_package


def _spec() -> task_pb2.TaskSpec:
    task = make_task(privacy={"level": "distributed", "target_epsilon": 4.0, "max_grad_norm": 1.0},
                     secure_aggregation={"enabled": True, "weighting": "uniform"})
    return task.to_spec()


def test_the_submit_check_refuses_a_spec_no_sdk_checked():
    manifest = tiny_package("logreg").manifest()
    validate_spec(_spec(), manifest)
    bad = _spec()  # as another SDK might send it: changed after the SDK's checks
    bad.secure_aggregation.weighting = "samples"
    with pytest.raises(Refused) as info:
        validate_spec(bad, manifest)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and 'weighting = "uniform"' in str(info.value)
    bad.secure_aggregation.enabled = False
    with pytest.raises(Refused, match="inside secure aggregation"):
        validate_spec(bad, manifest)


def test_the_setup_carries_the_plan_and_a_plain_layout_nothing():
    spec = _spec()
    layout = layout_for(spec, ("w",), ((100,),), 4)
    fields = distributed_dp.setup_fields(layout)
    assert fields == {"dp_mechanism": "skellam", "dp_scale": layout.dp.scale,
                      "dp_site_variance": layout.dp.site_variance, "dp_clip_norm": 1.0,
                      "dp_rounding_beta": layout.dp.beta}
    plain = task_pb2.TaskSpec()
    plain.secure_aggregation.enabled = True
    assert distributed_dp.setup_fields(layout_for(plain, ("w",), ((100,),), 4)) == {}
    assert "the aggregator adds none" in distributed_dp.describe(layout)


def test_each_round_composes_the_earlier_rounds_survivors(tmp_path):
    spec = _spec()
    layout = layout_for(spec, ("w",), ((100,),), 4)
    store = SqliteStore(tmp_path)
    try:
        manifest = ModelPackage({"w": np.zeros(100, np.float32)}).manifest()
        with store.transaction() as tx:
            model = tx.put_model(manifest)
            tx.insert_task("t", "alice", "k", spec, S.TASK_STATE_RUNNING, 1, model)
            tx.open_round("t", 1, 1, 4, 2, 9999, model)
        first = distributed_dp.round_metrics(store, spec, "t", 1, layout, 4)
        with store.transaction() as tx:
            tx.close_round("t", 1, 3, model, first, {})
            tx.open_round("t", 2, 1, 4, 4, 9999, model)
        second = distributed_dp.round_metrics(store, spec, "t", 2, layout, 3)
        with store.transaction() as tx:
            tx.close_round("t", 2, 5, model, second, {})
        mu, sens = layout.dp.site_variance, layout.dp.sensitivity
        assert first["ddp_epsilon"] == sens.epsilon([4 * mu], 1e-5)
        assert second["ddp_epsilon"] == sens.epsilon([4 * mu, 3 * mu], 1e-5) > first["ddp_epsilon"]
        assert second["ddp_noise_sites"] == 3 and second["ddp_noise_stddev"] == layout.dp.noise_stddev(3)
        rounds = status_of(store, "t").rounds
        assert [r.ddp_epsilon for r in rounds] == [first["ddp_epsilon"], second["ddp_epsilon"]]
        assert [r.ddp_noise_sites for r in rounds] == [4, 3] and rounds[1].ddp_mechanism == "skellam"
        assert rounds[1].ddp_delta == 1e-5
    finally:
        store.close()
