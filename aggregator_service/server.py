"""Wires the aggregator together: store, blob store, engine, gRPC services, health, signals."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Sequence
from concurrent import futures

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from fedclinic.runtime.blobstore import BlobStore
from fedclinic.runtime.metrics_endpoint import MetricsServer
from fedclinic.pki import RevocationList
from fedclinic.pki.signed_statement import Signer
from fedclinic.proto import agent_pb2_grpc, control_pb2_grpc
from fedclinic.pki.credentials import WatchedCredentials, reloading_server_credentials
from fedclinic.transport.rpc import SERVER_OPTIONS

from aggregator_service.agent_api import AgentApi
from aggregator_service.audit_trail import AuditTrail
from aggregator_service.auth import AuthInterceptor
from aggregator_service.config import AggregatorConfig
from aggregator_service.control_api import ControlApi
from aggregator_service.engine import Engine
from aggregator_service.leader_election import LeaderElection, NotLeader, StandbyGate
from aggregator_service.metrics import AggregatorMetrics
from aggregator_service.peer_limits import PeerLimits
from aggregator_service.rpc_errors import ErrorInterceptor
from aggregator_service.store import SCHEMA_VERSION, StoreError, open_store

log = structlog.get_logger("fedclinic.aggregator")

ADDRESS_FILE = "aggregator.addr"
#: the newest CRL version this aggregator has used (fedclinic.pki.RevocationList high_water): an older CRL is refused
CRL_HIGH_WATER = "crl-high-water.json"


class Aggregator:
    def __init__(self, config: AggregatorConfig, *, interceptors: Sequence[grpc.ServerInterceptor] = ()) -> None:
        """``interceptors`` run after fedclinic's own (auth, errors, limits), nearest the services: an embedding
        process's additions (the test suite's malicious aggregator, tests/helpers/malicious_aggregator.py)."""
        config.require_crl_or_dev_mode()  # before anything is created: no CRL and no dev switch is refused
        self.config = config
        # a standby (HA) writes nothing to the shared database until it is elected: a newer release's standby must
        # not migrate the schema under an older leader that still serves (a rolling upgrade); it migrates in _take_over
        self.store = open_store(config.state, config.state_dir, prepare=not config.ha.enabled)
        #: STATE_DIR/audit.jsonl (aggregator_service.audit_trail): task events after they commit, connections,
        #: downloads, refused certificates
        self.audit = AuditTrail(config.state_dir / "audit.jsonl")
        #: Prometheus metrics (aggregator_service.metrics), served on config.metrics_address when set
        self.metrics = AggregatorMetrics()
        self.store.on_commit = self._committed
        self.blobs = BlobStore(config.state_dir / "blobs")
        self.engine = Engine(self.store, self.blobs, metrics=self.metrics)
        self.engine.admission.ca_path = config.tls.ca  # the sites' round statements are checked against it
        self.metrics_server: MetricsServer | None = None
        #: the CRL, re-read when the file changes (every call checks it; open streams before each message); never
        #: replaced by an older one, nor started from one older than the newest this state folder has used
        self.revocations = (RevocationList(config.crl, config.tls.ca, high_water=config.state_dir / CRL_HIGH_WATER)
                            if config.crl else None)
        revocations = self.revocations
        #: the server certificate, key and CA, followed on disk: new TLS handshakes get a renewed certificate
        self.credentials = WatchedCredentials(config.tls, role="aggregator")
        self.health = health.HealthServicer()
        #: per-peer limits (aggregator_service.peer_limits): calls per certificate and class, long-lived calls of all
        #: peers (unary calls always find a thread), field lengths, idle client streams
        self.peer_limits = PeerLimits(config.limits, config.max_workers, count=self.metrics.limit_refused)
        #: hot standby ([ha], aggregator_service.leader_election): refuses all but health until elected
        self.gate: StandbyGate | None = None
        self.election: LeaderElection | None = None
        self._fenced = threading.Event()
        self._fence_reason = ""
        if config.ha.enabled:
            self.gate = StandbyGate("this aggregator is the standby replica (another replica is the leader): "
                                    "try the next aggregator address")
            self.election = LeaderElection(config.state, config.ha.poll_s, on_elected=self._take_over,
                                           on_lost=self._fence)
            self.store.fence = self.election.fence  # type: ignore[attr-defined]  # PostgresStore (config checks)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="rpc"),
                                  interceptors=[AuthInterceptor(revocations, on_refusal=self._refused,
                                                                count_refusal=self.metrics.call_refused),
                                                *([self.gate] if self.gate is not None else []),
                                                # outside the limits: a request that does not parse is refused
                                                # before they read it, and no failure reaches a caller as UNKNOWN
                                                ErrorInterceptor(),
                                                self.peer_limits, *interceptors],
                                  options=SERVER_OPTIONS,
                                  maximum_concurrent_rpcs=config.limits.concurrent_rpcs(config.max_workers))
        agent_pb2_grpc.add_AgentServiceServicer_to_server(AgentApi(self.engine, config.heartbeat_s, audit=self.audit), self.server)
        control_pb2_grpc.add_ControlServicer_to_server(ControlApi(self.engine, audit=self.audit, limits=config.limits,
                                                                  signer=Signer(key_path=config.tls.key,
                                                                                cert_path=config.tls.cert),
                                                                  ca_path=config.tls.ca),
                                                       self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_secure_port(config.listen, reloading_server_credentials(self.credentials))
        if self.port == 0:
            raise OSError(f"cannot listen on {config.listen} (address in use or not allowed)")
        self._stopped = threading.Event()

    def reload_credentials(self) -> None:
        """SIGHUP: look at the certificate files and the CRL now and log what is in use. (Both are also picked
        up without it: the certificate at the next TLS handshake, the CRL at the next call or stream message.)"""
        changed = self.credentials.poll(force=True)
        ident = self.credentials.current.identity
        crl = "NOT CONFIGURED (allow_no_crl): revoked certificates are accepted"
        if self.revocations is not None:
            crl = "reloaded" if self.revocations.reload_if_changed() else "unchanged"
            if self.revocations.last_error:
                crl = f"kept the previous list: {self.revocations.last_error}"
        log.info("reload requested", certificate="reloaded" if changed else "unchanged",
                 certificate_problem=self.credentials.last_error, serial=ident.serial_hex if ident else None,
                 not_after=ident.not_after.isoformat() if ident else None, crl=crl,
                 revoked=len(self.revocations.serials) if self.revocations is not None else 0)

    def _committed(self, events: list[dict]) -> None:
        self.audit.on_commit(events)
        self.metrics.on_commit(events)

    def _refused(self, who: str, reason: str, method: str) -> None:
        self.audit.record("auth.refused", actor=who, method=method, reason=reason)

    @property
    def address(self) -> str:
        host = self.config.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    def start(self) -> None:
        if self.config.metrics_address is not None:  # first: a port in use fails the start before anything runs
            self.metrics_server = MetricsServer(self.metrics.registry, self.config.metrics_address)
        if self.election is not None:
            self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            self.server.start()
            log.info("aggregator listening as standby: waiting for the leader lock", address=self.address,
                     state_dir=str(self.config.state_dir), poll_s=self.config.ha.poll_s)
            self.election.start()
            return
        self.engine.start()
        self.server.start()
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        self._publish()

    def _set_health(self, status: int) -> None:
        for name in ("", "fedclinic.v1.AgentService", "fedclinic.v1.Control"):
            self.health.set(name, status)

    def _take_over(self) -> None:
        """Elected (HA): migrate the database to this release's schema if it is older (the standby wrote nothing
        while it waited; a rolling upgrade migrates here, once the older leader is gone), recover as a restarted
        aggregator does, then serve. A database a newer release migrated while this replica waited is not served
        (NotLeader: the replica fences itself and exits; restarted, the store refuses a newer schema with its own
        message)."""
        found = self.store.schema_version
        try:  # migrate_postgres refuses a newer schema (written by a newer release while this replica waited)
            self.store.prepare()  # type: ignore[attr-defined]  # HA runs on PostgreSQL only (HaSettings)
        except StoreError as exc:
            raise NotLeader(f"cannot lead with this release: {exc}; run the same release on every replica") from None
        if found < SCHEMA_VERSION:
            log.info("elected: the database was migrated for this release", from_version=found,
                     to_version=SCHEMA_VERSION)
        self.engine.start()
        assert self.gate is not None
        self.gate.open.set()
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving as leader", address=self.address)
        self._publish()

    def _fence(self, reason: str) -> None:
        """Lost the leader lock (HA): refuse every call, report NOT_SERVING, and make serve_forever stop."""
        if self.gate is not None:
            self.gate.open.clear()
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._fence_reason = reason
        log.error("FENCED: no longer the leader, refusing all calls and stopping", reason=reason)
        self._fenced.set()

    def _publish(self) -> None:
        published = {"address": self.address, "pid": os.getpid()}
        if self.metrics_server is not None:
            published["metrics_address"] = str(self.metrics_server.address)
            log.info("metrics endpoint listening", url=self.metrics_server.url,
                     **({} if self.metrics_server.loopback else
                        {"warning": "reachable from other machines: limit who may connect (firewall, NetworkPolicy)"}))
        addr_file = self.config.state_dir / ADDRESS_FILE
        tmp = addr_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(published))
        os.replace(tmp, addr_file)
        if self.revocations is None:
            log.warning("NO REVOCATION LIST: [tls] allow_no_crl = true, revoked certificates are accepted; "
                        "development only, set [tls] crl for any real deployment")
        else:
            log.info("revocation list in use", path=str(self.revocations.crl_path), revoked=len(self.revocations.serials),
                     crl_number=self.revocations.version.number)
        log.info("aggregator listening", address=self.address, state_dir=str(self.config.state_dir))

    def stop(self, grace: float = 10.0) -> None:
        """Graceful stop: report NOT_SERVING, end streams, let in-flight calls finish within ``grace``."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        log.info("aggregator stopping", grace_s=grace)
        self.health.enter_graceful_shutdown()
        if self.election is not None:
            self.election.stop()
        self.engine.stop()
        self.server.stop(grace).wait()
        if self.metrics_server is not None:
            self.metrics_server.close()
        self.store.close()
        self.audit.close()
        if self.election is None or self.election.elected.is_set():  # a standby never published (HA: shared dir)
            (self.config.state_dir / ADDRESS_FILE).unlink(missing_ok=True)
        log.info("aggregator stopped")

    def serve_forever(self) -> None:
        """Serve until SIGTERM/SIGINT; SIGHUP reloads certificates and CRL (:meth:`reload_credentials`)."""
        done = threading.Event()
        reload = threading.Event()

        def on_signal(signum, _frame):
            log.info("signal received", signal=signal.Signals(signum).name)
            (reload if signum == signal.SIGHUP else done).set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGHUP, on_signal)
        self.start()
        while not done.is_set() and not self._fenced.is_set():
            if reload.wait(0.5):
                reload.clear()
                self.reload_credentials()
        self.stop(grace=0.0 if self._fenced.is_set() else 10.0)
        if self._fenced.is_set():
            raise NotLeader(f"stopped: no longer the leader ({self._fence_reason}); restart it to rejoin as standby")
