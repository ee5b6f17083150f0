"""What the fuzzer fires at: a real aggregator with real agents and tasks, and a real ``fedclinic serve``.

:class:`FuzzRig` starts, under one folder, on 127.0.0.1 only:

- a :class:`~fedclinic.federation.local_federation.LocalFederation`: the aggregator and two agent processes
  (``site-a``, ``site-b``) that run the **real task** (a multi-round text task restricted to them) while the
  fuzzer runs; the task must complete at the end;
- a real hospital agent in this process for ``site-c`` that takes a first task (the **capture task**) while
  :mod:`campaign.fuzz_capture` records every message it and the SDK's client send: Hello, WatchWork,
  FetchModel, the SubmitUpdate chunks; SubmitTask's chunks, GetTask, WatchTask, FetchModel;
- **target tasks** for ``site-c`` (the fuzzer's own agent identity), each the capture task's model resubmitted,
  so that a mutated update re-aimed at their open round reaches the deep checks of update admission (an
  unchanged one is even accepted: the acknowledged-update invariant then has something to count);
- ``fedclinic serve`` of an exported bundle with HTTP and the gRPC Inference service over mutual TLS.

Certificates of every role the PKI issues: ``site-c`` and ``site-d`` (agent; site-d never assigned),
``scientist`` (owner of every task), ``scientist-2`` (another tenant), ``operator`` (admin) and the
aggregator's own certificate (a role neither service admits).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import grpc

from fedclinic import pki
from fedclinic.federation.local_federation import LocalFederation, SiteSetup, wait_until
from fedclinic.proto import agent_pb2, agent_pb2_grpc
from fedclinic.transport.rpc import TlsFiles, secure_channel

from campaign.fuzz_capture import Capture, recording_channels

#: identity name -> role; the names are certificate names under the federation's pki/ folder
IDENTITIES: dict[str, str] = {"site-c": "agent", "site-d": "agent", "scientist": "scientist",
                              "scientist-2": "scientist", "operator": "admin", "aggregator": "aggregator"}
REAL_SITES = ("site-a", "site-b")


class FuzzRig:
    """The processes and tasks under fuzz (module docstring). Use as a context manager."""

    def __init__(self, root: Path, *, real_rounds: int = 4) -> None:
        from tests.helpers.text_models import write_site_data

        self.root = root
        self.real_rounds = real_rounds
        sites = [SiteSetup(name, datasets={"notes": {"path": str(write_site_data(root / "data" / name, 24 + 8 * i,
                                                                                    seed=i)), "format": "jsonl"}})
                 for i, name in enumerate((*REAL_SITES, "site-c", "site-d"))]
        self.fed = LocalFederation(root / "fed", sites, agent_threads=1)
        self.capture = Capture()
        self.channels: dict[str, grpc.Channel] = {}
        self.inference_channels: dict[str, grpc.Channel] = {}
        self.serve_proc: subprocess.Popen | None = None
        self.http_port = 0
        self.grpc_port = 0
        self.real_task = ""
        self.capture_task = ""
        self.target_task = ""
        #: the newest assignment site-c got on the fuzzer's own work stream
        self.assignment: agent_pb2.Assignment | None = None
        self._watch: Any = None
        self.targets_made = 0
        self._lock = threading.Lock()

    # start ------------------------------------------------------------------------------------------------
    def start(self) -> None:
        fed = self.fed
        fed.make_pki()
        for name, role in IDENTITIES.items():
            if not (fed.pki_dir / name / f"{name}.crt").exists():
                pki.issue(fed.ca_dir, role=role, name=name, out_dir=fed.pki_dir / name, days=7)
        pki.issue(fed.ca_dir, role="aggregator", name="inference", out_dir=fed.pki_dir / "inference", days=7,
                  dns=["localhost"], ips=["127.0.0.1"])
        fed.start_aggregator()
        for site in REAL_SITES:
            fed.start_agent(site)
        for name in IDENTITIES:
            self.channels[name] = secure_channel(fed.address, self.tls(name), server_name="localhost")
        self._capture_real_run()
        self._start_serve()
        with self.client() as client:
            self.real_task = client.submit(self._task("real", sites=list(REAL_SITES), min_sites=2,
                                                      num_rounds=self.real_rounds), package=self._package()).task_id
        self._watch_site_c()
        self.new_target_task()

    def tls(self, name: str) -> TlsFiles:
        c = self.fed.creds(name)
        return TlsFiles(Path(c["cert"]), Path(c["key"]), Path(c["ca"]))

    def client(self, name: str = "scientist"):
        from fedclinic.client import connect

        c = self.fed.creds(name)
        return connect(self.fed.address, cert=c["cert"], key=c["key"], ca=c["ca"], server_name="localhost")

    @staticmethod
    def _task(name: str, **kw):
        from tests.helpers.tasks import make_task

        return make_task(name=name, **{"num_rounds": 1, "min_sites": 1, "round_timeout_s": 600, **kw})

    @staticmethod
    def _package():
        from tests.helpers.text_models import tiny_package

        return tiny_package()

    def _capture_real_run(self) -> None:
        """site-c's real agent (in this process) and the SDK's client take the capture task, recorded."""
        from hospital_agent.config import AgentConfig
        from hospital_agent.worker import Agent

        with recording_channels(self.capture):
            agent = Agent(AgentConfig.load(self.fed.write_agent_config("site-c")))
            runner = threading.Thread(target=agent.run, name="capture-agent", daemon=True)
            runner.start()
            try:
                with self.client() as client:
                    st = client.submit(self._task("capture", sites=["site-c"]), package=self._package())
                    self.capture_task = st.task_id
                    final = client.wait(st.task_id, timeout=300, progress=False)
                    if final.state != 3:  # TASK_STATE_COMPLETED
                        raise RuntimeError(f"the capture task did not complete: {final.error}")
                    client.status(st.task_id)
                    client.fetch_package(st.task_id, round=1)
            finally:
                agent.stop()
                runner.join(timeout=30)

    def _watch_site_c(self) -> None:
        """Keep a work stream open as site-c (so target tasks assign it) and remember its newest assignment."""
        stub = agent_pb2_grpc.AgentServiceStub(self.channels["site-c"])
        stub.Hello(agent_pb2.HelloRequest(protocol_version=1, capabilities=agent_pb2.Capabilities(codecs=["raw"])),
                   timeout=30)
        self._watch = stub.WatchWork(agent_pb2.WatchWorkRequest(protocol_version=1))

        def collect() -> None:
            try:
                for item in self._watch:
                    if item.WhichOneof("item") == "assignment":
                        with self._lock:
                            self.assignment = item.assignment
            except grpc.RpcError:
                pass

        threading.Thread(target=collect, name="site-c-work", daemon=True).start()

    def watch_alive(self) -> bool:
        return self._watch is not None and self._watch.running()

    def new_target_task(self) -> str:
        """Submit a fresh target task for site-c (cancelling the previous one) and wait for its assignment."""
        with self.client() as client:
            if self.target_task:
                try:
                    client.cancel(self.target_task, reason="fuzz batch over")
                except Exception:  # noqa: BLE001 - it may have ended already
                    pass
            self.targets_made += 1
            st = client.submit(self._task(f"target-{self.targets_made}",
                                          sites=["site-c"], num_rounds=1000, round_timeout_s=3600),
                               package=self._package())
        self.target_task = st.task_id
        if not self.watch_alive():
            self._watch_site_c()
        wait_until(lambda: self.assignment is not None and self.assignment.task_id == st.task_id, 60,
                   "site-c's assignment of the target task")
        return st.task_id

    def site_c_signer(self):
        """A signer with site-c's certificate key (its round statements)."""
        from fedclinic.pki.signed_statement import Signer

        c = self.fed.creds("site-c")
        return Signer(key_path=c["key"], cert_path=c["cert"])

    def _start_serve(self) -> None:
        from fedclinic.export.bundle_signing import BundleSigning
        from fedclinic.export.onnx_export import export_onnx

        from tests.helpers.text_models import tiny_package

        tiny_package("logreg").save(self.root / "pkg")
        sci = self.fed.creds("scientist")  # the bundle is signed as a scientist's export: serve checks it first
        export_onnx(self.root / "pkg", self.root / "bundle",
                    signing=BundleSigning(ca=Path(sci["ca"]), cert=Path(sci["cert"]), key=Path(sci["key"]),
                                          allow_unsigned=True))  # the source is a local package, not a download
        port_file = self.root / "serve-ports.json"
        srv = self.fed.pki_dir / "inference"
        log = open(self.fed.logs / "serve.log", "ab")
        self.serve_proc = subprocess.Popen(
            [sys.executable, "-m", "fedclinic.cli", "serve", str(self.root / "bundle"), "--port", "0", "--port-file",
             str(port_file), "--threads", "1", "--grpc-port", "0", "--cert", str(srv / "inference.crt"), "--key",
             str(srv / "inference.key"), "--ca", str(srv / "ca.crt")],
            stdout=log, stderr=subprocess.STDOUT, env=self.fed._env(1), start_new_session=True)
        log.close()
        proc = self.serve_proc
        wait_until(lambda: port_file.exists() or proc.poll() is not None, 120, "fedclinic serve to start")
        if proc.poll() is not None:
            raise RuntimeError(f"fedclinic serve exited: {self.fed.log_text('serve')[-2000:]}")
        ports = json.loads(port_file.read_text())
        self.http_port, self.grpc_port = ports["http"], ports["grpc"]
        for name in IDENTITIES:
            self.inference_channels[name] = secure_channel(f"127.0.0.1:{self.grpc_port}", self.tls(name),
                                                           server_name="localhost")

    # state ------------------------------------------------------------------------------------------------
    def current_assignment(self) -> agent_pb2.Assignment | None:
        with self._lock:
            return self.assignment

    def processes(self) -> dict[str, subprocess.Popen]:
        procs = {"aggregator": self.fed.aggregator, "serve": self.serve_proc}
        procs.update({f"agent {s}": p for s, p in self.fed.agents.items()})
        return {k: v for k, v in procs.items() if v is not None}

    def log_paths(self) -> dict[str, Path]:
        return {"aggregator": self.fed.logs / "aggregator.log", "serve": self.fed.logs / "serve.log",
                **{f"agent {s}": self.fed.logs / f"agent-{s}.log" for s in REAL_SITES}}

    def state_dir(self) -> Path:
        return self.fed.root / "aggregator-state"

    # stop -------------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        for ch in [*self.channels.values(), *self.inference_channels.values()]:
            ch.close()
        if self.serve_proc is not None and self.serve_proc.poll() is None:
            self.serve_proc.terminate()
            try:
                self.serve_proc.wait(20)
            except subprocess.TimeoutExpired:
                self.serve_proc.kill()
                self.serve_proc.wait(10)
        self.fed.close()

    def __enter__(self) -> "FuzzRig":
        self.fed.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        self.fed.__exit__(*exc)
