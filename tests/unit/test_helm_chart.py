"""The Helm chart under ``helm/cdcd``.

``helm`` is not installed where these tests usually run (and cannot be downloaded there):
``helm template`` and ``helm lint`` run only when it is on the PATH. Always checked:

* Chart.yaml and values.yaml parse; the chart's appVersion is the package version;
* values.yaml has a comment above each top-level key, and the chart README documents every
  value (and no value that does not exist);
* the default ``config`` is a valid cdcd configuration (cdcd's own loader) whose writable
  paths are absolute under /var/lib/cdcd (the config folder is a read-only ConfigMap);
* each template has balanced ``{{ }}`` and ``if/range/with/define ... end`` blocks,
  ``include``s only names it defines, and references only ``.Values`` paths that exist;
* the templates, rendered by a small interpreter of the Go-template subset they use (below;
  it raises on anything it does not implement), give well-formed YAML with the expected
  objects for the defaults and for variants, and the rendered config with the pod's
  environment is what cdcd's loader accepts.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import textwrap
import tomllib
from collections.abc import Callable
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


# -- rendering ---------------------------------------------------------------------------------

VARIANT = {
    "persistence": {"enabled": False},
    "metrics": {"serviceMonitor": {"enabled": True}},
    "password": {"existingSecret": "db", "mode": "env"},
}
VARIANT_ARGS = (
    "--set",
    "persistence.enabled=false",
    "--set",
    "metrics.serviceMonitor.enabled=true",
    "--set",
    "password.existingSecret=db",
    "--set",
    "password.mode=env",
)


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


def check_variant(docs: list[dict[str, Any]]) -> None:
    kinds = by_kind(docs)
    assert set(kinds) == {"Deployment", "ConfigMap", "Service", "ServiceMonitor"}
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["data"] == {"name": "data", "emptyDir": {}}
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["CDCD_PG_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "db", "key": "password"}
    assert "CDCD_SOURCE__PASSWORD_FILE" not in env
    (endpoint,) = kinds["ServiceMonitor"]["spec"]["endpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"


def helm_template(*args: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        ["helm", "template", "shop", str(CHART), "--namespace", "cdc", *args],
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
def test_helm_template_renders(tmp_path: Path) -> None:
    check_default(helm_template(), tmp_path)
    check_variant(helm_template(*VARIANT_ARGS))
    lint = subprocess.run(["helm", "lint", str(CHART)], capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def render(overrides: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Every manifest, as ``helm template`` would print them, by the renderer below."""
    renderer = Renderer(CHART, overrides)
    docs: list[dict[str, Any]] = []
    for name in sorted(renderer.files):
        if name.startswith("_") or name == "NOTES.txt":
            continue
        text = renderer.render(name)
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    renderer.render("NOTES.txt")  # renders without error
    return docs


def test_templates_render_to_the_expected_objects(tmp_path: Path) -> None:
    check_default(render(), tmp_path)
    check_variant(render(VARIANT))


def test_password_file_mode_mounts_the_secret(tmp_path: Path) -> None:
    (deployment,) = [
        d for d in render({"password": {"existingSecret": "db"}}) if d["kind"] == "Deployment"
    ]
    pod = deployment["spec"]["template"]["spec"]
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
    (tmp_path / "cdcd.yaml").write_text(yaml.safe_dump(values()["config"]))
    config = load_config(
        tmp_path / "cdcd.yaml", env={**env, "CDCD_SOURCE__PASSWORD_FILE": str(secret)}
    )
    assert config.source.password() == "p@ss/word"


def test_a_bad_password_mode_fails_the_render() -> None:
    with pytest.raises(TemplateError, match=re.escape('password.mode must be "file" or "env"')):
        render({"password": {"mode": "both"}})


# -- a small Go-template renderer for this chart ---------------------------------------------
#
# Without helm, the templates are rendered by this interpreter of the subset of Go's
# text/template and Helm's functions the chart uses (actions with whitespace trimming, if /
# else if / else, with, range, define/include, variables, pipelines, parentheses, and the
# functions in FUNCS). It raises on anything else, so a template using more fails loudly here
# rather than passing unchecked. It is not helm: it proves the chart renders to well-formed
# Kubernetes objects under Go-template semantics as implemented here, nothing more.

_TOKEN = re.compile(
    r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<raw>`[^`]*`)|(?P<op>:=|[()|=,])'
    r"|(?P<num>-?\d+(?:\.\d+)?)|(?P<word>[$.]?[\w$.]*))"
)


class TemplateError(Exception):
    pass


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise TemplateError(f"cannot tokenize {text[pos:]!r}")
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


def _split_actions(text: str) -> list[tuple[str, str]]:
    """[("text", s) | ("action", body)] with ``{{-``/``-}}`` trimming applied."""
    parts: list[tuple[str, str]] = []
    pos = 0
    for m in re.finditer(r"\{\{(- )?(.*?)( -)?\}\}", text, re.S):
        chunk = text[pos : m.start()]
        if m.group(1):
            chunk = chunk.rstrip()
        parts.append(("text", chunk))
        parts.append(("action", m.group(2).strip()))
        pos = m.end()
        if m.group(3):
            while pos < len(text) and text[pos] in " \t\r\n":
                pos += 1
    parts.append(("text", text[pos:]))
    return parts


def _parse(parts: list[tuple[str, str]], i: int, stop: tuple[str, ...]) -> tuple[list[Any], int]:
    """Nodes until an action starting with one of ``stop`` (returned index points at it)."""
    nodes: list[Any] = []
    while i < len(parts):
        kind, body = parts[i]
        if kind == "text":
            nodes.append(("text", body))
            i += 1
            continue
        word = body.split(None, 1)[0] if body else ""
        if body.startswith("/*"):
            i += 1
        elif word in stop:
            return nodes, i
        elif word in ("if", "with", "range"):
            branches: list[tuple[str | None, list[Any]]] = []
            cond: str | None = body[len(word) :].strip()
            while True:
                block, i = _parse(parts, i + 1, ("else", "end"))
                branches.append((cond, block))
                if i >= len(parts):
                    raise TemplateError(f"unclosed {word}")
                end_body = parts[i][1]
                if end_body == "end":
                    break
                rest = end_body[len("else") :].strip()
                if rest.startswith("if "):
                    cond = rest[3:]
                elif rest:
                    raise TemplateError(f"unsupported {end_body!r}")
                else:
                    cond = None
            nodes.append((word, branches))
            i += 1
        elif word == "define":
            name = json.loads(body.split(None, 1)[1])
            block, i = _parse(parts, i + 1, ("end",))
            nodes.append(("define", name, block))
            i += 1
        else:
            nodes.append(("action", body))
            i += 1
    if stop:
        raise TemplateError(f"missing {stop}")
    return nodes, i


def _truthy(value: Any) -> bool:
    return value not in (None, False, 0, "") and not (isinstance(value, dict | list) and not value)


def _go_str(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        raise TemplateError(f"printing a collection: {value!r}")
    return str(value)


def _to_yaml(value: Any) -> str:
    return str(
        yaml.safe_dump(value, default_flow_style=False, sort_keys=True)
        .rstrip("\n")
        .removesuffix("\n...")
    )


def _printf(fmt: str, *args: Any) -> str:
    values = iter(args)

    def one(m: re.Match[str]) -> str:
        verb = m.group(0)
        if verb == "%%":
            return "%"
        value = next(values)
        return json.dumps(_go_str(value)) if verb == "%q" else _go_str(value)

    return re.sub(r"%[svqd%]", one, fmt)


def _fail(message: str) -> None:
    raise TemplateError(f"fail: {message}")


FUNCS: dict[str, Callable[..., Any]] = {
    "toYaml": _to_yaml,
    "nindent": lambda n, s: "\n" + textwrap.indent(s, " " * n),
    "indent": lambda n, s: textwrap.indent(s, " " * n),
    "quote": lambda *v: " ".join(json.dumps(_go_str(x)) for x in v),
    "default": lambda d, *v: v[0] if v and _truthy(v[0]) else d,
    "trunc": lambda n, s: s[:n],
    "trimSuffix": lambda suffix, s: s.removesuffix(suffix),
    "contains": lambda sub, s: sub in s,
    "replace": lambda old, new, s: s.replace(old, new),
    "sha256sum": lambda s: hashlib.sha256(s.encode()).hexdigest(),
    "has": lambda item, seq: item in seq,
    "list": lambda *v: list(v),
    "fail": _fail,
    "eq": lambda a, *b: any(a == x for x in b),
    "ne": lambda a, b: a != b,
    "not": lambda v: not _truthy(v),
    "and": lambda *v: next((x for x in v if not _truthy(x)), v[-1]),
    "or": lambda *v: next((x for x in v if _truthy(x)), v[-1]),
    "print": lambda *v: "".join(_go_str(x) for x in v),
    "printf": _printf,
}


class Renderer:
    def __init__(self, chart: Path, overrides: dict[str, Any] | None = None) -> None:
        meta = yaml.safe_load((chart / "Chart.yaml").read_text())
        merged = _deep_merge(yaml.safe_load((chart / "values.yaml").read_text()), overrides or {})
        self.root = {
            "Values": merged,
            "Chart": {
                "Name": meta["name"],
                "Version": meta["version"],
                "AppVersion": meta["appVersion"],
            },
            "Release": {"Name": "shop", "Namespace": "cdc", "Service": "Helm"},
            "Template": {"BasePath": f"{meta['name']}/templates"},
        }
        self.defines: dict[str, list[Any]] = {}
        self.files: dict[str, list[Any]] = {}
        for path in sorted((chart / "templates").iterdir()):
            nodes, _ = _parse(_split_actions(path.read_text()), 0, ())
            name = f"{meta['name']}/templates/{path.name}"
            self.files[path.name] = nodes
            self.defines[name] = nodes
            self._collect(nodes)

    def _collect(self, nodes: list[Any]) -> None:
        for node in nodes:
            if node[0] == "define":
                self.defines[node[1]] = node[2]

    def render(self, file_name: str) -> str:
        return self._exec(self.files[file_name], self.root, {"$": self.root})

    def _exec(self, nodes: list[Any], dot: Any, scope: dict[str, Any]) -> str:
        out = []
        for node in nodes:
            kind = node[0]
            if kind == "text":
                out.append(node[1])
            elif kind == "action":
                value = self._pipeline(node[1], dot, scope)
                if not node[1].lstrip().startswith("$") or ":=" not in node[1]:
                    out.append(_go_str(value))
            elif kind in ("if", "with"):
                for cond, block in node[1]:
                    value = True if cond is None else self._pipeline(cond, dot, scope)
                    if _truthy(value):
                        inner = value if kind == "with" and cond is not None else dot
                        out.append(self._exec(block, inner, dict(scope)))
                        break
            elif kind == "range":
                (cond, block), *rest = node[1]
                items = self._pipeline(cond, dot, scope)
                seq = list(items.values()) if isinstance(items, dict) else list(items or [])
                for item in seq:
                    out.append(self._exec(block, item, dict(scope)))
                if not seq and rest:
                    out.append(self._exec(rest[0][1], dot, dict(scope)))
        return "".join(out)

    def _pipeline(self, text: str, dot: Any, scope: dict[str, Any]) -> Any:
        tokens = _tokens(text)
        target = None
        if len(tokens) > 2 and tokens[1] == ("op", ":="):
            target = tokens[0][1]
            tokens = tokens[2:]
        value, pos = self._eval_pipe(tokens, 0, dot, scope)
        if pos != len(tokens):
            raise TemplateError(f"trailing tokens in {text!r}")
        if target is not None:
            scope[target] = value
        return value

    def _eval_pipe(
        self, tokens: list[tuple[str, str]], pos: int, dot: Any, scope: dict[str, Any]
    ) -> tuple[Any, int]:
        value: Any = None
        first = True
        while True:
            args: list[Any] = []
            head: str | None = None
            while pos < len(tokens) and tokens[pos] not in (("op", "|"), ("op", ")")):
                kind, text = tokens[pos]
                if (
                    kind == "word"
                    and not args
                    and head is None
                    and text[0] not in "$."
                    and text not in ("true", "false", "nil")
                ):
                    head = text
                    pos += 1
                    continue
                operand, pos = self._operand(tokens, pos, dot, scope)
                args.append(operand)
            if not first:
                args.append(value)
            if head is None:
                if len(args) != 1:
                    raise TemplateError(f"not a function call: {tokens}")
                value = args[0]
            elif head in ("include", "template"):
                value = self._exec(self.defines[args[0]], args[1], {"$": args[1]})
            elif head in FUNCS:
                value = FUNCS[head](*args)
            else:
                raise TemplateError(f"unknown function {head!r}")
            first = False
            if pos < len(tokens) and tokens[pos] == ("op", "|"):
                pos += 1
                continue
            return value, pos

    def _operand(
        self, tokens: list[tuple[str, str]], pos: int, dot: Any, scope: dict[str, Any]
    ) -> tuple[Any, int]:
        kind, text = tokens[pos]
        if kind == "op" and text == "(":
            value, pos = self._eval_pipe(tokens, pos + 1, dot, scope)
            if tokens[pos] != ("op", ")"):
                raise TemplateError("unbalanced parentheses")
            return value, pos + 1
        if kind == "str":
            return json.loads(text), pos + 1
        if kind == "raw":
            return text[1:-1], pos + 1
        if kind == "num":
            return (float(text) if "." in text else int(text)), pos + 1
        if text in ("true", "false"):
            return text == "true", pos + 1
        if text == "nil":
            return None, pos + 1
        if text.startswith("$"):
            name, _, path = text.partition(".")
            if name not in scope:
                raise TemplateError(f"undefined variable {name}")
            return _lookup(scope[name], path), pos + 1
        if text.startswith("."):
            return _lookup(dot, text[1:]), pos + 1
        raise TemplateError(f"unexpected {text!r}")


def _lookup(value: Any, path: str) -> Any:
    for key in filter(None, path.split(".")):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
