"""Wires the aggregator together: store, blob store, engine, gRPC services, health, signals."""

from __future__ import annotations

import json
import os
import signal
import threading
from concurrent import futures

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedclinic.blobstore import BlobStore
from fedclinic.pki import RevocationList
from fedclinic.proto import agent_pb2_grpc, control_pb2_grpc
from fedclinic.rpc import SERVER_OPTIONS, server_credentials

from aggregator_service.agent_api import AgentApi
from aggregator_service.audit_trail import AuditTrail
from aggregator_service.auth import AuthInterceptor
from aggregator_service.config import AggregatorConfig
from aggregator_service.control_api import ControlApi
from aggregator_service.engine import Engine
from aggregator_service.store import Store

log = structlog.get_logger("fedclinic.aggregator")

ADDRESS_FILE = "aggregator.addr"


class Aggregator:
    def __init__(self, config: AggregatorConfig) -> None:
        self.config = config
        self.store = Store(config.state_dir)
        #: STATE_DIR/audit.jsonl (aggregator_service.audit_trail): task events after they commit, connections,
        #: downloads, refused certificates
        self.audit = AuditTrail(config.state_dir / "audit.jsonl")
        self.store.on_commit = self.audit.on_commit
        self.blobs = BlobStore(config.state_dir / "blobs")
        self.engine = Engine(self.store, self.blobs)
        revocations = RevocationList(config.crl, config.tls.ca) if config.crl else None
        self.health = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="rpc"),
                                  interceptors=[AuthInterceptor(revocations, on_refusal=self._refused)], options=SERVER_OPTIONS)
        agent_pb2_grpc.add_AgentServiceServicer_to_server(AgentApi(self.engine, config.heartbeat_s, audit=self.audit), self.server)
        control_pb2_grpc.add_ControlServicer_to_server(ControlApi(self.engine, audit=self.audit), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_secure_port(config.listen, server_credentials(config.tls))
        if self.port == 0:
            raise OSError(f"cannot listen on {config.listen} (address in use or not allowed)")
        self._stopped = threading.Event()

    def _refused(self, who: str, reason: str, method: str) -> None:
        self.audit.record("auth.refused", actor=who, method=method, reason=reason)

    @property
    def address(self) -> str:
        host = self.config.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    def start(self) -> None:
        self.engine.start()
        self.server.start()
        for name in ("", "fedclinic.v1.AgentService", "fedclinic.v1.Control"):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        addr_file = self.config.state_dir / ADDRESS_FILE
        tmp = addr_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"address": self.address, "pid": os.getpid()}))
        os.replace(tmp, addr_file)
        log.info("aggregator listening", address=self.address, state_dir=str(self.config.state_dir))

    def stop(self, grace: float = 10.0) -> None:
        """Graceful stop: report NOT_SERVING, end streams, let in-flight calls finish within ``grace``."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        log.info("aggregator stopping", grace_s=grace)
        self.health.enter_graceful_shutdown()
        self.engine.stop()
        self.server.stop(grace).wait()
        self.store.close()
        self.audit.close()
        (self.config.state_dir / ADDRESS_FILE).unlink(missing_ok=True)
        log.info("aggregator stopped")

    def serve_forever(self) -> None:
        done = threading.Event()

        def on_signal(signum, _frame):
            log.info("signal received", signal=signal.Signals(signum).name)
            done.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        self.start()
        done.wait()
        self.stop()
