"""The degradation ladder: what the router does with a request the main pool has no room for.

The articles' answers to a short KV budget, applied in order as pressure rises, per priority
class (config `degradation.rules`, core/config.py):

    main pool has room ─────────────────────────────────> admitted as sent
    no room: queue up to rule.queue_wait_s ─ room ──────> admitted as sent
      still none: cap      max_tokens -> cap_max_tokens,  admitted now   degraded "cap"
                           if the capped request fits on a main worker now
                  fallback the request as sent, on a fallback-pool        degraded "fallback"
                           worker with room now
                  reject   OverloadedError with the retry-after the queue measured

Each step keeps the request's place in the admission queue, and "now" is decided on what the
workers have reported, not on the router's extra in-flight margin (router/admission.py:
requests of one class that step down together are all capped while the cap has room).

Pressure is what admission measures (router/admission.py): a request that does not fit in any
main worker's KV headroom queues, and the time it has queued is the second measure. A class
no rule covers keeps the old answer (queue up to router.max_queue_wait_s, then reject).

A degraded request tells its client: gRPC trailing metadata `x-kvmesh-degraded` and the final
GenerateResponse's `degraded` field; HTTP the `x-kvmesh-degraded` header and
`usage.kvmesh_degraded`. A capped request ends with finish reason `length` when it reaches the
cap. Each step is counted in `kvmesh_degraded_total{step}` (router/metrics.py).

The fallback pool is a second worker group (`degradation.fallback_pool`): its own actors,
named apart from the main workers', with its config derived here (other weights or model,
another max_num_seqs). Undegraded traffic never goes there.
"""

from __future__ import annotations

import dataclasses

from kvmesh.core.config import DegradationRule, KvmeshConfig

STEP_CAP = "cap"
STEP_FALLBACK = "fallback"
STEP_REJECT = "reject"
STEPS = (STEP_CAP, STEP_FALLBACK, STEP_REJECT)

DEGRADED_KEY = "x-kvmesh-degraded"  # gRPC trailing metadata and HTTP response header
FALLBACK_APP_SUFFIX = "-fallback"  # fallback actors are named after "<app><suffix>"
FALLBACK_WORKER_PREFIX = "fallback"  # their worker ids: fallback-0, fallback-1, ...


def rule_for(config: KvmeshConfig, priority_class: int) -> DegradationRule | None:
    """The rule with the highest min_priority_class not above `priority_class`; None = none."""
    covering = [r for r in config.degradation.rules if r.min_priority_class <= priority_class]
    return max(covering, key=lambda r: r.min_priority_class, default=None)


def fallback_pool_config(config: KvmeshConfig) -> KvmeshConfig | None:
    """The config the fallback workers run with; None when no fallback pool is declared."""
    pool = config.degradation.fallback_pool
    if pool.num_workers == 0:
        return None
    model = dataclasses.replace(config.model, path=pool.model_path or config.model.path)
    quant = dataclasses.replace(config.quant, weight=pool.quant_weight or config.quant.weight)
    scheduler = dataclasses.replace(config.scheduler, max_num_seqs=pool.max_num_seqs or config.scheduler.max_num_seqs)
    parallel = dataclasses.replace(config.parallel, num_workers=pool.num_workers)
    return dataclasses.replace(config, model=model, quant=quant, scheduler=scheduler, parallel=parallel).validate()


def fallback_app_name(app_name: str) -> str:
    return app_name + FALLBACK_APP_SUFFIX
