"""The prediction pool runs at most `workers` jobs with at most `queue` waiting, and refuses the next at once."""

from __future__ import annotations

import asyncio
import threading

import pytest

from fedclinic.serving.work_pool import PoolFull, WorkPool


def test_a_full_pool_refuses_at_once_and_frees_places_as_jobs_end():
    pool = WorkPool(workers=1, queue=1)
    release = threading.Event()
    running = pool.submit(release.wait, 30)
    waiting = pool.submit(lambda: "queued")
    with pytest.raises(PoolFull, match="1 predictions are running and 1 are waiting"):
        pool.submit(lambda: "third")
    release.set()
    assert running.result(timeout=30) is True and waiting.result(timeout=30) == "queued"
    assert asyncio.run(pool.run_async(lambda: 7)) == 7  # places came back
    assert pool.run(lambda: 8) == 8
    pool.shutdown()


def test_a_failing_job_frees_its_place():
    pool = WorkPool(workers=1, queue=0)

    def boom():
        raise ValueError("bad input")

    for _ in range(3):
        with pytest.raises(ValueError):
            pool.run(boom)
    pool.shutdown()
