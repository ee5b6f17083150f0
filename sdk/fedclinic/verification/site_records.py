"""A site's reading of a task's records: ``AgentService.GetTaskRecords`` with the site's own agent certificate.

A site may read the records of the tasks it was assigned to, and nothing else: no model by round, no blob (its
peers' updates are never readable by a site). With this source :func:`fedclinic.verification.verifier.verify_task`
(``recompute=False``) checks every statement's signature, that every site of each round trained from the same
model (the split view a site most needs to see), the chain of models and the final model; it does not recompute
aggregates (the task's owner does, with ``fedclinic task verify``).
"""

from __future__ import annotations

import grpc

from fedclinic.errors import FedclinicError
from fedclinic.proto import agent_pb2_grpc, control_pb2
from fedclinic.transport.package import ModelPackage
from fedclinic.control_channel import ControlChannel
from fedclinic.transport.rpc import TlsFiles, explain_rpc_error
from fedclinic.verification.records import all_rounds


class SiteRecords:
    """The records as a site reads them (module docstring); a context manager that closes its channel."""

    def __init__(self, address: str, tls: TlsFiles, *, server_name: str | None = None) -> None:
        self.address = address
        #: several addresses (a hot-standby pair) are tried in turn (fedclinic.control_channel)
        self._conn = ControlChannel(address, tls, server_name=server_name, stub_type=agent_pb2_grpc.AgentServiceStub)

    def __enter__(self) -> "SiteRecords":
        return self

    def __exit__(self, *exc: object) -> None:
        self._conn.close()

    def task_records(self, task_id: str) -> control_pb2.TaskRecords:
        def ask(first: int) -> control_pb2.TaskRecords:
            try:
                return self._conn.retrying(lambda: self._conn.stub.GetTaskRecords(
                    control_pb2.GetTaskRecordsRequest(task_id=task_id, first_round=first), timeout=60))
            except grpc.RpcError as exc:
                raise explain_rpc_error(exc, self.address) from None

        return all_rounds(ask)

    def fetch_model(self, task_id: str, round: int) -> tuple[ModelPackage, str]:
        raise FedclinicError("a site does not fetch models to verify a task; verify with recompute=False")

    def fetch_task_blob(self, task_id: str, sha256: str) -> bytes:
        raise FedclinicError("a site reads no blob of a task's records")


__all__ = ["SiteRecords"]
