"""``hospital-agent install-service``: the filesystem layout and permissions of a systemd-managed agent.

What it lays out (under ``--root``, default ``/``), matching ``deploy/systemd/hospital-agent.service``::

    /etc/sysusers.d/hospital-agent.conf      0644  the dedicated system user (systemd-sysusers)
    /etc/hospital-agent/                     0750  root:hospital-agent (config and certificates, read-only to it)
    /etc/hospital-agent/agent.toml           0640  example configuration, only if absent
    /etc/hospital-agent/agent.env            0640  environment overrides (comments only), only if absent
    /etc/hospital-agent/*.key                0600  hospital-agent (fixed on every run: the agent must read it)
    /var/lib/hospital-agent/                 0700  hospital-agent (model cache, outbox, privacy ledger)
    /var/cache/hospital-agent/               0700  hospital-agent (library caches)
    /etc/systemd/system/hospital-agent.service 0644 the hardened unit

With ``--root /`` (a real install, as root) it also creates the user (``systemd-sysusers``, or ``useradd``
where there is no systemd-sysusers), sets owners and runs ``systemctl daemon-reload``. With another
``--root`` (staging a tree, tests) it sets modes only and says which owners to set on the target.
It never enables or starts the service: that needs the site's certificate first.
``--dry-run`` prints the same plan and changes nothing. Running it again is safe: existing configuration
is kept, modes and owners are put back.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fedclinic.runtime.durable_file import write_atomically
from fedclinic.errors import FedclinicError

USER = "hospital-agent"
UNIT_NAME = "hospital-agent.service"
SYSUSERS_LINE = f'u {USER} - "fedclinic hospital agent" /var/lib/hospital-agent /usr/sbin/nologin\n'

EXAMPLE_AGENT_TOML = """\
# /etc/hospital-agent/agent.toml, written by `hospital-agent install-service`. Fill in the values marked
# CHANGE, then check it as the agent's user:
#   sudo -u hospital-agent /opt/hospital-agent/bin/hospital-agent check-config --config /etc/hospital-agent/agent.toml
# Reference: docs/hospital-it.md ("Configure").

aggregator = "{aggregator}"   # CHANGE: host:port from your federation operator
work_dir = "/var/lib/hospital-agent"      # keep: the service may write only here (ReadWritePaths=)
device = "auto"                           # auto = first CUDA GPU when present, else CPU
mixed_precision = false
# metrics_address = "127.0.0.1:9465"      # optional Prometheus endpoint, loopback only (docs/hospital-it.md)

[tls]                                     # CHANGE: your site's files (fedclinic pki request --name {site})
cert = "/etc/hospital-agent/{site}.crt"
key = "/etc/hospital-agent/{site}.key"    # 0600, owned by hospital-agent
ca = "/etc/hospital-agent/ca.crt"

# Register each dataset tasks may use (the files must be readable by the hospital-agent user):
# [datasets.drugreviews]
# path = "/data/fl/drugreviews/train.jsonl"
# format = "jsonl"
# text_field = "text"
# label_field = "label"
# eval_path = "/data/fl/drugreviews/val.jsonl"

[policy]
allowed_families = ["text-classification"]
allowed_datasets = []                     # CHANGE: the datasets above that tasks may train on
"""

EXAMPLE_AGENT_ENV = """\
# /etc/hospital-agent/agent.env: environment for hospital-agent.service (optional).
# Any agent.toml setting can be overridden as FEDCLINIC_AGENT_<KEY>, sections joined by "__".
# Never put private keys or passwords here: point to files instead.
#FEDCLINIC_AGENT_LOG_LEVEL=debug
#FEDCLINIC_AGENT_METRICS_ADDRESS=127.0.0.1:9465
#OMP_NUM_THREADS=8
"""


class InstallError(FedclinicError):
    """The service layout cannot be installed as asked."""


@dataclass
class Step:
    description: str
    apply: Callable[[], None]


def find_unit_file(explicit: str | None) -> Path:
    """The unit file to install: ``--unit``, else the copy in a source checkout or an installed share dir."""
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise InstallError(f"unit file {path} does not exist")
        return path
    candidates = [Path(__file__).resolve().parents[1] / "deploy" / "systemd" / UNIT_NAME,
                  Path(sys.prefix) / "share" / "fedclinic" / "systemd" / UNIT_NAME]
    for path in candidates:
        if path.is_file():
            return path
    raise InstallError(f"cannot find {UNIT_NAME} (looked in {', '.join(map(str, candidates))}); pass "
                       "--unit PATH/TO/fedclinic/deploy/systemd/hospital-agent.service from the fedclinic source")


def plan(root: Path, unit_src: Path, *, site: str, aggregator: str) -> tuple[list[Step], list[str]]:
    """The steps of an install into ``root``, and notes for the operator."""
    real = root.resolve() == Path("/")
    steps: list[Step] = []
    notes: list[str] = []
    etc, state, cache = root / "etc/hospital-agent", root / "var/lib/hospital-agent", root / "var/cache/hospital-agent"
    sysusers = root / "etc/sysusers.d/hospital-agent.conf"
    unit_dst = root / "etc/systemd/system" / UNIT_NAME

    def write_file(path: Path, text: str, mode: int, *, keep_existing: bool) -> None:
        if path.exists() and keep_existing:
            return
        write_atomically(path, text.encode(), mode=mode)

    def make_dir(path: Path, mode: int) -> None:
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, mode)

    steps.append(Step(f"write {sysusers} (0644): system user {USER!r}, home /var/lib/hospital-agent, no login",
                      lambda: write_file(sysusers, SYSUSERS_LINE, 0o644, keep_existing=False)))
    if real:
        steps.append(Step(f"create system user {USER!r} if missing (systemd-sysusers, else useradd)", _ensure_user))
    steps.append(Step(f"create {etc} (0750, root:{USER}): configuration and certificates, read-only to the agent",
                      lambda: make_dir(etc, 0o750)))
    steps.append(Step(f"create {state} (0700, {USER}): work_dir (model cache, outbox, privacy ledger)",
                      lambda: make_dir(state, 0o700)))
    steps.append(Step(f"create {cache} (0700, {USER}): library caches (XDG_CACHE_HOME)",
                      lambda: make_dir(cache, 0o700)))
    toml_path, env_path = etc / "agent.toml", etc / "agent.env"
    if toml_path.exists():
        notes.append(f"kept the existing {toml_path}")
    else:
        text = EXAMPLE_AGENT_TOML.format(site=site, aggregator=aggregator)
        steps.append(Step(f"write example {toml_path} (0640): edit the lines marked CHANGE",
                          lambda: write_file(toml_path, text, 0o640, keep_existing=True)))
    if not env_path.exists():
        steps.append(Step(f"write {env_path} (0640): optional environment overrides, all commented out",
                          lambda: write_file(env_path, EXAMPLE_AGENT_ENV, 0o640, keep_existing=True)))
    unit_text = unit_src.read_text()
    if unit_dst.exists() and unit_dst.read_text() != unit_text:
        notes.append(f"replacing {unit_dst}, which differed from {unit_src}: local changes belong in a drop-in "
                     "(systemctl edit hospital-agent)")
    steps.append(Step(f"install {unit_dst} (0644) from {unit_src}",
                      lambda: write_file(unit_dst, unit_text, 0o644, keep_existing=False)))
    keys = sorted(etc.glob("*.key")) if etc.is_dir() else []
    for key in keys:
        steps.append(Step(f"set {key} to 0600" + (f", owner {USER}" if real else ""),
                          lambda key=key: os.chmod(key, 0o600)))
    if real:
        steps.append(Step(f"set owners: {etc} and its files root:{USER}, keys and {state}, {cache} {USER}:{USER}",
                          lambda: _chown_layout(etc, state, cache, keys)))
        steps.append(Step("systemctl daemon-reload (when systemd is running)", _daemon_reload))
    else:
        notes.append(f"staged under {root}: on the target machine create the user ({sysusers.relative_to(root)} "
                     f"with systemd-sysusers) and set owners: chown root:{USER} /etc/hospital-agent "
                     f"/etc/hospital-agent/agent.toml /etc/hospital-agent/agent.env; chown {USER}:{USER} "
                     "/var/lib/hospital-agent /var/cache/hospital-agent /etc/hospital-agent/*.key")
    return steps, notes


def _ensure_user() -> None:
    import pwd

    try:
        pwd.getpwnam(USER)
        return
    except KeyError:
        pass
    if shutil.which("systemd-sysusers"):
        cmd = ["systemd-sysusers", "/etc/sysusers.d/hospital-agent.conf"]
    elif shutil.which("useradd"):
        cmd = ["useradd", "--system", "--user-group", "--home-dir", "/var/lib/hospital-agent", "--no-create-home",
               "--shell", "/usr/sbin/nologin", USER]
    else:
        raise InstallError(f"cannot create user {USER!r}: neither systemd-sysusers nor useradd is installed")
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise InstallError(f"{' '.join(cmd)} failed: {done.stderr.strip() or done.stdout.strip()}")


def _chown_layout(etc: Path, state: Path, cache: Path, keys: list[Path]) -> None:
    import grp
    import pwd

    uid, gid = pwd.getpwnam(USER).pw_uid, grp.getgrnam(USER).gr_gid
    os.chown(etc, 0, gid)
    for name in ("agent.toml", "agent.env"):
        if (etc / name).exists():
            os.chown(etc / name, 0, gid)
    for path in (state, cache, *keys):
        os.chown(path, uid, gid)


def _daemon_reload() -> None:
    if shutil.which("systemctl") and Path("/run/systemd/system").is_dir():
        subprocess.run(["systemctl", "daemon-reload"], check=False)


def install_service(root: str | Path = "/", *, unit: str | None = None, dry_run: bool = False,
                    site: str = "SITE", aggregator: str = "aggregator.example.org:7443") -> int:
    root = Path(root)
    unit_src = find_unit_file(unit)
    if root.resolve() == Path("/") and not dry_run and os.geteuid() != 0:
        raise InstallError("installing into / needs root (sudo hospital-agent install-service); use --dry-run "
                           "to see the plan, or --root DIR to stage the layout into a directory")
    steps, notes = plan(root, unit_src, site=site, aggregator=aggregator)
    for step in steps:
        if dry_run:
            print(f"would {step.description}")
            continue
        try:
            step.apply()
        except OSError as exc:
            raise InstallError(f"could not {step.description}: {exc.strerror or exc}") from exc
        print(f"done: {step.description}")
    for note in notes:
        print(f"note: {note}")
    if not dry_run:
        print("next: put the site key and certificates in /etc/hospital-agent (docs/hospital-it.md), edit agent.toml, "
              "run check-config as the hospital-agent user, then: systemctl enable --now hospital-agent")
    return 0
