"""Aggregator configuration: ``aggregator.toml`` plus ``FEDCLINIC_AGGREGATOR_*`` environment overrides.

Example::

    listen = "0.0.0.0:7443"
    state_dir = "/var/lib/fedclinic-aggregator"
    log_level = "info"
    max_workers = 256         # gRPC threads: 2 per agent + watching scientists + [limits] unary_reserve
    heartbeat_s = 15
    metrics_address = "127.0.0.1:9464"   # optional: Prometheus endpoint (HTTP GET /metrics); off when absent

    [tls]
    cert = "/etc/fedclinic/aggregator.crt"
    key = "/etc/fedclinic/aggregator.key"
    ca = "/etc/fedclinic/ca.crt"
    crl = "/etc/fedclinic/crl.pem"   # required (see allow_no_crl); reloaded when it changes, never rolled back
    # allow_no_crl = true            # development only: start without a CRL (revoked certificates are accepted)

    [state]                          # optional: the state in PostgreSQL instead of STATE_DIR/aggregator.sqlite
    database = "postgresql://fedclinic@db:5432/fedclinic"   # aggregator_service.store.database_settings
    database_password_file = "/run/secrets/db-password"     # or FEDCLINIC_DATABASE_PASSWORD; never in the TOML

    [ha]                             # optional: hot standby (aggregator_service.leader_election.HaSettings)
    enabled = true                   # replicas on one PostgreSQL + one shared state_dir; one leader serves

    [limits]                         # optional: per-peer limits (aggregator_service.limits.Limits, all keys)
    uploads_per_peer = 4
    idle_timeout_s = 60

Without ``crl`` the aggregator refuses to start unless ``allow_no_crl = true`` (then it logs a warning at start).
A CRL older than the newest one it has used (``STATE_DIR/crl-high-water.json``) is refused at start and at reload.

Override any value from the environment, e.g. ``FEDCLINIC_AGGREGATOR_LISTEN=127.0.0.1:0`` or
``FEDCLINIC_AGGREGATOR_TLS__CRL=/path/crl.pem``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from fedclinic.errors import ConfigError
from fedclinic.runtime.metrics_endpoint import MetricsAddress, parse_metrics_address
from fedclinic.transport.rpc import TlsFiles
from fedclinic.runtime.tomlconfig import env_overrides, load_toml, refuse_unknown, require

from aggregator_service.leader_election import HaSettings
from aggregator_service.limits import Limits
from aggregator_service.store.database_settings import DatabaseSettings

ENV_PREFIX = "FEDCLINIC_AGGREGATOR"
#: the settings aggregator.toml may hold; anything else is refused (a misspelt ``[tls] crl`` must not silently
#: turn revocation checks off)
KEYS = ("listen", "state_dir", "log_level", "max_workers", "heartbeat_s", "metrics_address", "tls", "limits", "state", "ha")
TLS_KEYS = ("cert", "key", "ca", "crl", "allow_no_crl")


@dataclass(frozen=True)
class AggregatorConfig:
    listen: str
    state_dir: Path
    tls: TlsFiles
    crl: Path | None
    #: development only: serve without a CRL (revoked certificates are accepted); without it, no ``crl`` is refused
    allow_no_crl: bool = False
    log_level: str = "info"
    max_workers: int = 256
    heartbeat_s: float = 15.0
    #: where the Prometheus endpoint listens (fedclinic.runtime.metrics_endpoint); None: no endpoint
    metrics_address: MetricsAddress | None = None
    #: per-peer limits (aggregator_service.limits): the ``[limits]`` table
    limits: Limits = Limits()
    #: where the state is kept (the ``[state]`` table): the embedded SQLite database by default, or PostgreSQL
    state: DatabaseSettings = DatabaseSettings()
    #: hot standby (the ``[ha]`` table, aggregator_service.leader_election): off by default
    ha: HaSettings = HaSettings()

    @classmethod
    def load(cls, path: str | Path) -> "AggregatorConfig":
        doc = env_overrides(load_toml(path), ENV_PREFIX)
        base = Path(path).resolve().parent
        src = str(path)

        def p(value: str) -> Path:
            q = Path(value).expanduser()
            return q if q.is_absolute() else base / q

        refuse_unknown(doc, KEYS, src, ENV_PREFIX)
        tls = TlsFiles(p(require(doc, "tls.cert", str, src)), p(require(doc, "tls.key", str, src)),
                       p(require(doc, "tls.ca", str, src)))
        refuse_unknown(doc["tls"], TLS_KEYS, f"{src}: [tls]", ENV_PREFIX)
        crl = doc.get("tls", {}).get("crl")
        allow_no_crl = doc["tls"].get("allow_no_crl", False)
        if not isinstance(allow_no_crl, bool):
            raise ConfigError(f"{src}: [tls] allow_no_crl must be true or false, got {allow_no_crl!r}")
        max_workers = int(doc.get("max_workers", 256))
        if max_workers < 4:
            raise ConfigError(f"{src}: max_workers must be at least 4")
        limits = Limits.from_table(doc.get("limits"), src)
        limits.check(max_workers, src)
        state = DatabaseSettings.from_table(doc.get("state"), src, base)
        return cls(listen=require(doc, "listen", str, src), state_dir=p(require(doc, "state_dir", str, src)),
                   tls=tls, crl=p(crl) if crl else None, allow_no_crl=allow_no_crl, log_level=str(doc.get("log_level", "info")),
                   max_workers=max_workers, heartbeat_s=float(doc.get("heartbeat_s", 15.0)),
                   metrics_address=parse_metrics_address(doc.get("metrics_address"), src), limits=limits,
                   state=state, ha=HaSettings.from_table(doc.get("ha"), src, state))

    def require_crl_or_dev_mode(self, where: str = "aggregator.toml") -> None:
        """Refuse to serve without a CRL unless ``[tls] allow_no_crl = true`` says it is a development setup."""
        if self.crl is None and not self.allow_no_crl:
            raise ConfigError(
                f"{where}: no revocation list configured ([tls] crl), so revoked certificates would be accepted; "
                "refusing to start. Set [tls] crl to the crl.pem of the fedclinic CA (written by `fedclinic pki "
                "init-ca`, updated by `fedclinic pki revoke` and `refresh-crl`), or, for development only, set "
                "[tls] allow_no_crl = true (FEDCLINIC_AGGREGATOR_TLS__ALLOW_NO_CRL=true)")

    def with_metrics_address(self, value: str, where: str) -> "AggregatorConfig":
        """This configuration with the Prometheus endpoint at ``value`` (e.g. from the command line; "" = off)."""
        return replace(self, metrics_address=parse_metrics_address(value, where))
