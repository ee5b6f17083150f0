"""A hot-standby pair of aggregators for the tests (aggregator_service.leader_election): the federation's own
aggregator plus extra replicas on the same PostgreSQL database and the same state folder, and their health."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from fedclinic.federation.local_federation import LocalFederation, to_toml
from fedclinic.transport.rpc import TlsFiles, secure_channel

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def start_replica(fed: LocalFederation, name: str, port: int) -> subprocess.Popen:
    """Start another aggregator replica of ``fed`` (its aggregator.toml: same database, same state folder) listening
    on 127.0.0.1:``port``; its log is ``aggregator-<name>.log``."""
    cfg = tomllib.loads((fed.root / "aggregator.toml").read_text())
    cfg["listen"] = f"127.0.0.1:{port}"
    path = fed.root / f"aggregator-{name}.toml"
    path.write_text(to_toml(cfg))
    return fed._spawn(["-m", "aggregator_service.cli", "serve", "--config", str(path)], f"aggregator-{name}.log",
                      fed._env())


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
