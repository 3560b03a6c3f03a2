"""The Serve application import path: `kvmesh.deploy.serve_app:build_app`.

Used by Serve config files (`kvmesh serve-config > app.yaml; serve run app.yaml`, `serve
deploy`) and by KubeRay's serveConfigV2 (deploy/serve_config.py writes them): Serve
calls `build_app(args)` with the application's `args`, which are the whole KvmeshConfig
tree as a dict. Secrets arrive as process plumbing and are merged by
`config_from_serve_args` (Redis URL, API key hashes).

gRPC is the app's own: each router replica serves kvmesh.v1 on router.grpc_port
(router/grpc_ingress.py), so the Serve file needs no `grpc_options`.
"""

from __future__ import annotations

from kvmesh.deploy.serve_config import config_from_serve_args


def build_app(args: dict | None = None):
    from kvmesh.router.app import build_router_app  # Ray Serve: only when Serve builds the app

    return build_router_app(config_from_serve_args(args or {}))
