"""The bounded pool in which ``fedclinic serve`` does its model work (parsing, decoding, predicting).

A fixed number of threads (``workers``) run predictions; at most ``queue`` more wait for one. A request that
finds all ``workers + queue`` places taken is refused at once with :class:`PoolFull` (HTTP 503 with
``Retry-After``, gRPC RESOURCE_EXHAUSTED) instead of piling up threads, memory and latency. The HTTP and gRPC
ports share one pool, so the bound holds for the process.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

from fedclinic.errors import FedclinicError

T = TypeVar("T")


class PoolFull(FedclinicError):
    """Every worker is busy and the queue is full: retry later (HTTP 503, gRPC RESOURCE_EXHAUSTED)."""


class WorkPool:
    """``workers`` threads and a queue of at most ``queue`` waiting jobs."""

    def __init__(self, workers: int, queue: int) -> None:
        if workers < 1 or queue < 0:
            raise ValueError(f"a work pool needs >= 1 worker and a queue >= 0, got {workers} and {queue}")
        self.workers = workers
        self.queue = queue
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="fedclinic-predict")
        self._places = threading.BoundedSemaphore(workers + queue)

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Start ``fn(*args)`` in the pool; :class:`PoolFull` when ``workers + queue`` jobs are already in it."""
        if not self._places.acquire(blocking=False):
            raise PoolFull(f"the server is busy: {self.workers} predictions are running and {self.queue} are waiting "
                           "(fedclinic serve --inference-workers/--inference-queue); retry in a moment")

        def job() -> T:
            try:
                return fn(*args)
            finally:
                self._places.release()  # before the result is visible: a caller that saw it finds the place free

        try:
            return self._executor.submit(job)
        except BaseException:
            self._places.release()
            raise

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in the pool, waiting for its result (for the gRPC servicer's threads)."""
        return self.submit(fn, *args).result()

    async def run_async(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` in the pool, awaited (for the HTTP app). A cancelled caller does not cancel a job that
        has started: its place is freed when the job ends."""
        return await asyncio.wrap_future(self.submit(fn, *args))

    def shutdown(self) -> None:
        """Let running and queued jobs finish, then stop the threads."""
        self._executor.shutdown(wait=True)
