"""The Helm chart under ``helm/cdcd``.

``helm`` is not installed where these tests usually run (and cannot be downloaded there), so
rendering with ``helm template`` is tested only when it is on the PATH. Always checked:

* Chart.yaml and values.yaml parse; the chart's appVersion is the package version;
* values.yaml has a comment above each top-level key, and the chart README documents every
  value (and no value that does not exist);
* the default ``config`` is a valid cdcd configuration (cdcd's own loader) whose writable
  paths are absolute under /var/lib/cdcd (the config folder is a read-only ConfigMap);
* each template has balanced ``{{ }}`` and ``if/range/with/define ... end`` blocks,
  ``include``s only names it defines, and references only ``.Values`` paths that exist.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from cdcd.config import parse_config
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
ACTION = re.compile(r"\{\{-?(.*?)-?\}\}", re.S)


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


# -- templates -------------------------------------------------------------------------------


def test_template_delimiters_and_blocks_balance() -> None:
    for path in template_files():
        text = path.read_text()
        assert text.count("{{") == text.count("}}"), f"{path.name}: unbalanced {{{{ }}}}"
        stack: list[str] = []
        for match in ACTION.finditer(text):
            body = match.group(1).strip()
            if body.startswith("/*"):
                assert body.endswith("*/"), f"{path.name}: unterminated comment {body[:40]!r}"
                continue
            word = body.split(None, 1)[0] if body else ""
            if word in ("if", "range", "with", "define", "block"):
                stack.append(word)
            elif word == "end":
                assert stack, f"{path.name}: {{{{ end }}}} without an open block"
                stack.pop()
            elif word == "else":
                assert stack and stack[-1] in ("if", "range", "with"), f"{path.name}: stray else"
        assert not stack, f"{path.name}: unclosed {stack}"


def test_templates_include_only_defined_names() -> None:
    defined: set[str] = set()
    used: dict[str, str] = {}
    for path in template_files():
        text = path.read_text()
        defined |= set(re.findall(r'\{\{-?\s*define\s+"([^"]+)"', text))
        for name in re.findall(r'\b(?:include|template)\s+"([^"]+)"', text):
            used[name] = path.name
    missing = {name: where for name, where in used.items() if name not in defined}
    assert not missing, f"included but never defined: {missing}"


def test_templates_reference_only_existing_values() -> None:
    tree = values()
    bad = []
    for path in template_files():
        for ref in re.findall(r"\$?\.Values((?:\.[A-Za-z_]\w*)+)", path.read_text()):
            node: Any = tree
            for key in ref.strip(".").split("."):
                if not isinstance(node, dict) or key not in node:
                    bad.append(f"{path.name}: .Values{ref}")
                    break
                node = node[key]
    assert not bad, f"references to values missing from values.yaml: {bad}"


# -- rendering (only where helm is installed) ------------------------------------------------


def helm_template(*args: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        ["helm", "template", "shop", str(CHART), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.mark.skipif(
    shutil.which("helm") is None,
    reason="helm is not installed here (no Debian or PyPI package ships it; no download)",
)
def test_helm_template_renders() -> None:
    docs = helm_template()
    kinds = {doc["kind"]: doc for doc in docs}
    assert {"Deployment", "ConfigMap", "Service", "PersistentVolumeClaim"} <= set(kinds)
    deployment = kinds["Deployment"]
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    env = {e["name"]: e for e in container["env"]}
    assert env["CDCD_HTTP__LISTEN"]["value"] == "0.0.0.0:8080"
    config = yaml.safe_load(kinds["ConfigMap"]["data"]["cdcd.yaml"])
    assert config == values()["config"]

    docs = helm_template(
        "--set",
        "persistence.enabled=false",
        "--set",
        "metrics.serviceMonitor.enabled=true",
        "--set",
        "password.existingSecret=db",
        "--set",
        "password.mode=env",
    )
    kinds = {doc["kind"]: doc for doc in docs}
    assert "PersistentVolumeClaim" not in kinds and "ServiceMonitor" in kinds
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["data"] == {"name": "data", "emptyDir": {}}
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["CDCD_PG_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "db", "key": "password"}
