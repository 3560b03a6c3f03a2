"""The LoRA adapters a router serves: registered by name, optionally bound to one tenant.

    lora.adapters (config tree)   overlaid by   lora.adapters_file (`kvmesh adapters add|remove`)

A request names an adapter as OpenAI clients name a model, or by the gRPC `adapter` field:

    model "smollm2:acme-support"   base model, then the adapter (the form ListModels reports)
    model "acme-support"           the adapter alone, when one is registered by that name (vLLM's
                                   form; any other unknown model stays INVALID_ARGUMENT / 400)
    model "" / "smollm2"           the base model
    adapter "acme-support"         gRPC GenerateRequest.adapter (the model, if given, must agree)

An unknown name is AdapterNotFoundError (NOT_FOUND / 404); an adapter bound to another tenant
is PermissionDeniedError (PERMISSION_DENIED / 403), and ListModels never shows it to them, so
a tenant can neither run another's adapter nor reach the KV its requests cached (the adapter
is part of the block hash extra keys: kv/hashing.py).

The file is re-read when its modification time changes, at most every `refresh_s`, so an
adapter added with the CLI is served within that time without a restart.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import yaml

from kvmesh.core.config import AdapterConfig, LoraConfig, _build
from kvmesh.core.errors import AdapterNotFoundError, InvalidRequestError, PermissionDeniedError
from kvmesh.core.seams import AdapterRef

logger = logging.getLogger(__name__)

SEPARATOR = ":"  # "<base>:<adapter>"


def read_adapters_file(path: str | Path) -> list[AdapterConfig]:
    """`{adapters: [{name, path, tenant}, ...]}`, the shape of the config's lora.adapters."""
    path = Path(path)
    if not path.exists():
        return []
    data = yaml.safe_load(path.read_text()) or {}
    adapters = [_build(AdapterConfig, a, f"{path}: adapters[{i}]") for i, a in enumerate(data.get("adapters", []))]
    for a in adapters:
        a.validate()
    return adapters


def write_adapters_file(path: str | Path, adapters: list[AdapterConfig]) -> None:
    """Atomically (temp file + rename), so a router never reads half a file."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    records = [{k: v for k, v in (("name", a.name), ("path", a.path), ("tenant", a.tenant)) if v is not None}
               for a in adapters]
    tmp.write_text(yaml.safe_dump({"adapters": records}, sort_keys=False))
    os.replace(tmp, path)


class AdapterRegistry:
    def __init__(self, config: LoraConfig, refresh_s: float = 5.0, clock=time.monotonic):
        self._static = {a.name: a for a in config.adapters}
        self._file = config.adapters_file
        self._refresh_s = refresh_s
        self._clock = clock
        self._checked_at = float("-inf")
        self._mtime: float | None = None
        self._adapters = dict(self._static)
        self.reload()

    def reload(self, force: bool = False) -> None:
        """Re-read the adapters file if it changed (at most every refresh_s unless forced)."""
        now = self._clock()
        if self._file is None or (not force and now - self._checked_at < self._refresh_s):
            return
        self._checked_at = now
        try:
            mtime = os.stat(self._file).st_mtime
        except FileNotFoundError:
            mtime = None
        if mtime == self._mtime and not force:
            return
        try:
            stored = read_adapters_file(self._file)
        except Exception:  # a half-edited file must not take serving down: keep the last good set
            logger.exception("cannot read lora.adapters_file %s; keeping the adapters loaded before", self._file)
            return
        self._mtime = mtime
        self._adapters = {**self._static, **{a.name: a for a in stored}}

    def visible_to(self, tenant_id: str) -> list[AdapterConfig]:
        self.reload()
        return sorted((a for a in self._adapters.values() if a.tenant in (None, tenant_id)), key=lambda a: a.name)

    def resolve(self, model: str, adapter: str, base_model: str, tenant_id: str) -> AdapterRef | None:
        """The adapter a request asks for (None = the base model); raises as the module says."""
        self.reload()
        name = self._requested_name(model, adapter, base_model)
        if name is None:
            return None
        found = self._adapters.get(name)
        if found is None and name == model:  # a bare model name that is no adapter either
            raise InvalidRequestError(f"model {model!r} is not served here; this server serves {base_model!r} "
                                      f"and its adapters as '{base_model}:<adapter>'")
        if found is None:
            raise AdapterNotFoundError(f"no LoRA adapter named {name!r} is registered here "
                                       f"(ListModels / GET /v1/models lists the ones you may use)")
        if found.tenant is not None and found.tenant != tenant_id:
            raise PermissionDeniedError(f"the LoRA adapter {name!r} belongs to another tenant")
        return AdapterRef(found.name, found.path)

    @staticmethod
    def _requested_name(model: str, adapter: str, base_model: str) -> str | None:
        from_model = None
        if model and model != base_model:
            base, sep, rest = model.partition(SEPARATOR)
            if sep:
                if base != base_model:
                    raise InvalidRequestError(f"model {model!r} is not served here; this server serves "
                                              f"{base_model!r} and its adapters as '{base_model}:<adapter>'")
                from_model = rest
            else:
                from_model = model  # a bare adapter name, as vLLM accepts
        if adapter and from_model and adapter != from_model:
            raise InvalidRequestError(f"adapter {adapter!r} and model {model!r} name different adapters")
        name = adapter or from_model
        if name is not None and not name:
            raise InvalidRequestError(f"model {model!r} names no adapter after {SEPARATOR!r}")
        return name or None
