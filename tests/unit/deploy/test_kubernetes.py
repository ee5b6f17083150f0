"""deploy/kubernetes: every kustomization's resources exist, the overlay and bases render with
`kubectl kustomize` (offline), and every rendered object passes per-kind checks: restricted pod security,
probes on the gRPC health service, resources, certificate Secrets, persistent state, GPU, network policies.
Strict schema validation (kubernetes-validate, offline JSON schemas) runs when that package is importable."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the manifests")

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "deploy" / "kubernetes"
KUSTOMIZATIONS = [K8S / "base" / "aggregator", K8S / "base" / "agent", K8S / "overlays" / "example",
                  K8S / "overlays" / "ha"]
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed here: manifests cannot be "
                                   "rendered (the file-level checks still run)")


def _kustomization(folder: Path) -> dict:
    return yaml.safe_load((folder / "kustomization.yaml").read_text())


def _referenced_files(folder: Path) -> list[Path]:
    """Every file or folder a kustomization names (resources, patches, generator files), recursively."""
    k = _kustomization(folder)
    out: list[Path] = []
    for res in k.get("resources", []):
        path = (folder / res).resolve()
        out.append(path)
        if path.is_dir():
            out.extend(_referenced_files(path))
    for patch in k.get("patches", []) + k.get("patchesStrategicMerge", []):
        if isinstance(patch, dict) and "path" in patch:
            out.append((folder / patch["path"]).resolve())
        elif isinstance(patch, str):
            out.append((folder / patch).resolve())
    for gen in k.get("configMapGenerator", []) + k.get("secretGenerator", []):
        for f in gen.get("files", []):
            out.append((folder / f.split("=", 1)[-1]).resolve())
    return out


def _render(folder: Path) -> list[dict]:
    done = subprocess.run([KUBECTL, "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


# file level (always) ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_every_referenced_file_exists(folder):
    files = _referenced_files(folder)
    assert files, f"{folder} references nothing"
    missing = [str(p) for p in files if not p.exists()]
    assert not missing, f"missing: {missing}"


def test_every_yaml_file_is_used_and_parses():
    used = {p for folder in KUSTOMIZATIONS for p in _referenced_files(folder)}
    for path in sorted(K8S.rglob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        assert docs and all("apiVersion" in d and "kind" in d for d in docs), path
        if path.name != "kustomization.yaml":
            assert path.resolve() in used, f"{path} is not referenced by any kustomization"


def test_no_secret_material_in_the_tree():
    for path in K8S.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert "PRIVATE KEY" not in text and "BEGIN CERTIFICATE" not in text, path
            if path.suffix == ".yaml":
                for doc in yaml.safe_load_all(text):
                    assert not doc or doc.get("kind") != "Secret", f"{path}: Secrets are created by the operator"
                    assert not doc or "secretGenerator" not in doc, path


def test_configs_load_with_the_real_loaders_and_match_the_mounts():
    from aggregator_service.config import AggregatorConfig
    from hospital_agent.config import AgentConfig

    agg = AggregatorConfig.load(K8S / "base" / "aggregator" / "aggregator.toml")
    assert str(agg.state_dir) == "/var/lib/fedclinic-aggregator"
    assert agg.listen.endswith(":7443") and agg.crl is not None
    assert agg.metrics_address is not None and agg.metrics_address.port == 9464
    agent = AgentConfig.load(K8S / "base" / "agent" / "agent.toml")
    assert str(agent.work_dir) == "/var/lib/hospital-agent"
    assert all(str(d.path).startswith("/data/fl/") for d in agent.datasets.values())
    assert set(agent.policy.allowed_datasets) <= set(agent.datasets)


# rendered objects ------------------------------------------------------------------------------------------
def _pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def _check_restricted(obj: dict) -> None:
    """The Pod Security 'restricted' profile, plus a read-only root filesystem and no API token."""
    name = f"{obj['kind']}/{obj['metadata']['name']}"
    spec = _pod_spec(obj)
    psc = spec.get("securityContext", {})
    assert psc.get("runAsNonRoot") is True, name
    assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", name
    assert spec.get("automountServiceAccountToken") is False, name
    assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), name
    for c in spec["containers"] + spec.get("initContainers", []):
        sc = c.get("securityContext", {})
        where = f"{name} container {c['name']}"
        assert sc.get("allowPrivilegeEscalation") is False, where
        assert sc.get("readOnlyRootFilesystem") is True, where
        assert sc.get("capabilities", {}).get("drop") == ["ALL"], where
        assert not sc.get("capabilities", {}).get("add"), where
        assert sc.get("privileged") in (None, False), where
        assert sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True, where
        assert (sc.get("runAsUser", psc.get("runAsUser")) or 0) > 0, where
        assert "limits" in c.get("resources", {}) and "requests" in c["resources"], where
        assert "memory" in c["resources"]["limits"], where
        assert ":" in c["image"] and not c["image"].endswith(":latest"), where
        for vm in c.get("volumeMounts", []):
            assert "subPath" not in vm, f"{where}: subPath mounts never see Secret/ConfigMap updates (CRL reload)"
    for v in spec.get("volumes", []):
        assert "hostPath" not in v, f"{name}: hostPath volume {v['name']}"


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    if KUBECTL is None:
        pytest.skip("kubectl is not installed here: manifests cannot be rendered")
    return _render(K8S / "overlays" / "example")


@needs_kubectl
@pytest.mark.parametrize("folder", KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(K8S)))
def test_each_kustomization_renders(folder):
    objs = _render(folder)
    assert objs and all(o.get("metadata", {}).get("name") for o in objs)


@needs_kubectl
def test_rendered_objects_pass_per_kind_checks(rendered):
    kinds = sorted(o["kind"] for o in rendered)
    assert kinds.count("NetworkPolicy") == 3 and "StatefulSet" in kinds and "Deployment" in kinds
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in rendered}
    checked = set()
    for obj in rendered:
        kind = obj["kind"]
        assert obj["metadata"].get("namespace", "fedclinic-example") == "fedclinic-example" or kind == "Namespace"
        if kind in ("StatefulSet", "Deployment"):
            _check_restricted(obj)
            volumes = {v["name"]: v for v in _pod_spec(obj)["volumes"]}
            secrets = {v["secret"]["secretName"] for v in volumes.values() if "secret" in v}
            assert "fedclinic-ca" in secrets, obj["metadata"]["name"]
            for v in volumes.values():
                if "secret" in v:
                    assert v["secret"].get("defaultMode", 0o644) & 0o007 == 0, "certificate keys world-readable"
                if "configMap" in v:
                    assert ("ConfigMap", v["configMap"]["name"]) in by_name, v
        elif kind == "Namespace":
            labels = obj["metadata"]["labels"]
            assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
        elif kind == "NetworkPolicy":
            assert sorted(obj["spec"]["policyTypes"]) == ["Egress", "Ingress"]
        elif kind == "ServiceAccount":
            assert obj.get("automountServiceAccountToken") is False
        checked.add(kind)
    assert {"StatefulSet", "Deployment", "NetworkPolicy", "Service", "Namespace"} <= checked


@needs_kubectl
def test_aggregator_statefulset_state_probes_and_secrets(rendered):
    sts = next(o for o in rendered if o["kind"] == "StatefulSet")
    assert sts["spec"]["replicas"] == 1
    claim = sts["spec"]["volumeClaimTemplates"][0]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and claim["spec"]["resources"]["requests"]["storage"]
    spec = _pod_spec(sts)
    c = spec["containers"][0]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/var/lib/fedclinic-aggregator"]["name"] == claim["metadata"]["name"]
    cm = next(o for o in rendered if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("fedclinic-aggregator"))
    toml = tomllib.loads(cm["data"]["aggregator.toml"])
    for key in ("cert", "key", "ca", "crl"):
        folder = str(Path(toml["tls"][key]).parent)
        assert folder in mounts and mounts[folder]["readOnly"] is True, key
    assert toml["state_dir"] in mounts
    assert "/etc/fedclinic/config/aggregator.toml" in c["args"] and mounts["/etc/fedclinic/config"]["readOnly"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    assert secrets == {"tls": "fedclinic-aggregator-tls", "ca": "fedclinic-ca"}
    # probes ask grpc.health.v1 over mTLS (the kubelet's grpc probe has no client certificate)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        cmd = c[probe]["exec"]["command"]
        assert cmd[1] == "/usr/local/bin/fedclinic-healthcheck", probe
        assert c[probe]["timeoutSeconds"] >= 3
    assert "fedclinic.v1.AgentService" in c["readinessProbe"]["exec"]["command"]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["FEDCLINIC_PROBE_CERT"] == toml["tls"]["cert"] and env["FEDCLINIC_PROBE_CA"] == toml["tls"]["ca"]
    assert c["ports"][0]["containerPort"] == int(toml["listen"].rsplit(":", 1)[1])
    # grace: the aggregator gives in-flight calls 10 s after SIGTERM
    from aggregator_service.server import Aggregator
    import inspect

    grace = inspect.signature(Aggregator.stop).parameters["grace"].default
    assert spec["terminationGracePeriodSeconds"] > grace
    svc = {o["metadata"]["name"]: o for o in rendered if o["kind"] == "Service"}
    assert svc["fedclinic-aggregator-headless"]["spec"]["clusterIP"] == "None"
    assert sts["spec"]["serviceName"] == "fedclinic-aggregator-headless"
    assert svc["fedclinic-aggregator"]["spec"]["type"] == "LoadBalancer"       # the example overlay
    assert svc["fedclinic-aggregator"]["spec"]["loadBalancerSourceRanges"]


@needs_kubectl
def test_agent_deployment_gpu_data_and_outbound_only(rendered):
    dep = next(o for o in rendered if o["kind"] == "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"
    spec = _pod_spec(dep)
    c = spec["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert not c.get("ports"), "the agent serves nothing"
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert volumes[mounts["/data/fl"]["name"]]["persistentVolumeClaim"]["readOnly"] is True
    assert mounts["/data/fl"]["readOnly"] is True
    work = volumes[mounts["/var/lib/hospital-agent"]["name"]]["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", work) in {(o["kind"], o["metadata"]["name"]) for o in rendered}
    cm = next(o for o in rendered if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("hospital-agent"))
    toml = tomllib.loads(cm["data"]["agent.toml"])
    assert toml["work_dir"] in mounts
    for key in ("cert", "key", "ca"):
        assert str(Path(toml["tls"][key]).parent) in mounts, key
    netpol = next(o for o in rendered if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "hospital-agent")
    assert netpol["spec"]["ingress"] == []                       # nothing comes in
    ports = sorted({p["port"] for rule in netpol["spec"]["egress"] for p in rule["ports"]})
    assert ports == [53, 7443]
    cidrs = [peer["ipBlock"]["cidr"] for rule in netpol["spec"]["egress"] for peer in rule.get("to", [])
             if "ipBlock" in peer]
    assert cidrs and "0.0.0.0/0" not in cidrs                   # the overlay pins the aggregator's address
    agg_pol = next(o for o in rendered if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "fedclinic-aggregator")
    assert agg_pol["spec"]["egress"] == []                       # the aggregator dials no one
    assert [p["port"] for rule in agg_pol["spec"]["ingress"] for p in rule["ports"]] == [7443]


@needs_kubectl
def test_aggregator_metrics_port_is_cluster_internal_and_open_to_the_monitoring_namespace_only(rendered):
    sts = next(o for o in rendered if o["kind"] == "StatefulSet")
    ports = {p["name"]: p["containerPort"] for p in _pod_spec(sts)["containers"][0]["ports"]}
    cm = next(o for o in rendered if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("fedclinic-aggregator"))
    assert ports["metrics"] == int(tomllib.loads(cm["data"]["aggregator.toml"])["metrics_address"].rsplit(":", 1)[1])
    svc = {o["metadata"]["name"]: o for o in rendered if o["kind"] == "Service"}
    metrics = svc["fedclinic-aggregator-metrics"]
    assert metrics["spec"]["type"] == "ClusterIP" and [p["targetPort"] for p in metrics["spec"]["ports"]] == ["metrics"]
    notes = metrics["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/port"] == str(ports["metrics"])
    for name in ("fedclinic-aggregator", "fedclinic-aggregator-headless"):  # never on a published Service
        assert ports["metrics"] not in [p["port"] for p in svc[name]["spec"]["ports"]], name
    pol = next(o for o in rendered if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "fedclinic-aggregator-metrics")
    assert pol["spec"]["egress"] == []
    (rule,) = pol["spec"]["ingress"]
    assert [p["port"] for p in rule["ports"]] == [ports["metrics"]]
    (peer,) = rule["from"]
    assert set(peer) == {"namespaceSelector", "podSelector"} and peer["namespaceSelector"]["matchLabels"]
    others = [o for o in rendered if o["kind"] == "NetworkPolicy" and o is not pol]
    assert all(p["port"] != ports["metrics"] for o in others for r in o["spec"]["ingress"] for p in r.get("ports", []))


@needs_kubectl
def test_checks_catch_a_weakened_manifest(rendered):
    import copy

    sts = copy.deepcopy(next(o for o in rendered if o["kind"] == "StatefulSet"))
    _check_restricted(sts)
    sts["spec"]["template"]["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = True
    with pytest.raises(AssertionError):
        _check_restricted(sts)


@needs_kubectl
def test_strict_schema_validation(rendered, tmp_path):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (pip install "
                             "kubernetes-validate): rendered objects are not checked against the API schemas")
    for version in ("1.30.0", "1.37.0"):
        for obj in rendered:
            kv.validate(obj, version, strict=True)
