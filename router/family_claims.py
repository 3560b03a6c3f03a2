"""Which worker a new prompt family goes to, agreed by every router replica: a set-if-absent
claim "family key -> worker id" in the Redis the replicas already share for quotas.

Why: with several router replicas each one routes from its own view. A family's first
requests, sent at once through two replicas, found nothing cached anywhere, and each replica
placed them by what it saw (its own tickets, its own in-flight tokens, its own budget view):
two workers, one family computed and cached twice (the two-replica routing campaign split a
family at 16 in flight on every placement rule tried; docs/routing.md). A shared claim makes
the first replica's choice everyone's:

    replica A, family f new to it:  claim(f, [worker-1, worker-0])  -> "worker-1"  (f -> worker-1, PX ttl)
    replica B, a moment later:      claim(f, [worker-0, worker-1])  -> "worker-1"  (f exists: its owner)
    both route f's request to worker-1 (the affinity wait holds it there while it has no room)

The proposing replica lists the workers in its own order (its one-replica rule's pick first,
then the family's rendezvous order) with each one's room in families (its KV blocks over the
prompt's); the script claims the first whose live families leave room for one more. Live
families are the claims not expired, kept per worker in Redis (a sorted set scored by expiry):
what every replica placed, where one replica's own view knows only its own (simulated, two
replicas each sent a fourth family to the worker whose three it had not all seen, and each
of that worker's requests then evicted another family's prefix).

One script call per request whose prompt matched nothing in the replica's prefix index (the
common request, a hit, never asks). The claim expires after `router.family_claim_ttl_s` and is
renewed (with its live entry) while the family's requests keep coming, at most every third of
that per family and replica; once the workers report the family's blocks every replica routes
it by its prefix index and the claim only matters again if the family is evicted everywhere.

Redis down: the claim answers None at once (no request waits on a dead Redis beyond one
socket timeout) and the replica routes a new family by its own rule, as without Redis; a
WARNING, `kvmesh_family_claims_fallback_active{replica}` 1, and a probe every
`tenants.quota_probe_interval_s` until Redis answers again (router/redis_outage.py, as the
quota store's). Outcomes are counted in
`kvmesh_family_claims_total{outcome}` (won: this replica's choice stands; joined: another
replica's claim was taken; unavailable: Redis down, own rule).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from collections.abc import Callable, Sequence

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.seams import WorkerStats
from kvmesh.router.hot_spread import preference_order
from kvmesh.router.redis_outage import RedisOutage
from kvmesh.router.routing import RouteRequest

_KEY_PREFIX = "kvmesh:family-claim:"


def claim_proposal(recent_home: str | None, candidates: Sequence[WorkerStats], rule_pick: Callable[[], str]) -> str:
    """The worker a replica proposes for a family nothing matched: where it sent the family's
    requests lately (`LiveFamilies.latest_worker`) while that worker is a candidate, else its
    one-replica rule's pick. A family whose prefix was evicted (or not yet reported) and whose
    claim expired while its requests waited was placed anew, on the other worker by the rule,
    while the other replica's requests still went home by their prefix: a split (one in a
    two-replica campaign run at 16 in flight, its claim won twice)."""
    if recent_home is not None and recent_home in {w.worker_id for w in candidates}:
        return recent_home
    return rule_pick()
_MAX_REFRESHED = 4096  # families whose last refresh this replica remembers (least recent dropped)

# KEYS[1] the family's claim key, KEYS[2] the prefix of the per-worker sets of live families
# (score: when the family's claim expires, ms of Redis TIME). ARGV: the expiry (ms), the family
# (hex), n, then n candidate workers in the proposing replica's order, then each one's room in
# families. An existing claim is returned, renewed, with 0; else the first candidate whose live
# families leave room for one more (the first candidate when none does) is claimed, with 1.
# (Keys built in the script: one Redis, not a Redis Cluster, as the quota scripts assume.)
_CLAIM_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
local owner = redis.call('GET', KEYS[1])
if owner then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('ZADD', KEYS[2] .. owner, now + ttl, ARGV[2])
  return {owner, 0}
end
local n = tonumber(ARGV[3])
local chosen = ARGV[4]
for i = 1, n do
  local live = KEYS[2] .. ARGV[3 + i]
  redis.call('ZREMRANGEBYSCORE', live, '-inf', now)
  if redis.call('ZCARD', live) < tonumber(ARGV[3 + n + i]) then
    chosen = ARGV[3 + i]
    break
  end
end
redis.call('SET', KEYS[1], chosen, 'PX', ttl)
redis.call('ZADD', KEYS[2] .. chosen, now + ttl, ARGV[2])
redis.call('PEXPIRE', KEYS[2] .. chosen, 2 * ttl)
return {chosen, 1}
"""

# KEYS as above; ARGV: the expiry (ms), the family (hex). Renews a live claim and its entry.
_RENEW_LUA = """
local owner = redis.call('GET', KEYS[1])
if not owner then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
redis.call('PEXPIRE', KEYS[1], ttl)
redis.call('ZADD', KEYS[2] .. owner, now + ttl, ARGV[2])
redis.call('PEXPIRE', KEYS[2] .. owner, 2 * ttl)
return 1
"""


class ClaimOutcome(str, enum.Enum):
    WON = "won"  # no replica had claimed the family: this replica's placement stands
    JOINED = "joined"  # another replica had: its worker is taken
    UNAVAILABLE = "unavailable"  # Redis did not answer: this replica's own rule


class FamilyClaims:
    """The claims of one router replica (its event loop). `claim` never raises."""

    def __init__(self, redis_url: str, ttl_s: float, namespace: str = "", socket_timeout_s: float = 0.25,
                 probe_interval_s: float = 1.0, on_fallback_change: Callable[[bool], None] | None = None,
                 on_outcome: Callable[[ClaimOutcome], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # No client-side retries: a request must not wait through a retry ladder for a claim.
        self._redis = aioredis.Redis.from_url(
            redis_url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0), decode_responses=True)
        self._claim = self._redis.register_script(_CLAIM_LUA)
        self._renew_script = self._redis.register_script(_RENEW_LUA)
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._refresh_every_s = ttl_s / 3
        self._prefix = f"{_KEY_PREFIX}{namespace}:" if namespace else _KEY_PREFIX
        self._live_prefix = self._prefix + "live:"  # + worker id: that worker's live families
        self._outage = RedisOutage(
            self._redis.ping, probe_interval_s, on_change=on_fallback_change,
            away="family claims: Redis unreachable ({exc!r}); new families placed by this replica's own rule "
                 "until it answers again",
            back="family claims: Redis is back; new families placed by shared claims again")
        self._on_outcome = on_outcome
        self._clock = clock
        self._refreshed: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._background: set[asyncio.Task] = set()

    @property
    def fallback_active(self) -> bool:
        return self._outage.active

    async def claim(self, family_key: bytes, candidates: Sequence[tuple[str, int]]) -> str | None:
        """The worker the family is claimed for: an existing claim's (renewed), else the first
        of `candidates` ((worker, room in families), this replica's order) whose live families
        (claims not expired) leave room for one more, now claimed (the first when none does).
        None while Redis is unreachable."""
        if self._outage.active or not candidates:
            self._count(ClaimOutcome.UNAVAILABLE)
            return None
        try:
            owner, new = await self._claim(keys=[self._key(family_key), self._live_prefix], args=[
                self._ttl_ms, family_key.hex(), len(candidates), *(w for w, _ in candidates),
                *(room for _, room in candidates)])
        except Exception as exc:  # ConnectionError, TimeoutError, OSError: Redis is away
            self._outage.enter(exc)
            self._count(ClaimOutcome.UNAVAILABLE)
            return None
        self._refreshed[family_key] = self._clock()
        self._trim()
        self._count(ClaimOutcome.WON if int(new) else ClaimOutcome.JOINED)
        return owner

    def keep_alive(self, family_key: bytes) -> None:
        """A request of the family was routed: renew its claim (if any), at most every third
        of the expiry per family, without waiting for Redis."""
        now = self._clock()
        last = self._refreshed.get(family_key)
        if self._outage.active or (last is not None and now - last < self._refresh_every_s):
            return
        self._refreshed[family_key] = now
        self._refreshed.move_to_end(family_key)
        self._trim()
        task = asyncio.get_running_loop().create_task(self._renew(family_key))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def aclose(self) -> None:
        self._outage.close()
        await self._redis.aclose()

    # ---- internals ----------------------------------------------------------------------

    def _key(self, family_key: bytes) -> str:
        return self._prefix + family_key.hex()

    def _trim(self) -> None:
        while len(self._refreshed) > _MAX_REFRESHED:
            self._refreshed.popitem(last=False)

    def _count(self, outcome: ClaimOutcome) -> None:
        if self._on_outcome is not None:
            self._on_outcome(outcome)

    async def _renew(self, family_key: bytes) -> None:
        try:
            await self._renew_script(keys=[self._key(family_key), self._live_prefix],
                                     args=[self._ttl_ms, family_key.hex()])
        except Exception as exc:
            self._outage.enter(exc)


def claim_candidates(proposed: str, workers: Sequence[WorkerStats], request: RouteRequest) -> list[tuple[str, int]]:
    """What a replica offers a claim: its own pick first, then the family's rendezvous order;
    each with its room in families (its KV blocks over the prompt's, at least one)."""
    by_id = {w.worker_id: w for w in workers}
    prompt_blocks = max(1, request.num_prompt_tokens // request.block_size)
    order = [proposed] + [w for w in preference_order(request.family_key, list(by_id)) if w != proposed]
    return [(w, max(1, by_id[w].num_blocks_total // prompt_blocks)) for w in order]


def make_family_claims(config: KvmeshConfig, namespace: str, metrics=None) -> FamilyClaims | None:
    """The replica's claims when they apply: several router replicas, a Redis
    (`tenants.redis_url`) and `router.family_claim_ttl_s` > 0; else None (each replica's own
    rule). `namespace` (the Serve app's name) keeps two apps on one Redis apart; `metrics`:
    RouterMetrics, told of outcomes and fallback."""
    router = config.router
    if router.num_replicas < 2 or not config.tenants.redis_url or router.family_claim_ttl_s <= 0:
        return None
    return FamilyClaims(config.tenants.redis_url, router.family_claim_ttl_s, namespace,
                        probe_interval_s=config.tenants.quota_probe_interval_s,
                        on_fallback_change=metrics.set_family_claims_fallback if metrics is not None else None,
                        on_outcome=metrics.observe_family_claim if metrics is not None else None)
