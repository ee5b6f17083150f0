"""deploy/systemd: the hardened units parse and carry every hardening option (or a comment saying why one
stays off); `systemd-analyze verify` accepts them and `systemd-analyze security --offline` scores them;
the W^X decision is checked against the real code (the aggregator runs a federation round under the kernel's
W^X enforcement, torch's JIT kernels fail under it); `hospital-agent install-service` lays out a site."""

from __future__ import annotations

import inspect
import re
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SYSTEMD = ROOT / "deploy" / "systemd"
UNITS = {"fedclinic-aggregator": SYSTEMD / "fedclinic-aggregator.service",
         "hospital-agent": SYSTEMD / "hospital-agent.service"}
EXEC = {"fedclinic-aggregator": "/opt/fedclinic/bin/fedclinic-aggregator",
        "hospital-agent": "/opt/hospital-agent/bin/hospital-agent"}
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_systemd_analyze = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed on "
                                           "this machine: the units are only checked by the Python parser")


# a unit-file reader that keeps duplicate keys and the comments above each key -------------------------------
def parse_unit(text: str) -> tuple[dict[str, dict[str, list[str]]], list[str]]:
    sections: dict[str, dict[str, list[str]]] = {}
    comments: list[str] = []
    current = None
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if pending:
            line, pending = pending + " " + line, ""
        if not line:
            continue
        if line[0] in "#;":
            comments.append(line[1:].strip())
            continue
        if line.endswith("\\"):
            pending = line[:-1].strip()
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"not a unit-file line: {raw!r}"
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections, comments


def _unit(name: str):
    return parse_unit(UNITS[name].read_text())


def _last(svc: dict[str, list[str]], key: str) -> str | None:
    return svc[key][-1] if key in svc else None


BOTH_REQUIRED = {
    "NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes", "ProtectHome": "yes",
    "CapabilityBoundingSet": "", "AmbientCapabilities": "", "SystemCallArchitectures": "native",
    "LockPersonality": "yes", "RestrictRealtime": "yes", "RestrictSUIDSGID": "yes", "RestrictNamespaces": "yes",
    "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes", "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes", "ProtectClock": "yes", "ProtectHostname": "yes", "UMask": "0077",
    "Restart": "on-failure", "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6", "KillSignal": "SIGTERM",
    "PrivateMounts": "yes", "LimitCORE": "0",
}
#: options that make things stricter when on: each must be on, or carry a comment "<Option>= stays off"
OPTIONAL_HARDENING = ["MemoryDenyWriteExecute", "PrivateDevices", "PrivateUsers", "ProcSubset", "PrivateNetwork",
                      "IPAddressDeny"]


@pytest.mark.parametrize("name", sorted(UNITS))
def test_unit_has_the_hardening_options(name):
    sections, _ = _unit(name)
    assert set(sections) == {"Unit", "Service", "Install"}
    svc = sections["Service"]
    for key, value in BOTH_REQUIRED.items():
        assert _last(svc, key) == value, f"{name}: {key}={_last(svc, key)!r}, expected {value!r}"
    user = _last(svc, "User")
    assert user and user not in ("root", "0") and _last(svc, "Group") == user
    assert "DynamicUser" not in svc            # a dedicated static user owns the state across restarts
    assert svc["ExecStart"] == [f"{EXEC[name]} {'serve' if 'aggregator' in name else 'run'} --config "
                                f"/etc/{'fedclinic' if 'aggregator' in name else 'hospital-agent'}/"
                                f"{'aggregator' if 'aggregator' in name else 'agent'}.toml"]
    state = f"/var/lib/{name}"
    assert state in _last(svc, "ReadWritePaths").split()
    assert _last(svc, "StateDirectory") == name and _last(svc, "StateDirectoryMode") == "0700"
    filters = svc["SystemCallFilter"]
    assert filters[0] == "@system-service" and any(f.startswith("~") and "@privileged" in f for f in filters[1:])
    assert _last(svc, "SystemCallErrorNumber") == "EPERM"
    assert all(_last(svc, k) for k in ("LimitNOFILE", "MemoryMax", "TasksMax", "TimeoutStopSec", "RestartSec"))
    env_file = _last(svc, "EnvironmentFile")
    assert env_file.startswith("-/etc/"), "EnvironmentFile must be optional (leading '-')"
    assert sections["Install"]["WantedBy"] == ["multi-user.target"]


@pytest.mark.parametrize("name", sorted(UNITS))
def test_every_hardening_option_left_off_says_why(name):
    sections, comments = _unit(name)
    svc = sections["Service"]
    text = "\n".join(comments).lower()
    for opt in OPTIONAL_HARDENING:
        value = _last(svc, opt)
        if value is not None and value not in ("no", "false", "off", "0"):
            continue
        assert f"{opt.lower()}= stays off" in text, f"{name}: {opt} is off without a comment saying why"


def test_agent_differs_where_torch_and_gpus_need_it():
    svc = _unit("hospital-agent")[0]["Service"]
    assert _last(svc, "MemoryDenyWriteExecute") == "no"           # oneDNN JIT (see the W^X test below)
    assert "PrivateDevices" not in svc and _last(svc, "DevicePolicy") == "closed"
    allowed = {v.split()[0] for v in svc["DeviceAllow"]}
    assert {"char-nvidia", "char-nvidia-frontend", "char-nvidia-uvm"} <= allowed
    assert all(v.split()[1] == "rw" for v in svc["DeviceAllow"])
    assert "@resources" not in " ".join(svc["SystemCallFilter"])  # OpenMP/oneDNN thread pinning
    env = " ".join(svc["Environment"])
    assert "HF_HUB_OFFLINE=1" in env and "TRANSFORMERS_OFFLINE=1" in env
    assert "/var/cache/hospital-agent" in _last(svc, "ReadWritePaths").split()
    agg = _unit("fedclinic-aggregator")[0]["Service"]
    assert _last(agg, "MemoryDenyWriteExecute") == "yes" and _last(agg, "PrivateDevices") == "yes"
    assert "@resources" in agg["SystemCallFilter"][-1]


def test_stop_timeouts_cover_the_services_sigterm_handling():
    from aggregator_service.server import Aggregator

    grace = inspect.signature(Aggregator.stop).parameters["grace"].default
    agg = _unit("fedclinic-aggregator")[0]["Service"]
    assert int(_last(agg, "TimeoutStopSec")) >= 2 * grace
    worker = (ROOT / "hospital_agent" / "worker.py").read_text()
    join = float(re.search(r"watcher\.join\(timeout=(\d+(?:\.\d+)?)\)", worker).group(1))
    agent = _unit("hospital-agent")[0]["Service"]
    assert int(_last(agent, "TimeoutStopSec")) >= join + 30


def test_parser_keeps_duplicates_and_continuations():
    sections, comments = parse_unit("[Service]\n# why\nA=1\nA=2\nB=x \\\n  y\n")
    assert sections["Service"]["A"] == ["1", "2"] and sections["Service"]["B"] == ["x y"] and comments == ["why"]


# systemd-analyze --------------------------------------------------------------------------------------------
def _staged_root(tmp_path: Path, units: dict[str, str]) -> Path:
    """A root tree systemd-analyze --root can load: the system's own units, our units, the executables."""
    root = tmp_path / "root"
    for path in ("/usr/lib/systemd/system", "/lib/systemd/system"):
        if Path(path).is_dir() and not (root / "usr/lib/systemd/system").exists():
            shutil.copytree(path, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True, exist_ok=True)
    for name, text in units.items():
        (root / "etc/systemd/system" / f"{name}.service").write_text(text)
    for exe in EXEC.values():
        p = root / exe.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("#!/bin/sh\n")
        p.chmod(0o755)
    return root


def _verify(root: Path, *names: str) -> subprocess.CompletedProcess:
    return subprocess.run([SYSTEMD_ANALYZE, "verify", f"--root={root}", *[f"{n}.service" for n in names]],
                          capture_output=True, text=True, timeout=120)


@needs_systemd_analyze
def test_systemd_analyze_verify_accepts_both_units(tmp_path):
    root = _staged_root(tmp_path, {n: p.read_text() for n, p in UNITS.items()})
    done = _verify(root, *UNITS)
    # verify exits 0 even on unknown keys or bad values: its warnings are the failures
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done.stdout + done.stderr


@needs_systemd_analyze
def test_systemd_analyze_verify_would_catch_a_broken_unit(tmp_path):
    text = UNITS["hospital-agent"].read_text().replace("ProtectHome=yes", "ProtectHome=yes\nProtectHomes=yes\n"
                                                       "RestrictAddressFamilies=AF_BOGUS")
    root = _staged_root(tmp_path, {"hospital-agent": text})
    done = _verify(root, "hospital-agent")
    assert "ProtectHomes" in done.stderr and "AF_BOGUS" in done.stderr


#: exposure scores (0 = locked down, 10 = unprotected) reported in deploy/README.md, with a little slack
MAX_EXPOSURE = {"fedclinic-aggregator": 1.3, "hospital-agent": 1.8}


@needs_systemd_analyze
@pytest.mark.parametrize("name", sorted(UNITS))
def test_systemd_analyze_security_exposure(tmp_path, name):
    root = _staged_root(tmp_path, {name: UNITS[name].read_text()})
    done = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=true", f"--root={root}", "--no-pager",
                           f"{name}.service"], capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    m = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out)
    if m is None and "--offline" in out:
        pytest.skip(f"this systemd-analyze has no offline security review: {out.strip()[:200]}")
    assert m, out
    assert float(m.group(1)) <= MAX_EXPOSURE[name], out


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers is not installed here")
def test_sysusers_files_create_the_dedicated_users(tmp_path):
    (tmp_path / "etc").mkdir()
    files = [str(SYSTEMD / "hospital-agent.sysusers.conf"), str(SYSTEMD / "fedclinic-aggregator.sysusers.conf")]
    done = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", *files], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    passwd = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()}
    for name, unit in UNITS.items():
        user = _last(_unit(name)[0]["Service"], "User")
        assert user in passwd and passwd[user][5] == f"/var/lib/{name}" and passwd[user][6] == "/usr/sbin/nologin"
        assert 0 < int(passwd[user][2]) < 1000


# W^X (MemoryDenyWriteExecute) checked against the real code -------------------------------------------------
PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1
MDWE_EXEC = """\
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(65, 1, 0, 0, 0) != 0:
    sys.exit(f"prctl(PR_SET_MDWE) failed: errno {ctypes.get_errno()}")
os.execv(sys.argv[1], sys.argv[1:])
"""


def _mdwe_supported() -> bool:
    """PR_SET_MDWE (Linux 6.3+) is the kernel's own W^X switch: the semantics of MemoryDenyWriteExecute=."""
    probe = subprocess.run([sys.executable, "-c", "import ctypes,sys; l=ctypes.CDLL(None); "
                            "sys.exit(0 if l.prctl(65,1,0,0,0)==0 else 1)"], timeout=30)
    return probe.returncode == 0


needs_mdwe = pytest.mark.skipif(sys.platform != "linux" or not _mdwe_supported(),
                                reason="this kernel has no PR_SET_MDWE (Linux 6.3+): W^X cannot be enforced here")


@needs_mdwe
def test_torch_cpu_kernels_fail_under_wx_which_is_why_the_agent_keeps_it_off(tmp_path):
    helper = tmp_path / "mdwe_exec.py"
    helper.write_text(MDWE_EXEC)
    code = ("import torch\n"
            "conv = torch.nn.Conv1d(4, 8, 3)\n"
            "print(conv(torch.randn(2, 4, 16)).shape)\n")
    exec(compile(code, "<plain>", "exec"), {})  # without W^X (this process) the same code runs
    wx = subprocess.run([sys.executable, str(helper), sys.executable, "-c", code], capture_output=True, text=True,
                        timeout=300)
    assert wx.returncode != 0 and "could not create a primitive" in wx.stderr, wx.stderr[-2000:]


@needs_mdwe
@pytest.mark.integration
def test_aggregator_runs_a_round_under_wx_and_answers_the_health_probe(tmp_path):
    """MemoryDenyWriteExecute=yes in the aggregator's unit is safe: a real aggregator process under W^X
    serves a full federated round over mTLS; fedclinic-healthcheck (the Kubernetes probe) reports SERVING."""
    from fedclinic.client import state_name
    from fedclinic.federation.local_federation import LocalFederation, SiteSetup

    from tests.helpers.text_models import tiny_package, write_site_data
    from tests.helpers.tasks import make_task

    helper = tmp_path / "mdwe_exec.py"
    helper.write_text(MDWE_EXEC)

    class WxFederation(LocalFederation):
        def _spawn(self, args, log_name, env):
            if log_name == "aggregator.log":
                args = [str(helper), sys.executable, *args]
            return super()._spawn(args, log_name, env)

    sites = [SiteSetup(n, datasets={"notes": {"path": str(write_site_data(tmp_path / "data" / n, 24, seed=i)),
                                              "format": "jsonl"}}) for i, n in enumerate(("site-a", "site-b"))]
    with WxFederation(tmp_path / "fed", sites, agent_threads=1) as fed:
        fed.start()
        pid = fed.aggregator.pid
        # the aggregator process really runs with W^X on (the flag is inherited through exec)
        status = Path(f"/proc/{pid}/status").read_text()
        if "Mdwe" in status:
            assert re.search(r"Mdwe:\s*1", status) or "refuse_exec_gain" in status.lower(), status
        with fed.client() as client:
            st = client.submit(make_task(num_rounds=1, min_sites=2), package=tiny_package())
            final = client.wait(st.task_id, timeout=240, progress=False)
        assert state_name(final.state) == "completed", final.error + fed.log_text("aggregator")[-3000:]
        creds = fed.creds("aggregator")
        probe = [sys.executable, str(ROOT / "deploy/docker/fedclinic-healthcheck"), "--address", fed.address,
                 "--cert", creds["cert"], "--key", creds["key"], "--ca", creds["ca"], "--server-name", "localhost"]
        ok = subprocess.run(probe, capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0 and ok.stdout.strip() == "SERVING", ok.stdout + ok.stderr
        svc = subprocess.run(probe + ["--service", "fedclinic.v1.AgentService"], capture_output=True, text=True,
                             timeout=60)
        assert svc.returncode == 0, svc.stdout
        unknown = subprocess.run(probe + ["--service", "no.such.Service"], capture_output=True, text=True, timeout=60)
        assert unknown.returncode == 2 and "NOT_FOUND" in unknown.stdout
        from fedclinic import pki

        pki.init_ca(tmp_path / "other-ca", common_name="some other CA", days=1)
        other = [a if a != creds["ca"] else str(tmp_path / "other-ca" / "ca.crt") for a in probe]
        wrong_ca = subprocess.run(other + ["--timeout", "3"], capture_output=True, text=True, timeout=60)
        assert wrong_ca.returncode == 2 and wrong_ca.stdout.startswith("UNKNOWN"), wrong_ca.stdout
        assert fed.signal_aggregator(signal.SIGTERM) == 0       # clean exit well within TimeoutStopSec
    assert "aggregator stopped" in (tmp_path / "fed" / "logs" / "aggregator.log").read_text()


# hospital-agent install-service ----------------------------------------------------------------------------
def _install(*args: str, process: bool = False) -> subprocess.CompletedProcess:
    """``hospital-agent install-service ARGS``: in this process (hospital_agent.cli.main, as the console script
    calls it; a new Python process would import the agent's modules again, a second of CPU each), or with
    ``process`` as its own ``python -m hospital_agent.cli`` process."""
    command = ["install-service", *args]
    if process:
        return subprocess.run([sys.executable, "-m", "hospital_agent.cli", *command], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
    import contextlib
    import io

    from hospital_agent.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(command)
    return subprocess.CompletedProcess(command, code, out.getvalue(), err.getvalue())


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_install_service_lays_out_a_site(tmp_path):
    root = tmp_path / "site"
    done = _install("--root", str(root), "--site", "st-mary", "--aggregator", "agg.example.org:7443", process=True)
    assert done.returncode == 0, done.stderr
    etc, state, cache = root / "etc/hospital-agent", root / "var/lib/hospital-agent", root / "var/cache/hospital-agent"
    assert _mode(etc) == 0o750 and _mode(state) == 0o700 and _mode(cache) == 0o700
    assert _mode(etc / "agent.toml") == 0o640 and _mode(etc / "agent.env") == 0o640
    unit = root / "etc/systemd/system/hospital-agent.service"
    assert unit.read_text() == UNITS["hospital-agent"].read_text() and _mode(unit) == 0o644
    sysusers = (root / "etc/sysusers.d/hospital-agent.conf").read_text()
    assert sysusers.split()[:2] == ["u", "hospital-agent"]
    assert "staged under" in done.stdout and "chown" in done.stdout       # says what to do on the target

    from hospital_agent.config import AgentConfig

    config = AgentConfig.load(etc / "agent.toml")
    svc = _unit("hospital-agent")[0]["Service"]
    assert str(config.work_dir) in _last(svc, "ReadWritePaths").split()
    assert config.aggregator == "agg.example.org:7443"
    assert str(config.tls.key) == "/etc/hospital-agent/st-mary.key"
    assert not list(root.rglob("*.tmp"))


def test_install_service_is_idempotent_keeps_config_and_repairs_modes(tmp_path):
    root = tmp_path / "site"
    assert _install("--root", str(root)).returncode == 0
    etc, state = root / "etc/hospital-agent", root / "var/lib/hospital-agent"
    (etc / "agent.toml").write_text("# edited by the site\n")
    state.chmod(0o755)
    key = etc / "st-mary.key"
    key.write_text("not a real key\n")
    key.chmod(0o644)
    done = _install("--root", str(root))
    assert done.returncode == 0, done.stderr
    assert (etc / "agent.toml").read_text() == "# edited by the site\n" and "kept the existing" in done.stdout
    assert _mode(state) == 0o700 and _mode(key) == 0o600


def test_install_service_dry_run_changes_nothing(tmp_path):
    root = tmp_path / "site"
    done = _install("--root", str(root), "--dry-run")
    assert done.returncode == 0, done.stderr
    assert not root.exists()
    lines = done.stdout.splitlines()
    assert any(line.startswith("would create") and "var/lib/hospital-agent (0700" in line for line in lines)
    assert any("hospital-agent.service" in line for line in lines)
    # the real-root plan also creates the user and sets owners; shown, not done
    real = _install("--dry-run")
    assert real.returncode == 0 and "would create system user 'hospital-agent'" in real.stdout
    assert "would set owners" in real.stdout


def test_install_service_errors_are_clear(tmp_path):
    done = _install("--root", str(tmp_path / "x"), "--unit", str(tmp_path / "missing.service"))
    assert done.returncode == 2 and "missing.service does not exist" in done.stderr


@needs_systemd_analyze
def test_installed_layout_verifies_with_systemd_analyze(tmp_path):
    root = _staged_root(tmp_path, {})
    assert _install("--root", str(root)).returncode == 0
    done = _verify(root, "hospital-agent")
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
