"""Aggregator configuration: ``aggregator.toml`` plus ``FEDCLINIC_AGGREGATOR_*`` environment overrides.

Example::

    listen = "0.0.0.0:7443"
    state_dir = "/var/lib/fedclinic-aggregator"
    log_level = "info"
    max_workers = 64          # gRPC threads: one per connected agent stream plus headroom
    heartbeat_s = 15

    [tls]
    cert = "/etc/fedclinic/aggregator.crt"
    key = "/etc/fedclinic/aggregator.key"
    ca = "/etc/fedclinic/ca.crt"
    crl = "/etc/fedclinic/crl.pem"   # optional; reloaded when it changes

Override any value from the environment, e.g. ``FEDCLINIC_AGGREGATOR_LISTEN=127.0.0.1:0`` or
``FEDCLINIC_AGGREGATOR_TLS__CRL=/path/crl.pem``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fedclinic.errors import ConfigError
from fedclinic.rpc import TlsFiles
from fedclinic.tomlconfig import env_overrides, load_toml, require

ENV_PREFIX = "FEDCLINIC_AGGREGATOR"


@dataclass(frozen=True)
class AggregatorConfig:
    listen: str
    state_dir: Path
    tls: TlsFiles
    crl: Path | None
    log_level: str = "info"
    max_workers: int = 64
    heartbeat_s: float = 15.0

    @classmethod
    def load(cls, path: str | Path) -> "AggregatorConfig":
        doc = env_overrides(load_toml(path), ENV_PREFIX)
        base = Path(path).resolve().parent
        src = str(path)

        def p(value: str) -> Path:
            q = Path(value).expanduser()
            return q if q.is_absolute() else base / q

        tls = TlsFiles(p(require(doc, "tls.cert", str, src)), p(require(doc, "tls.key", str, src)),
                       p(require(doc, "tls.ca", str, src)))
        crl = doc.get("tls", {}).get("crl")
        max_workers = int(doc.get("max_workers", 64))
        if max_workers < 4:
            raise ConfigError(f"{src}: max_workers must be at least 4")
        return cls(listen=require(doc, "listen", str, src), state_dir=p(require(doc, "state_dir", str, src)),
                   tls=tls, crl=p(crl) if crl else None, log_level=str(doc.get("log_level", "info")),
                   max_workers=max_workers, heartbeat_s=float(doc.get("heartbeat_s", 15.0)))
