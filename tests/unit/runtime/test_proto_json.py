"""--json outputs: every 64-bit integer field is a JSON number (json_format writes them as strings)."""

from __future__ import annotations

import json

from google.protobuf import json_format

from fedclinic.proto import control_pb2, task_pb2
from fedclinic.runtime.proto_json import message_to_dict, message_to_json


def _status() -> control_pb2.TaskStatus:
    st = control_pb2.TaskStatus(task_id="t-1", created_unix_ms=1_700_000_000_123, current_round=2,
                                spec=task_pb2.TaskSpec(name="x", training=task_pb2.TrainingConfig(seed=-(1 << 62)),
                                                       strategy_params={"beta": 0.5}))
    r = st.rounds.add(round=1, uplink_bytes=(1 << 53) + 1, closed_unix_ms=5)
    r.metrics["loss"] = 0.25
    r.reports.add(site_id="a", num_samples=7)
    r.reports.add(site_id="b", num_samples=9)
    return st


def test_int64_fields_at_any_depth_are_numbers_and_exact():
    st = _status()
    assert json_format.MessageToDict(st)["createdUnixMs"] == "1700000000123"  # what json_format alone gives
    doc = json.loads(message_to_json(st))
    assert doc["created_unix_ms"] == 1_700_000_000_123 and doc["current_round"] == 2
    assert doc["spec"]["training"]["seed"] == -(1 << 62)
    assert doc["rounds"][0]["uplink_bytes"] == (1 << 53) + 1  # above 2**53: still exact
    assert [r["num_samples"] for r in doc["rounds"][0]["reports"]] == [7, 9]
    assert doc["rounds"][0]["metrics"] == {"loss": 0.25} and doc["spec"]["strategy_params"] == {"beta": 0.5}


def test_the_rest_is_json_formats_mapping():
    st = _status()
    doc = message_to_dict(st)
    plain = json_format.MessageToDict(st, preserving_proto_field_name=True)
    assert set(doc) == set(plain) and doc["task_id"] == plain["task_id"]
