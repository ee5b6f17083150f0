"""Talking to an aggregator that the campaign kills and restarts: submit a task and read its status, each over a
fresh connection, riding out the seconds the aggregator is down."""

from __future__ import annotations

import time

import grpc

from fedclinic.errors import FedclinicError
from fedclinic.federation.local_federation import LocalFederation
from fedclinic.proto import control_pb2

from tests.helpers.text_models import tiny_package

TERMINAL = {control_pb2.TASK_STATE_COMPLETED, control_pb2.TASK_STATE_FAILED, control_pb2.TASK_STATE_CANCELLED}


def poll_status(fed: LocalFederation, task_id: str) -> control_pb2.TaskStatus | None:
    """The task's status, or None while the aggregator does not answer."""
    try:
        with fed.client() as client:
            return client.status(task_id)
    except (grpc.RpcError, FedclinicError):
        return None


def submit(fed: LocalFederation, task, package=None, timeout: float = 120) -> str:
    """Submit ``task`` (with the tiny logreg package unless ``package``); retried, with one idempotency key, until
    the aggregator answers. Returns the task id."""
    package = package if package is not None else tiny_package("logreg")
    deadline = time.monotonic() + timeout
    key = f"campaign-{time.time_ns()}"
    while True:
        try:
            with fed.client() as client:
                return client.submit(task, package=package, idempotency_key=key).task_id
        except (grpc.RpcError, FedclinicError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
