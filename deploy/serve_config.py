"""KvmeshConfig <-> Ray Serve config file (the ``serve deploy`` YAML and KubeRay's serveConfigV2).

The whole KvmeshConfig travels as the ``args`` of one Serve application, so the config file,
the CLI ``--set`` overrides and the Helm values' ``kvmesh:`` block are one tree:

    proxy_location: Disabled
    applications:
    - name: kvmesh
      route_prefix: /
      import_path: kvmesh.deploy.serve_app:build_app
      args: {model: {...}, cache: {...}, ..., observability: {...}}   # KvmeshConfig.to_dict()

Two values are secrets on Kubernetes and reach the process as plumbing instead of args:
the Redis URL (``KVMESH_REDIS_URL``, from a Secret) and the tenants' API-key hashes (a YAML
file ``{tenant_id: [hash, ...]}`` mounted from a Secret, path in ``KVMESH_API_KEY_HASHES_FILE``).
``config_from_serve_args`` merges them back; the Serve app builder calls it on its args.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from kvmesh.core.config import ConfigError, KvmeshConfig

logger = logging.getLogger(__name__)

SERVE_APP_IMPORT_PATH = "kvmesh.deploy.serve_app:build_app"
REDIS_URL_ENV = "KVMESH_REDIS_URL"
API_KEY_HASHES_FILE_ENV = "KVMESH_API_KEY_HASHES_FILE"
# Serve's proxies stay off: each router replica serves HTTP on router.http_port and gRPC on
# router.grpc_port itself (router/http_ingress.py, router/grpc_ingress.py); a Serve proxy would
# take one of those ports from the replicas, and the app declares no route for it to serve.
PROXY_LOCATION = "Disabled"


@dataclass(frozen=True)
class ServeOptions:
    """What the Serve file carries besides the KvmeshConfig (Serve's own plumbing). The Helm
    values serve.proxyLocation, serve.routePrefix and serve.grpcServicerFunctions map here and
    are held to what the replicas' own servers do."""

    app_name: str = "kvmesh"
    # The replicas' servers answer at the root ("/v1/...", "/health", "/metrics").
    route_prefix: str = "/"
    proxy_location: str = PROXY_LOCATION
    # Servicers for Serve's own gRPC proxy: none, as no Serve proxy runs.
    grpc_servicer_functions: tuple[str, ...] = ()

    def validate(self) -> None:
        if not self.app_name:
            raise ConfigError("serve app_name must be non-empty")
        if self.route_prefix != "/":
            raise ConfigError(f"serve route_prefix must be '/': the router replicas serve the API at the root "
                              f"of router.http_port themselves, got {self.route_prefix!r}")
        if self.proxy_location != PROXY_LOCATION:
            raise ConfigError(f"serve proxy_location must be {PROXY_LOCATION!r}: the router replicas serve "
                              f"router.http_port and router.grpc_port themselves, got {self.proxy_location!r}")
        if self.grpc_servicer_functions:
            raise ConfigError("serve grpc_servicer_functions must be empty: no Serve gRPC proxy runs; the router "
                              "replicas serve kvmesh.v1 on router.grpc_port themselves")


# ---- KvmeshConfig -> Serve file -------------------------------------------------------


def build_serve_config(config: KvmeshConfig, options: ServeOptions = ServeOptions()) -> dict:
    """The Serve config file (a plain dict) that deploys `config`; checked by Ray's schema."""
    options.validate()
    serve_config: dict[str, Any] = {"proxy_location": options.proxy_location}
    serve_config["applications"] = [{
        "name": options.app_name,
        "route_prefix": options.route_prefix,
        "import_path": SERVE_APP_IMPORT_PATH,
        "args": config.to_dict(),
    }]
    validate_with_ray_schema(serve_config)
    return serve_config


class _IndentedListDumper(yaml.SafeDumper):
    """Indents list items under their key (the style yamllint and kubectl output expect)."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        return super().increase_indent(flow, False)


def serve_config_yaml(serve_config: dict) -> str:
    """YAML text in the key order Serve's docs use (not sorted), stable across runs."""
    return yaml.dump(serve_config, Dumper=_IndentedListDumper, sort_keys=False, default_flow_style=False)


def validate_with_ray_schema(serve_config: dict) -> None:
    """Parse with Ray's own ServeDeploySchema (what `serve deploy` and KubeRay's head run)."""
    from pydantic import ValidationError  # ray.serve.schema is pydantic; imported with it
    from ray.serve.schema import ServeDeploySchema

    try:
        ServeDeploySchema.model_validate(serve_config)
    except ValidationError as exc:
        raise ConfigError(f"Serve config rejected by Ray's ServeDeploySchema: {exc}") from None


# ---- Serve file -> KvmeshConfig -------------------------------------------------------


def kvmesh_app(serve_config: dict, app_name: str | None = None) -> dict:
    """The application entry that runs kvmesh (by import path, or by name when given)."""
    if not isinstance(serve_config, dict):
        raise ConfigError(f"Serve config must be a mapping, got {type(serve_config).__name__}")
    apps = serve_config.get("applications") or []
    matches = [a for a in apps if isinstance(a, dict) and a.get("import_path") == SERVE_APP_IMPORT_PATH
               and (app_name is None or a.get("name") == app_name)]
    if len(matches) != 1:
        raise ConfigError(f"Serve config must hold exactly one application with import_path "
                          f"{SERVE_APP_IMPORT_PATH!r}{'' if app_name is None else f' named {app_name!r}'}; "
                          f"found {len(matches)}")
    return matches[0]


def kvmesh_config_from_serve_config(serve_config: dict, app_name: str | None = None) -> KvmeshConfig:
    """Validate a whole Serve file (Ray's schema, then ours) and return the app's KvmeshConfig."""
    validate_with_ray_schema(serve_config)
    return KvmeshConfig.from_dict(kvmesh_app(serve_config, app_name).get("args") or {})


def config_from_serve_args(args: Mapping | None, environ: Mapping[str, str] = os.environ) -> KvmeshConfig:
    """The KvmeshConfig a Serve app builder runs with: its args plus the secret plumbing.

    - ``KVMESH_REDIS_URL`` set: it becomes tenants.redis_url (args must then leave it null,
      so there is never a question which of two URLs wins).
    - ``KVMESH_API_KEY_HASHES_FILE`` set: the file's ``{tenant_id: [hash, ...]}`` is added to
      the matching tenants' api_key_hashes; a tenant id absent from the config is an error.
    """
    data = KvmeshConfig.from_dict(dict(args or {})).to_dict()  # validates, fills defaults
    redis_url = environ.get(REDIS_URL_ENV)
    if redis_url:
        if data["tenants"]["redis_url"] is not None:
            raise ConfigError(f"tenants.redis_url is set in the config and in ${REDIS_URL_ENV}; keep one")
        data["tenants"]["redis_url"] = redis_url
    hashes_file = environ.get(API_KEY_HASHES_FILE_ENV)
    if hashes_file:
        _merge_api_key_hashes(data["tenants"]["tenants"], load_api_key_hashes(hashes_file))
    return KvmeshConfig.from_dict(data)


def load_api_key_hashes(path: str) -> dict[str, list[str]]:
    """Read ``{tenant_id: [hash, ...]}`` (the Secret's file); only salted hashes belong there."""
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as exc:
        raise ConfigError(f"cannot read API key hashes file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping tenant_id -> [hash, ...]")
    for tenant_id, hashes in data.items():
        if not isinstance(hashes, list) or not all(isinstance(h, str) and h.count("$") == 2 for h in hashes):
            raise ConfigError(f"{path}: tenant {tenant_id!r} must map to a list of "
                              f"'scheme$salt$hexdigest' strings")
    return data


def _merge_api_key_hashes(tenants: list[dict], hashes_by_tenant: dict[str, list[str]]) -> None:
    by_id = {t["id"]: t for t in tenants}
    unknown = sorted(set(hashes_by_tenant) - set(by_id))
    if unknown:
        raise ConfigError(f"API key hashes for tenant(s) {unknown} that the config does not define")
    for tenant_id, hashes in hashes_by_tenant.items():
        merged = list(by_id[tenant_id]["api_key_hashes"])
        merged += [h for h in hashes if h not in merged]
        by_id[tenant_id]["api_key_hashes"] = merged
    logger.info("API key hashes loaded for %d tenant(s)", len(hashes_by_tenant))


# ---- CLI flags onto the same fields -------------------------------------------------


def config_field_paths(config: KvmeshConfig | None = None) -> list[str]:
    """Every ``section.field`` of the tree (what the Helm values and --set must cover)."""
    config = config or KvmeshConfig()
    return [f"{section.name}.{f.name}"
            for section in dataclasses.fields(config)
            for f in dataclasses.fields(getattr(config, section.name))]
