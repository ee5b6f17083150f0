"""deploy/docker: both images run as a non-root user, copy only source files that exist (never keys,
certificates or the whole context), the aggregator image installs no torch, the agent image installs torch
first on a CUDA base. (No Docker daemon here: the images are checked as files, not built.)"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCKER = ROOT / "deploy" / "docker"
FILES = {"aggregator": DOCKER / "Dockerfile.aggregator", "agent": DOCKER / "Dockerfile.agent"}
SECRET_PATTERNS = ("*.key", "*.pem", "*.crt", "*.csr", "*.p12", "*.pfx", "*.env", ".env", "id_rsa*", "*secret*",
                   "*token*", "*.sqlite*", "ca", "pki", ".git")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, f"{path}: dangling line continuation"
    return out


def _final_stage(ins: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (w, _) in enumerate(ins) if w == "FROM")
    return ins[last_from:]


def _copy_sources(args: str) -> list[str]:
    parts = [p for p in args.split() if not p.startswith("--")]
    return parts[:-1]


@pytest.mark.parametrize("name", sorted(FILES))
def test_runs_as_non_root(name):
    final = _final_stage(instructions(FILES[name]))
    users = [a for w, a in final if w == "USER"]
    assert users, f"{name}: no USER in the final stage (it would run as root)"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and user.isdigit() and int(user) >= 1000, \
        f"{name}: USER {users[-1]} (use a numeric non-root UID so runAsNonRoot can check it)"
    # nothing after USER switches back to root
    after = final[[w for w, _ in final].index("USER"):]
    assert all(not (w == "USER" and a.split(":")[0] in ("root", "0")) for w, a in after)


@pytest.mark.parametrize("name", sorted(FILES))
def test_copies_no_secrets_and_only_existing_sources(name):
    for word, args in instructions(FILES[name]):
        assert word != "ADD", f"{name}: use COPY (ADD fetches URLs and unpacks archives)"
        if word != "COPY" or "--from=" in args:
            continue
        for src in _copy_sources(args):
            assert src not in (".", "./", "*"), f"{name}: COPY of the whole build context"
            for pattern in SECRET_PATTERNS:
                assert not fnmatch.fnmatch(Path(src).name.lower(), pattern), f"{name}: COPY {src} looks like a secret"
            assert (ROOT / src).exists(), f"{name}: COPY source {src} does not exist"
        for word2, args2 in instructions(FILES[name]):
            if word2 in ("ENV", "ARG"):
                assert not re.search(r"(PASSWORD|SECRET|TOKEN|PRIVATE_KEY)\s*=", args2, re.I), args2


@pytest.mark.parametrize("name", sorted(FILES))
def test_dockerignore_keeps_keys_out_of_the_context(name):
    ignore = (DOCKER / f"{FILES[name].name}.dockerignore").read_text().splitlines()
    rules = [r.strip() for r in ignore if r.strip() and not r.startswith("#")]
    assert rules[0] == "*", "deny by default, then allow what the Dockerfile copies"
    for pattern in ("**/*.key", "**/*.pem", "**/*.crt"):
        assert pattern in rules
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    for word, args in instructions(FILES[name]):
        if word == "COPY" and "--from=" not in args:
            for src in _copy_sources(args):
                assert src.rstrip("/") in allowed, f"{src} is copied but the .dockerignore keeps it out"


def _extra_requires(extra: str, project: dict, seen=None) -> list[str]:
    seen = seen or set()
    out = []
    for req in project["optional-dependencies"].get(extra, []):
        m = re.fullmatch(r"fedclinic\[(.+)\]", req)
        if m:
            for sub in m.group(1).split(","):
                if sub not in seen:
                    seen.add(sub)
                    out += _extra_requires(sub.strip(), project, seen)
        else:
            out.append(req)
    return out


def test_aggregator_image_installs_no_torch():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    ins = instructions(FILES["aggregator"])
    runs = " ".join(a for w, a in ins if w == "RUN")
    assert "torch" not in runs.replace('import torch"', "")        # the only mention is the check that it is absent
    installs = re.findall(r"pip install [^&]*?(/src\S*)", runs)
    assert installs, "the aggregator image does not pip install fedclinic"
    for target in installs:
        extras = re.findall(r"\[(.+?)\]", target)
        for extra in ",".join(extras).split(",") if extras else []:
            deps = _extra_requires(extra.strip(), project)
            assert not any(d.split("[")[0].split(">")[0].split("=")[0] == "torch" for d in deps), extra
    assert not any(d.startswith("torch") for d in project["dependencies"])
    assert FILES["aggregator"].read_text().count("FROM ") >= 2 and "python:3.11" in FILES["aggregator"].read_text()


def test_agent_image_is_cuda_based_and_installs_torch_first():
    text = FILES["agent"].read_text()
    ins = instructions(FILES["agent"])
    assert re.search(r"CUDA_IMAGE=nvidia/cuda:\d+\.\d+", text)
    assert all(a.startswith("${CUDA_IMAGE}") for w, a in ins if w == "FROM")
    runs = [a for w, a in ins if w == "RUN"]
    torch_at = next(i for i, r in enumerate(runs) if "torch==" in r)
    fedclinic_at = next(i for i, r in enumerate(runs) if "[agent]" in r)
    assert torch_at < fedclinic_at
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    agent_extras = {e.strip() for d in project["optional-dependencies"]["agent"] if d.startswith("fedclinic[")
                    for e in d[len("fedclinic["):-1].split(",")}
    assert "train" in agent_extras  # the agent installs the training stack (and its data sources)
    constraints = (ROOT / "constraints.txt").read_text()
    pinned = re.search(r"^torch==(\S+)", constraints, re.M).group(1)
    assert f"TORCH_VERSION={pinned}" in text, "the image's torch must match constraints.txt"


def test_healthcheck_script_is_what_the_probes_and_healthcheck_call():
    script = DOCKER / "fedclinic-healthcheck"
    assert script.stat().st_mode & 0o111
    compile(script.read_text(), str(script), "exec")
    text = FILES["aggregator"].read_text()
    assert "deploy/docker/fedclinic-healthcheck /usr/local/bin/fedclinic-healthcheck" in text
    assert re.search(r'HEALTHCHECK .*CMD \[.*"/usr/local/bin/fedclinic-healthcheck"\]', " ".join(text.split()))


def test_parser_sees_continuations_and_a_bad_file(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11-slim\nCOPY . /src\nRUN echo a \\\n  && echo b\n")
    ins = instructions(bad)
    assert ins[2] == ("RUN", "echo a  && echo b") and [w for w, _ in ins] == ["FROM", "COPY", "RUN"]
    FILES["bad"] = bad
    try:
        with pytest.raises(AssertionError, match="no USER"):
            test_runs_as_non_root("bad")
        with pytest.raises(AssertionError, match="whole build context"):
            test_copies_no_secrets_and_only_existing_sources("bad")
    finally:
        del FILES["bad"]
