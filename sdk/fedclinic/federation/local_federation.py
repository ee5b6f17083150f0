"""A federation on one machine: a throwaway PKI, the aggregator and hospital agents as real processes on
127.0.0.1. Used by ``fedclinic demo`` and by the integration tests; nothing here is a mock.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

from fedclinic.errors import FedclinicError
from fedclinic import pki
from fedclinic.federation.fork_server import ForkedProcess, ForkServer
from fedclinic.runtime.cpu_cores import cores_per_process


@dataclass
class SiteSetup:
    name: str
    datasets: dict[str, dict[str, Any]] = field(default_factory=dict)   # [datasets.NAME] tables
    policy: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)                  # other agent.toml settings


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def _toml_key(key: str) -> str:
    """``key`` bare when TOML allows it (letters, digits, ``_``, ``-``), else quoted (e.g. a FHIR "system|code")."""
    return key if key and all(c.isascii() and (c.isalnum() or c in "_-") for c in key) else json.dumps(key)


def to_toml(doc: dict[str, Any]) -> str:
    """Minimal TOML writer for our flat configs (scalars, lists, nested tables)."""
    lines: list[str] = []
    tables: list[tuple[str, dict]] = []
    for k, v in doc.items():
        if isinstance(v, dict):
            tables.append((k, v))
        else:
            lines.append(f"{_toml_key(k)} = {_toml_value(v)}")

    def emit(prefix: str, table: dict) -> None:
        lines.append(f"\n[{prefix}]")
        sub = []
        for k, v in table.items():
            if isinstance(v, dict):
                sub.append((f"{prefix}.{json.dumps(k) if not k.isidentifier() else k}", v))
            else:
                lines.append(f"{_toml_key(k)} = {_toml_value(v)}")
        for p, t in sub:
            emit(p, t)

    for k, v in tables:
        emit(k, v)
    return "\n".join(lines) + "\n"


def wait_until(predicate, timeout: float, what: str, *, interval: float = 0.05, check=None) -> None:
    """Poll ``predicate`` until true or ``timeout`` seconds pass (then raise naming ``what``)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


class LocalFederation:
    """The services of one local federation; a context manager that stops them on exit.

    The services run in sessions of their own (a terminal's Ctrl-C reaches only the owner, which then stops them
    in order). While the federation is entered in the main thread, a SIGTERM to the owning process (``timeout``,
    ``kill``, a CI job ending) raises SystemExit(143) there, so the services are stopped as on any other exit
    instead of being left running; the previous SIGTERM handling is restored on exit.

    ``agent_threads``: each agent's torch threads (its ``torch_threads`` setting, and OMP/MKL threads for the
    libraries under it); None gives each of the N agents ``max(1, cores // N)`` of this host's cores
    (fedclinic.runtime.cpu_cores.cores_per_process), so agents sharing the host do not oversubscribe it.

    ``fork_agents`` (default True where the host has pidfds, i.e. Linux): the agents are forked from one
    :class:`~fedclinic.federation.fork_server.ForkServer` that has imported their stack (the agent's CLI and torch,
    and with ``preload_training_stack`` the model stack) once, instead of each agent importing it again; they are
    otherwise the same agent processes (``hospital_agent.cli run``), each in its own session with its own log.
    ``start`` does not wait for those imports: the agents are forked when the server is ready, while the caller
    goes on (a client packaging and submitting its task meanwhile). False starts each agent as ``python -m hospital_agent.cli run`` (as systemd does)."""

    #: what the fork server imports for every agent: the agent's CLI (it runs its ``main``), and torch, which the
    #: ``run`` command imports at once (apply_torch_threads), with the training modules every round uses
    AGENT_IMPORTS: ClassVar[tuple[str, ...]] = ("hospital_agent.cli", "torch", "fedclinic.training.trainer",
                                                "fedclinic.models")

    #: the aggregator's ``[state]`` table for a federation whose ``aggregator_settings`` name none, as a function of
    #: its state folder (called at each start, so it must return the same database for the same folder); None: the
    #: embedded SQLite database. The test suite's store fixture (tests/integration/conftest.py,
    #: ``FEDCLINIC_TEST_STORE=postgresql``) points every federation at a database of its own PostgreSQL server.
    default_state: ClassVar[Callable[[Path], dict[str, Any]] | None] = None

    def __init__(self, root: str | Path, sites: list[SiteSetup], *, agent_threads: int | None = None,
                 aggregator_settings: dict[str, Any] | None = None, log_level: str = "info",
                 metrics_address: str | None = None, preload_training_stack: bool = False,
                 fork_agents: bool | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.sites = {s.name: s for s in sites}
        self.agent_threads = agent_threads if agent_threads is not None else cores_per_process(len(sites))
        #: the agents' ``preload_training_stack``: off here by default (a test's tiny models need no Hugging Face
        #: import); the demo turns it on, as a production agent has it
        self.preload_training_stack = preload_training_stack
        self.aggregator_settings = aggregator_settings or {}
        self.log_level = log_level
        #: every service's Prometheus endpoint listens here (port 0: each on a free port; see metrics_url)
        self.metrics_address = metrics_address
        self._aggregator_metrics = ""  # as the running aggregator published it
        self.pki_dir = self.root / "pki"
        self.ca_dir = self.pki_dir / "ca"
        self.logs = self.root / "logs"
        self.logs.mkdir(exist_ok=True)
        self.aggregator: subprocess.Popen | None = None
        self.agents: dict[str, subprocess.Popen | ForkedProcess] = {}
        self.fork_agents = hasattr(os, "pidfd_open") if fork_agents is None else fork_agents
        self._fork_server: ForkServer | None = None
        self._fork_env: dict[str, str] = {}
        self.address = ""
        self._log_files: list = []
        self._previous_sigterm: Any = None

    # PKI --------------------------------------------------------------------------------------------------
    def make_pki(self) -> None:
        if not (self.ca_dir / "ca.crt").exists():
            pki.init_ca(self.ca_dir, common_name="fedclinic local demo CA", days=30)
        pki.issue(self.ca_dir, role="aggregator", name="aggregator", out_dir=self.pki_dir / "aggregator", days=7)
        pki.issue(self.ca_dir, role="scientist", name="scientist", out_dir=self.pki_dir / "scientist", days=7)
        for site in self.sites:
            pki.issue(self.ca_dir, role="agent", name=site, out_dir=self.pki_dir / site, days=7)

    def creds(self, name: str) -> dict[str, str]:
        d = self.pki_dir / name
        return {"cert": str(d / f"{name}.crt"), "key": str(d / f"{name}.key"), "ca": str(d / "ca.crt")}

    # processes --------------------------------------------------------------------------------------------
    def _env(self, threads: int | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
        if threads:
            env.update({"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)})
        return env

    def _spawn(self, args: list[str], log_name: str, env: dict[str, str]) -> subprocess.Popen:
        log = open(self.logs / log_name, "ab")
        self._log_files.append(log)
        return subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=self.root, start_new_session=True)

    def aggregator_state(self, state_dir: Path) -> dict[str, Any]:
        """The ``[state]`` setting to add to the aggregator's configuration: none when ``aggregator_settings`` has
        one or there is no :attr:`default_state`."""
        if "state" in self.aggregator_settings or LocalFederation.default_state is None:
            return {}
        return {"state": LocalFederation.default_state(state_dir)}

    def start_aggregator(self, timeout: float = 60) -> str:
        state = Path(self.aggregator_settings.get("state_dir", self.root / "aggregator-state"))
        state.mkdir(exist_ok=True)
        addr_file = state / "aggregator.addr"
        addr_file.unlink(missing_ok=True)
        cfg = {"listen": self.aggregator_settings.get("listen", "127.0.0.1:0"), "state_dir": str(state),
               "log_level": self.log_level, "heartbeat_s": 2.0,
               **({"metrics_address": self.metrics_address} if self.metrics_address is not None else {}),
               **{k: v for k, v in self.aggregator_settings.items() if k not in ("listen", "state_dir")},
               **self.aggregator_state(state),
               "tls": {**self.creds("aggregator"), "crl": str(self.ca_dir / "crl.pem")}}
        path = self.root / "aggregator.toml"
        path.write_text(to_toml(cfg))
        self.aggregator = self._spawn(["-m", "aggregator_service.cli", "serve", "--config", str(path)],
                                      "aggregator.log", self._env())
        proc = self.aggregator

        def alive() -> None:
            if proc.poll() is not None:
                raise FedclinicError(f"the aggregator exited with code {proc.returncode}; see {self.logs / 'aggregator.log'}")

        wait_until(addr_file.exists, timeout, "the aggregator to listen", check=alive)
        published = json.loads(addr_file.read_text())
        self.address = published["address"]
        self._aggregator_metrics = published.get("metrics_address", "")
        return self.address

    def agent_config_path(self, site: str) -> Path:
        return self.root / f"agent-{site}.toml"

    def write_agent_config(self, site: str, address: str | None = None) -> Path:
        """Write ``site``'s agent config, dialing ``address`` (default: the aggregator's; e.g. a fault proxy's)."""
        s = self.sites[site]
        cfg: dict[str, Any] = {"aggregator": address or self.address, "work_dir": str(self.root / f"agent-{site}"),
                               "log_level": self.log_level, "server_name": "localhost",
                               **({"metrics_address": self.metrics_address} if self.metrics_address is not None else {}),
                               "torch_threads": self.agent_threads,
                               "preload_training_stack": self.preload_training_stack,
                               **s.extra,
                               "tls": self.creds(site), "datasets": s.datasets}
        if s.policy is not None:
            cfg["policy"] = s.policy
        path = self.agent_config_path(site)
        path.write_text(to_toml(cfg))
        return path

    def start_agent(self, site: str, address: str | None = None) -> subprocess.Popen | ForkedProcess:
        """Start ``site``'s agent, dialing ``address`` (default: the aggregator's); forked from the fork server
        when :attr:`fork_agents` (class docstring)."""
        path = self.write_agent_config(site, address)
        args, env = ["run", "--config", str(path)], self._env(self.agent_threads)
        server = self._agent_fork_server(env)
        if server is not None:
            proc: subprocess.Popen | ForkedProcess = server.spawn(
                "hospital_agent.cli:main", args, log=self.logs / f"agent-{site}.log", cwd=self.root)
        else:
            proc = self._spawn(["-m", "hospital_agent.cli", *args], f"agent-{site}.log", env)
        self.agents[site] = proc
        return proc

    @property
    def fork_server(self) -> ForkServer | None:
        """The agents' fork server while one runs (class docstring), else None."""
        return self._fork_server

    def _start_fork_server(self) -> None:
        """Start the agents' fork server (it imports while the caller goes on); a no-op when one runs or
        :attr:`fork_agents` is off."""
        if not self.fork_agents or self._fork_server is not None:
            return
        imports = [*self.AGENT_IMPORTS, *(["hospital_agent.warm_start:MODULES"] if self.preload_training_stack else [])]
        self._fork_env = self._env(self.agent_threads)
        self._fork_server = ForkServer(imports, env=self._fork_env, log=self.logs / "fork-server.log", cwd=self.root)

    def _agent_fork_server(self, env: dict[str, str]) -> ForkServer | None:
        """The fork server to fork an agent with ``env`` from (perhaps still importing: the agent is forked when it
        is ready); None: start the agent as a process of its own (forking is off, or the environment changed since
        the server started: modules read it at import)."""
        self._start_fork_server()
        if self._fork_server is None or env != self._fork_env:
            return None
        return self._fork_server

    def metrics_url(self, service: str = "aggregator") -> str:
        """``http://HOST:PORT/metrics`` of the aggregator or of the agent of site ``service``, as it bound it
        (raises FileNotFoundError while an agent has not opened its endpoint yet)."""
        if service == "aggregator":
            address = self._aggregator_metrics
        else:
            address = json.loads((self.root / f"agent-{service}" / "metrics.addr").read_text())["address"]
        if not address:
            raise FedclinicError(f"the {service} has no metrics endpoint; give LocalFederation(metrics_address=...)")
        return f"http://{address}/metrics"

    def start(self) -> None:
        self.make_pki()
        self._start_fork_server()  # it imports the agents' stack while the aggregator starts
        self.start_aggregator()
        for site in self.sites:
            self.start_agent(site)

    def client(self, address: str | None = None):
        """A scientist's client, dialing ``address`` (default: the aggregator's; e.g. a fault proxy's)."""
        # lazy: grpc loads only when a caller talks to the aggregator (the CLI imports this module via the demo)
        from fedclinic.client import connect

        c = self.creds("scientist")
        return connect(address or self.address, cert=c["cert"], key=c["key"], ca=c["ca"], server_name="localhost")

    def signal_aggregator(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        assert self.aggregator is not None
        self.aggregator.send_signal(sig)
        return self.aggregator.wait(timeout)

    def signal_agent(self, site: str, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        proc = self.agents[site]
        proc.send_signal(sig)
        return proc.wait(timeout)

    def log_text(self, name: str) -> str:
        p = self.logs / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def close(self) -> None:
        procs = [p for p in [*self.agents.values(), self.aggregator] if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        if self._fork_server is not None:  # after its children: it has none left to stop
            self._fork_server.close()
            self._fork_server = None
        for f in self._log_files:
            f.close()

    def __enter__(self) -> "LocalFederation":
        if threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
                self._previous_sigterm = None


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)
