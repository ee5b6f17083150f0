"""Offline installs and SBOMs (issue 20 items 3-4): ``make wheelhouse``'s folders install with no index, and
``make sbom``'s CycloneDX documents are valid and list exactly what those folders install.

Every install here runs as on an air-gapped host: a fresh virtual environment, ``--no-index``, and pip isolated
from this machine's configuration (``PIP_CONFIG_FILE=/dev/null``: no global find-links, extra index or
constraint file; no ``PIP_*`` variables); pip's ``--report`` then proves each installed wheel came from the
wheelhouse folder. ``make test`` builds the aggregator's folder only and installs it (small). ``make test-offline``
(FEDCLINIC_TEST_OFFLINE_AGENT=1) also builds the agent's folder (360 MiB: torch), checks it and its SBOM the same
way, resolves ``fedclinic[agent]`` against it (``pip install --dry-run``: every wheel it needs is there, and
nothing else) and installs it in full (minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fedclinic import pki
from tests.helpers.benches import load_script

ROOT = Path(__file__).resolve().parents[2]
FULL_AGENT = os.environ.get("FEDCLINIC_TEST_OFFLINE_AGENT") == "1"


wheelhouse = load_script("wheelhouse")
sbom = load_script("sbom")


def offline_env() -> dict[str, str]:
    """This process's environment less everything that could point pip (or Python) at another source."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PIP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def run(cmd: list[str | Path], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], cwd=cwd, env=offline_env(), capture_output=True, text=True,
                         timeout=600)
    if check:
        assert out.returncode == 0, f"{cmd}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def fresh_venv(path: Path) -> Path:
    """A new virtual environment (pip from Python's own ensurepip, no network); returns its bin/ folder."""
    run([sys.executable, "-m", "venv", path], cwd=path.parent)
    return path / "bin"


def offline_install(bin_dir: Path, folder: Path, tmp: Path, *extra: str) -> tuple[dict, str]:
    """``pip install --no-index --find-links FOLDER --require-hashes -r FOLDER/requirements.txt`` as the docs say;
    returns pip's --report and its output."""
    report = tmp / f"report-{folder.name}{'-dry' if '--dry-run' in extra else ''}.json"
    out = run([bin_dir / "pip", "install", "--no-index", "--find-links", folder, "--require-hashes", "-r",
               folder / "requirements.txt", "--report", report, *extra], cwd=tmp)
    return json.loads(report.read_text()), out.stdout + out.stderr


def assert_all_from(report: dict, folder: Path) -> dict[str, str]:
    """Every wheel pip installed (or would) came from ``folder``; returns {canonical name: version}."""
    prefix = folder.resolve().as_uri() + "/"
    got = {}
    for item in report["install"]:
        url = item["download_info"]["url"]
        assert url.startswith(prefix), f"{item['metadata']['name']} came from {url}, not the wheelhouse"
        got[wheelhouse.canonical_name(item["metadata"]["name"])] = item["metadata"]["version"]
    return got


def manifest_versions(folder: Path) -> dict[str, str]:
    return {w["name"]: w["version"] for w in json.loads((folder / "manifest.json").read_text())["wheels"]}


def installed(bin_dir: Path, tmp: Path) -> dict[str, str]:
    out = run([bin_dir / "pip", "list", "--format", "json"], cwd=tmp)
    return {wheelhouse.canonical_name(d["name"]): d["version"] for d in json.loads(out.stdout)}


def sbom_versions(doc: dict) -> dict[str, str]:
    comps = doc.get("components", []) + [doc["metadata"]["component"]]
    return {wheelhouse.canonical_name(c["name"]): c["version"] for c in comps}


def make_ca(tmp: Path) -> Path:
    ca = tmp / "ca"
    if not (ca / "ca.crt").exists():
        pki.init_ca(ca)
    return ca


@pytest.fixture(scope="module")
def houses(tmp_path_factory) -> Path:
    """``scripts/wheelhouse.py`` (what ``make wheelhouse`` runs) for both roles, into a new folder."""
    out = tmp_path_factory.mktemp("wheelhouse")
    assert wheelhouse.main(["--out", str(out), *([] if FULL_AGENT else ["--role", "aggregator"])]) == 0
    return out


ROLES = ("agent", "aggregator") if FULL_AGENT else ("aggregator",)
needs_agent_house = pytest.mark.skipif(not FULL_AGENT, reason="builds the agent's 360 MiB wheelhouse: "
                                                              "`make test-offline` runs it")


@pytest.fixture(scope="module")
def aggregator_install(houses, tmp_path_factory) -> tuple[Path, dict, str]:
    """The aggregator's folder, hashes checked with ``sha256sum -c``, installed offline into a fresh venv."""
    tmp = tmp_path_factory.mktemp("aggregator-host")
    folder = houses / "aggregator"
    check = run(["sha256sum", "-c", "SHA256SUMS"], cwd=folder)
    assert check.stdout.count(": OK") == len(manifest_versions(folder))
    bin_dir = fresh_venv(tmp / "venv")
    report, output = offline_install(bin_dir, folder, tmp)
    return bin_dir, report, output


def test_wheelhouse_folders_are_self_contained(houses):
    for role in ROLES:
        folder = houses / role
        names = {p.name for p in folder.iterdir()}
        assert {"SHA256SUMS", "requirements.txt", "manifest.json"} <= names
        assert all(n.endswith(".whl") for n in names - {"SHA256SUMS", "requirements.txt", "manifest.json"})
        manifest = json.loads((folder / "manifest.json").read_text())
        assert {w["file"] for w in manifest["wheels"]} == {n for n in names if n.endswith(".whl")}
        assert manifest["fedclinic_version"] == "0.1.0" and manifest["install"].startswith("fedclinic")
    agg = manifest_versions(houses / "aggregator")
    assert agg["grpcio"] == "1.85.1" and agg["protobuf"] == "7.36.2" and agg["cryptography"] == "50.0.2"
    assert "torch" not in agg and "transformers" not in agg
    if FULL_AGENT:
        agent = manifest_versions(houses / "agent")
        # pinned by constraints.txt: torch is the CPU wheel of the Makefile (2.13.0, local label +cpu here)
        assert agent["torch"].split("+")[0] == "2.13.0" and "transformers" in agent
        assert set(agg) <= set(agent)  # the agent runs the base install too


def test_aggregator_installs_offline_and_checks_its_config(aggregator_install, houses, tmp_path):
    bin_dir, report, output = aggregator_install
    assert "Looking in indexes" not in output and "/opt/wheels" not in output, output
    assert assert_all_from(report, houses / "aggregator") == manifest_versions(houses / "aggregator")
    where = run([bin_dir / "python", "-c", "import aggregator_service, fedclinic; print(aggregator_service.__file__)"],
                cwd=tmp_path).stdout
    assert where.startswith(str(bin_dir.parent)), where  # the installed copy, not this source tree
    assert run([bin_dir / "python", "-c", "import torch"], cwd=tmp_path, check=False).returncode != 0
    # the sample aggregator.toml of docs/operator.md, with certificates from fedclinic's own PKI
    ca = make_ca(tmp_path)
    pki.issue(ca, role="aggregator", name="aggregator", out_dir=tmp_path / "tls", dns=["localhost"])
    config = tmp_path / "aggregator.toml"
    config.write_text(f'listen = "127.0.0.1:7443"\nstate_dir = "{tmp_path / "state"}"\n[tls]\n'
                      f'cert = "tls/aggregator.crt"\nkey = "tls/aggregator.key"\nca = "tls/ca.crt"\n'
                      f'crl = "{ca / "crl.pem"}"\n')
    ok = run([bin_dir / "fedclinic-aggregator", "check-config", "--config", config], cwd=tmp_path)
    assert "configuration OK" in ok.stdout and "aggregator 'aggregator'" in ok.stdout
    assert (tmp_path / "state").is_dir()
    config.write_text(config.read_text().replace(f'crl = "{ca / "crl.pem"}"', 'crl = "missing.pem"'))
    bad = run([bin_dir / "fedclinic-aggregator", "check-config", "--config", config], cwd=tmp_path, check=False)
    assert bad.returncode == 1 and "missing.pem" in bad.stderr, bad.stderr
    # the operator's `fedclinic` command works in the base install (no serving stack: uvicorn is not there)
    assert "init-ca" in run([bin_dir / "fedclinic", "pki", "--help"], cwd=tmp_path).stdout


@needs_agent_house
def test_agent_wheelhouse_resolves_offline(aggregator_install, houses, tmp_path):
    """What ``pip install --no-index --find-links agent fedclinic[agent]`` would install: every wheel of the
    folder, nothing from elsewhere, nothing missing (a missing wheel fails the resolution)."""
    bin_dir, _, _ = aggregator_install
    folder = houses / "agent"
    report = tmp_path / "agent-dry.json"
    run([bin_dir / "pip", "install", "--dry-run", "--ignore-installed", "--no-index", "--find-links", folder,
         "--report", report, "fedclinic[agent]"], cwd=tmp_path)
    assert assert_all_from(json.loads(report.read_text()), folder) == manifest_versions(folder)
    gone = tmp_path / "agent-less-one"
    shutil.copytree(folder, gone)
    next(gone.glob("opacus-*.whl")).unlink()
    short = run([bin_dir / "pip", "install", "--dry-run", "--ignore-installed", "--no-index", "--find-links", gone,
                 "fedclinic[agent]"], cwd=tmp_path, check=False)
    assert short.returncode != 0 and "opacus" in short.stderr


def test_tampered_wheel_is_refused_before_install(aggregator_install, houses, tmp_path):
    bin_dir, _, _ = aggregator_install
    folder = tmp_path / "aggregator"
    shutil.copytree(houses / "aggregator", folder)
    victim = next(folder.glob("structlog-*.whl"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    check = run(["sha256sum", "-c", "SHA256SUMS"], cwd=folder, check=False)
    assert check.returncode != 0 and f"{victim.name}: FAILED" in check.stdout
    report = tmp_path / "r.json"
    refused = run([bin_dir / "pip", "install", "--dry-run", "--ignore-installed", "--no-index", "--find-links",
                   folder, "--require-hashes", "-r", folder / "requirements.txt", "--report", report], cwd=tmp_path,
                  check=False)
    assert refused.returncode != 0 and "DO NOT MATCH THE HASHES" in refused.stderr, refused.stderr
    with pytest.raises(sbom.SbomError, match=victim.name):
        sbom.write_sbom(folder, tmp_path / "bom.json")


def validate_cyclonedx(path: Path) -> dict:
    """Check ``path`` against the CycloneDX 1.6 JSON schema with cyclonedx-python-lib's strict validator."""
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    text = path.read_text()
    validator = JsonStrictValidator(SchemaVersion.V1_6)
    assert validator.validate_str(text) is None
    doc = json.loads(text)
    broken = json.loads(text)
    broken["components"][0]["licenses"] = [{"license": {"id": "NOT-AN-SPDX-ID"}}]
    assert validator.validate_str(json.dumps(broken)) is not None  # the validator does reject a bad document
    assert doc["bomFormat"] == "CycloneDX" and doc["specVersion"] == "1.6"
    return doc


def test_sbom_lists_exactly_the_wheelhouse(aggregator_install, houses, tmp_path):
    bin_dir, _, _ = aggregator_install
    docs = {}
    for role in ROLES:
        out = tmp_path / f"fedclinic-{role}.cdx.json"
        assert sbom.main(["--wheelhouse", str(houses / role), "--out", str(out)]) == 0
        docs[role] = validate_cyclonedx(out)
        assert sbom_versions(docs[role]) == manifest_versions(houses / role)
        hashes = {w["name"]: w["sha256"] for w in json.loads((houses / role / "manifest.json").read_text())["wheels"]}
        for comp in docs[role]["components"] + [docs[role]["metadata"]["component"]]:
            assert comp["hashes"] == [{"alg": "SHA-256", "content": hashes[wheelhouse.canonical_name(comp["name"])]}]
    for role, doc in docs.items():
        root = doc["metadata"]["component"]
        assert (root["name"], root["version"]) == ("fedclinic", "0.1.0")
        assert any(d["ref"] == root["bom-ref"] and d.get("dependsOn") for d in doc["dependencies"])
    agg = sbom_versions(docs["aggregator"])
    assert agg["grpcio"] == "1.85.1" and agg["protobuf"] == "7.36.2" and agg["cryptography"] == "50.0.2"
    assert "torch" not in agg
    purls = {c["name"]: c.get("purl") for c in docs["aggregator"]["components"]}
    assert purls["grpcio"].startswith("pkg:pypi/grpcio@1.85.1")
    if FULL_AGENT:
        assert sbom_versions(docs["agent"])["torch"].startswith("2.13.0")
        purls = {c["name"]: c.get("purl") for c in docs["agent"]["components"]}
        assert purls["torch"].startswith("pkg:pypi/torch@2.13.0")
    # what the SBOM says is what an offline install of the same folder put into a fresh environment
    on_host = installed(bin_dir, tmp_path)
    assert {n: v for n, v in on_host.items() if n not in ("pip", "setuptools")} == agg


@pytest.mark.slow
@pytest.mark.skipif(not FULL_AGENT, reason="installs torch (minutes on 2 cores): `make test-offline` runs it")
def test_agent_installs_offline_and_checks_its_config(houses, tmp_path):
    folder = houses / "agent"
    run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=folder)
    bin_dir = fresh_venv(tmp_path / "venv")
    report, output = offline_install(bin_dir, folder, tmp_path)
    assert "Looking in indexes" not in output and "/opt/wheels" not in output, output
    assert assert_all_from(report, folder) == manifest_versions(folder)
    version = run([bin_dir / "python", "-c", "import torch, transformers; print(torch.__version__)"], cwd=tmp_path)
    assert version.stdout.strip().startswith("2.13.0")
    # the sample agent.toml of docs/hospital-it.md: credentials from `fedclinic pki request` on the host and
    # `fedclinic pki issue --csr` at the operator's, one JSONL dataset
    tls = tmp_path / "tls"
    run([bin_dir / "fedclinic", "pki", "request", "--role", "agent", "--name", "st-mary", "--out", tls], cwd=tmp_path)
    ca = make_ca(tmp_path)
    pki.issue(ca, role="agent", name="st-mary", out_dir=tls, csr_path=tls / "st-mary.csr")
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "chest pain", "label": "cardio"}\n')
    config = tmp_path / "agent.toml"
    config.write_text(f'aggregator = "localhost:7443"\nwork_dir = "{tmp_path / "work"}"\n[tls]\n'
                      f'cert = "{tls / "st-mary.crt"}"\nkey = "{tls / "st-mary.key"}"\nca = "{ca / "ca.crt"}"\n'
                      f'[datasets.notes]\npath = "{data}"\nformat = "jsonl"\n')
    ok = run([bin_dir / "hospital-agent", "check-config", "--config", config], cwd=tmp_path)
    assert "configuration OK" in ok.stdout and "site 'st-mary'" in ok.stdout
    doc_path = tmp_path / "agent.cdx.json"
    assert sbom.main(["--wheelhouse", str(folder), "--out", str(doc_path)]) == 0
    on_host = installed(bin_dir, tmp_path)
    assert {n: v for n, v in on_host.items() if n != "pip"} == sbom_versions(validate_cyclonedx(doc_path))
