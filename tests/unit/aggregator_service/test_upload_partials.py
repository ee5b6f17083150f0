"""The kept prefixes of interrupted uploads are bounded: per site in count and bytes, expired, never kept for a
closed round, and resumed only with the header they began with and within what is held."""

from __future__ import annotations

import os

import grpc
import pytest

from fedclinic.errors import Refused
from fedclinic.proto import agent_pb2, tensors_pb2

from aggregator_service.upload_partials import PartialLimits, UploadPartials, replay


def _header(upload_id: str, task: str = "t-1", rnd: int = 1, nbytes: int = 64) -> agent_pb2.UpdateHeader:
    h = agent_pb2.UpdateHeader(task_id=task, round=rnd, idempotency_key=upload_id, upload_id=upload_id, num_samples=1)
    h.tensors.append(tensors_pb2.TensorHeader(name="w", dtype="float32", shape=[nbytes // 4], codec="raw",
                                              sha256="0" * 64, encoded_nbytes=nbytes))
    return h


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup(tmp_path):
    clock = Clock()
    open_rounds = {("t-1", 1), ("t-2", 1)}
    partials = UploadPartials(tmp_path / "spill", lambda t, r: (t, r) in open_rounds,
                              PartialLimits(per_site=2, per_site_bytes=100, expire_s=60), clock=clock)
    counter = [0]

    def prefix(nbytes: int):
        counter[0] += 1
        path = tmp_path / f"prefix-{counter[0]}.part"
        path.write_bytes(bytes(range(nbytes)))
        os.utime(path, (clock.now, clock.now))
        return path

    return partials, clock, prefix, open_rounds


def test_a_kept_prefix_is_held_for_its_site_only_and_taken_once(setup):
    partials, _, prefix, _ = setup
    h = _header("u1")
    assert partials.keep("site-a", h, prefix(24)) == 24
    assert partials.held("site-a", "t-1", "u1")[0] == 24
    assert partials.held("site-b", "t-1", "u1") == (0, 0)  # another site's certificate sees nothing
    h.resume_offset = 16
    taken = partials.take("site-a", h)
    assert taken is not None and taken.read_bytes()[:16] == bytes(range(16))
    assert partials.held("site-a", "t-1", "u1") == (0, 0)  # claimed: no second stream can take it
    chunks = list(replay(taken, h, 16))
    assert [(c.tensor.offset, len(c.tensor.data)) for c in chunks] == [(0, 16)]


def test_a_resume_beyond_what_is_held_or_with_another_header_is_refused(setup):
    partials, _, prefix, _ = setup
    partials.keep("site-a", _header("u1"), prefix(24))
    beyond = _header("u1")
    beyond.resume_offset = 28
    with pytest.raises(Refused) as exc:
        partials.take("site-a", beyond)
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION and "holds 24 verified bytes" in exc.value.message
    other = _header("u1")
    other.num_samples = 7
    other.resume_offset = 8
    with pytest.raises(Refused) as exc:
        partials.take("site-a", other)
    assert "another header" in exc.value.message
    assert partials.held("site-a", "t-1", "u1") == (0, 0)  # dropped


def test_per_site_count_and_byte_limits_drop_the_oldest(setup):
    partials, clock, prefix, _ = setup
    for i in range(3):
        clock.now += 1
        partials.keep("site-a", _header(f"u{i}"), prefix(30))
    assert partials.held("site-a", "t-1", "u0") == (0, 0)  # 3 > per_site=2: the oldest went
    assert partials.held("site-a", "t-1", "u2")[0] == 30
    clock.now += 1
    partials.keep("site-a", _header("u3", nbytes=80), prefix(80))  # 30 + 80 > 100 bytes: u1 goes too... and u2
    assert partials.held("site-a", "t-1", "u3")[0] == 80
    assert partials.held("site-a", "t-1", "u2") == (0, 0) and partials.held("site-a", "t-1", "u1") == (0, 0)
    assert partials.keep("site-a", _header("big", nbytes=200), prefix(120)) == 0  # over the whole allowance
    assert partials.keep("site-b", _header("u1"), prefix(30)) == 30  # limits are per site


def test_prefixes_expire_and_are_not_kept_for_a_closed_round(setup):
    partials, clock, prefix, open_rounds = setup
    partials.keep("site-a", _header("u1"), prefix(24))
    clock.now += 61
    assert partials.held("site-a", "t-1", "u1") == (0, 0)
    open_rounds.discard(("t-2", 1))
    assert partials.keep("site-a", _header("u2", task="t-2"), prefix(24)) == 0
