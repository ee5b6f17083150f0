"""deploy/kubernetes/overlays/ha (issue 21, hot standby): two aggregator replicas on one ReadWriteMany volume, the
database URL and password from a Secret, a PodDisruptionBudget, a Service per replica, probes that accept the
standby's NOT_SERVING, egress to the database only; rendered offline with `kubectl kustomize`, checked per kind like
the other overlays and strictly against the Kubernetes API schemas (kubernetes-validate)."""

from __future__ import annotations

import tomllib

import pytest

from tests.unit.deploy.test_kubernetes import K8S, KUBECTL, _check_restricted, _pod_spec, _render

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed here: manifests cannot be rendered")
HA = K8S / "overlays" / "ha"


@pytest.fixture(scope="module")
def rendered() -> list[dict]:
    return _render(HA)


def _one(rendered, kind: str, name: str | None = None) -> dict:
    (obj,) = [o for o in rendered if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    return obj


def test_two_restricted_replicas_share_one_read_write_many_volume(rendered):
    sts = _one(rendered, "StatefulSet")
    _check_restricted(sts)
    assert sts["spec"]["replicas"] == 2 and "volumeClaimTemplates" not in sts["spec"]
    spec = _pod_spec(sts)
    volumes = {v["name"]: v for v in spec["volumes"]}
    claim = volumes["state"]["persistentVolumeClaim"]["claimName"]
    pvc = _one(rendered, "PersistentVolumeClaim", claim)
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
    cm = _one(rendered, "ConfigMap")
    toml = tomllib.loads(cm["data"]["aggregator.toml"])
    assert mounts[toml["state_dir"]] == "state"  # the same path in both replicas (spill paths are stored)
    anti = spec["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"


def test_the_database_comes_from_a_secret_and_the_config_loads_with_the_real_loader(rendered, tmp_path, monkeypatch):
    from aggregator_service.config import AggregatorConfig

    c = _pod_spec(_one(rendered, "StatefulSet"))["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    for name, key in (("FEDCLINIC_AGGREGATOR_STATE__DATABASE", "dsn"), ("FEDCLINIC_DATABASE_PASSWORD", "password")):
        assert "value" not in env[name]
        assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "fedclinic-aggregator-db", "key": key}
    text = _one(rendered, "ConfigMap")["data"]["aggregator.toml"]
    assert "postgresql://" not in text  # no database address, let alone a password, in the ConfigMap
    path = tmp_path / "aggregator.toml"
    path.write_text(text)
    monkeypatch.setenv("FEDCLINIC_AGGREGATOR_STATE__DATABASE", "postgresql://fedclinic@db.example.org:5432/fedclinic")
    config = AggregatorConfig.load(path)
    assert config.ha.enabled and config.state.is_postgresql
    monkeypatch.delenv("FEDCLINIC_AGGREGATOR_STATE__DATABASE")
    from fedclinic.errors import ConfigError

    with pytest.raises(ConfigError, match="needs the state in PostgreSQL"):  # the Secret missing: a clear error
        AggregatorConfig.load(path)


def test_probes_accept_the_standby_and_a_disruption_takes_one_replica(rendered):
    sts = _one(rendered, "StatefulSet")
    c = _pod_spec(sts)["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["FEDCLINIC_PROBE_ANSWERING"] == "1"  # fedclinic-healthcheck: NOT_SERVING is alive
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["exec"]["command"][1] == "/usr/local/bin/fedclinic-healthcheck"
    pdb = _one(rendered, "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_a_service_per_replica_and_egress_to_the_database_only(rendered):
    for i in (0, 1):
        svc = _one(rendered, "Service", f"fedclinic-aggregator-{i}")
        assert svc["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == f"fedclinic-aggregator-{i}"
    pol = _one(rendered, "NetworkPolicy", "fedclinic-aggregator")
    ports = sorted((p["port"], p["protocol"]) for rule in pol["spec"]["egress"] for p in rule["ports"])
    assert ports == [(53, "TCP"), (53, "UDP"), (5432, "TCP")]
    db = next(r for r in pol["spec"]["egress"] if r.get("to"))
    assert all("0.0.0.0/0" != peer["ipBlock"]["cidr"] for peer in db["to"])
    assert all(o["metadata"].get("namespace") == "fedclinic-ha" for o in rendered if o["kind"] != "Namespace")
    assert _one(rendered, "Namespace")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_strict_schema_validation(rendered):
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    for version in ("1.30.0", "1.37.0"):
        for obj in rendered:
            kv.validate(obj, version, strict=True)
