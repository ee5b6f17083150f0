"""A hot-standby pair of aggregators for the tests (aggregator_service.leader_election): the federation's own
aggregator plus extra replicas on the same PostgreSQL database and the same state folder, and their health."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aggregator_service.leader_election import HA_CLASS, HA_OBJECT
from fedclinic.federation.local_federation import LocalFederation, to_toml
from fedclinic.transport.rpc import TlsFiles, secure_channel

from tests.helpers.postgres_server import PostgresServer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def start_replica(fed: LocalFederation, name: str, port: int) -> subprocess.Popen:
    """Start another aggregator replica of ``fed`` (its aggregator.toml: same database, same state folder) listening
    on 127.0.0.1:``port``; its log is ``aggregator-<name>.log``. It is stopped with the federation (it is kept
    among ``fed.agents`` as ``aggregator-<name>``, whose processes ``fed.close()`` stops)."""
    cfg = tomllib.loads((fed.root / "aggregator.toml").read_text())
    cfg["listen"] = f"127.0.0.1:{port}"
    path = fed.root / f"aggregator-{name}.toml"
    path.write_text(to_toml(cfg))
    proc = fed._spawn(["-m", "aggregator_service.cli", "serve", "--config", str(path)], f"aggregator-{name}.log",
                      fed._env())
    fed.agents[f"aggregator-{name}"] = proc
    return proc


def end_leader_lock_session(server: PostgresServer, database: str) -> list[tuple[object, ...]]:
    """Terminate the PostgreSQL session that holds the leader lock of ``database`` (what a network partition
    between the leader and the database does to it): the leader must fence itself, a standby takes over."""
    return server.admin_sql(f"SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
                            f"AND classid = {HA_CLASS} AND objid = {HA_OBJECT} AND objsubid = 2 AND granted",
                            database)


def health(fed: LocalFederation, address: str) -> int | None:
    """The gRPC health status of the aggregator at ``address`` ("" service), None when it does not answer."""
    c = fed.creds("scientist")
    channel = secure_channel(address, TlsFiles(Path(c["cert"]), Path(c["key"]), Path(c["ca"])),
                             server_name="localhost")
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
    except grpc.RpcError:
        return None
    finally:
        channel.close()
