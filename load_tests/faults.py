"""The chaos campaign's faults: what a run's `faults:` section schedules, and how each one is
done to a running local cluster (real Ray actors, the Serve app, a redis-server of its own).

    faults:
      kinds: [kill_worker, redis_stop, kill_router_replica, redis_restart, drain_worker, redeploy_router]
      every_s: 30          # one fault every 30 s of the load, the kinds taken in turn
      start_s: 30          # the first one (default: every_s)
      count: null          # null = as many as fall inside the load; N = N faults, then the load
                           #   ends once the last has recovered (requests not yet sent are not)
      drain_hold_s: 10     # a drained worker is undrained after this
      recovery_timeout_s: 120

After each fault the injector measures the time to recover: from the fault until every worker
is routable again, Serve runs every router replica, the Redis it owns answers (unless a
redis_stop left it down on purpose) and a probe request streams its tokens. Faults run one
after another: one that is still recovering when the next is due delays it (reported as late).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from kvmesh.core.config import KvmeshConfig
from kvmesh.core.errors import InvalidRequestError

logger = logging.getLogger(__name__)

FAULT_KINDS = {
    "kill_worker": "ray.kill of the busiest worker actor; Ray restarts it, the router resumes its streams",
    "kill_router_replica": "ray.kill of one router replica actor; Serve starts another, clients resume",
    "redis_stop": "SIGKILL of the campaign's redis-server; it stays down until a redis_restart",
    "redis_restart": "the redis-server started again on its port (append-only file reloaded)",
    "drain_worker": "the busiest worker drained with no grace (its streams move), undrained after drain_hold_s",
    "redeploy_router": "serve deploy of the router config with router.max_queue_len + 1",
}
REDIS_KINDS = frozenset({"redis_stop", "redis_restart"})
_POLL_S = 0.25
_PROBE_MAX_TOKENS = 2


@dataclass(frozen=True)
class FaultPlan:
    kinds: tuple[str, ...] = tuple(FAULT_KINDS)
    every_s: float = 30.0
    start_s: float | None = None  # the first fault; None = every_s
    count: int | None = None  # None = every slot inside the load; N = N, then the load ends
    drain_hold_s: float = 10.0
    drain_grace_s: float = 0.0  # what the drained worker still runs after this moves
    recovery_timeout_s: float = 120.0
    settle_timeout_s: float = 120.0  # at the end: how long the workers may take to go idle

    def __post_init__(self):
        object.__setattr__(self, "kinds", tuple(self.kinds))

    def validate(self) -> None:
        unknown = sorted(set(self.kinds) - set(FAULT_KINDS))
        if not self.kinds or unknown:
            raise InvalidRequestError(f"faults.kinds: unknown or none {unknown}; known: {sorted(FAULT_KINDS)}")
        if not self.every_s > 0 or (self.start_s is not None and self.start_s < 0):
            raise InvalidRequestError("faults: every_s must be > 0 and start_s >= 0")
        if self.count is not None and self.count < 1:
            raise InvalidRequestError("faults.count must be >= 1 (or null: as many as fit the load)")
        if min(self.drain_hold_s, self.drain_grace_s) < 0 or not min(self.recovery_timeout_s,
                                                                     self.settle_timeout_s) > 0:
            raise InvalidRequestError("faults: drain_hold_s, drain_grace_s >= 0; recovery/settle timeouts > 0")

    @property
    def needs_redis(self) -> bool:
        return bool(REDIS_KINDS & set(self.kinds))

    def schedule(self) -> Iterator["ScheduledFault"]:
        """The faults in order: the kinds in turn, one every `every_s` from `start_s`; endless
        when `count` is None (the load's end stops it)."""
        first = self.every_s if self.start_s is None else self.start_s
        slots = range(self.count) if self.count is not None else itertools.count()
        for index in slots:
            yield ScheduledFault(index, self.kinds[index % len(self.kinds)], first + index * self.every_s)

    def planned(self, duration_s: float) -> list["ScheduledFault"]:
        """The faults that fall before `duration_s` (what a run of that length will see)."""
        return list(itertools.takewhile(lambda f: f.at_s < duration_s, self.schedule()))


@dataclass(frozen=True)
class ScheduledFault:
    index: int
    kind: str
    at_s: float  # planned, seconds from the load's start


@dataclass(frozen=True)
class FaultOutcome:
    """One fault as it happened (times from the load's start)."""

    index: int
    kind: str
    planned_at_s: float
    at_s: float  # when it was done
    target: str  # the worker, replica or service it hit
    recovery_s: float | None  # fault -> whole again; None = not within recovery_timeout_s
    error: str | None = None  # the fault itself could not be done (then nothing was broken)

    def to_json(self) -> dict:
        return {"index": self.index, "kind": self.kind, "planned_at_s": self.planned_at_s, "at_s": self.at_s,
                "target": self.target, "recovery_s": self.recovery_s, "error": self.error}


class ChaosCluster:
    """A running local cluster (the Serve app `app_name` of `config`, its worker actors and
    router replicas, and optionally the redis-server it uses), and the faults done to it.
    Every method blocks (Ray calls): the campaign runs them in a thread."""

    def __init__(self, config: KvmeshConfig, app_name: str, redis=None):
        self.config = config
        self.app_name = app_name
        self.redis = redis  # a load_tests.redis_server.RedisServer, or None
        self.redis_down = False
        self._deployed = config

    # ---- what the cluster looks like --------------------------------------------------

    def workers(self) -> dict:
        from kvmesh.router.launch import worker_actors  # Ray: only where a cluster runs

        return worker_actors(self.app_name)

    def worker_stats(self) -> dict:
        """{actor name: WorkerStats} of the live workers (a restarting one is left out)."""
        import ray

        out = {}
        for name, handle in self.workers().items():
            try:
                out[name] = ray.get(handle.stats.remote(), timeout=10)
            except Exception as exc:  # dead or restarting: not counted
                logger.debug("stats of %s: %r", name, exc)
        return out

    def replica_actors(self) -> list[dict]:
        import ray

        return sorted((a for a in ray.util.list_named_actors(all_namespaces=True)
                       if a["name"].startswith("SERVE_REPLICA::") and self.app_name in a["name"]),
                      key=lambda a: a["name"])

    def replica_states(self) -> dict[str, int]:
        from ray import serve  # Ray Serve: only where a cluster runs

        app = serve.status().applications.get(self.app_name)
        states: dict[str, int] = {}
        for deployment in (app.deployments.values() if app else ()):
            for state, count in deployment.replica_states.items():
                if count:
                    states[str(state)] = states.get(str(state), 0) + count
        return states

    def whole(self) -> bool:
        """Every worker routable, every router replica running (Serve's word and a live actor
        each), the Redis up unless stopped on purpose, and a probe request served."""
        replicas = self._deployed.router.num_replicas
        if self.replica_states() != {"RUNNING": replicas} or len(self.replica_actors()) != replicas:
            return False
        if self.redis is not None and not self.redis_down and not self.redis.running:
            return False
        return self._routable_workers() == self.config.parallel.num_workers and self._probe()

    def _client(self):
        import grpc

        from kvmesh.router.client import KvmeshClient  # grpc: only while faults are measured
        from kvmesh.router.retry import RetryPolicy  # as above

        target = f"127.0.0.1:{self.config.router.grpc_port}"
        # a connection of its own: a shared one may still point at a replica that is gone
        channel = grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        return KvmeshClient(target, channel=channel, retry_policy=RetryPolicy(max_attempts=1))

    def _routable_workers(self) -> int:
        try:
            with self._client() as client:
                return sum(1 for w in client.get_stats(timeout_s=5).workers if w.healthy)
        except Exception as exc:
            logger.debug("GetStats during recovery: %r", exc)
            return -1

    def _probe(self) -> bool:
        from kvmesh.core.seams import SamplingParams  # as above

        sampling = SamplingParams(max_tokens=_PROBE_MAX_TOKENS, temperature=0.0, ignore_eos=True)
        try:
            with self._client() as client:
                tokens = sum(len(d.token_ids) for d in client.generate(prompt_token_ids=[1, 2, 3], sampling=sampling,
                                                                        timeout_s=10))
            return tokens == _PROBE_MAX_TOKENS
        except Exception as exc:
            logger.debug("probe during recovery: %r", exc)
            return False

    def wait_whole(self, timeout_s: float) -> float | None:
        """Seconds until `whole()`; None when it is not within `timeout_s`."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.whole():
                return time.monotonic() - started
            time.sleep(_POLL_S)
        return None

    def wait_idle(self, timeout_s: float) -> dict:
        """Wait until every live worker runs and queues nothing -> {actor name: WorkerStats}."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.worker_stats()
            idle = all(s.num_running == 0 and s.num_waiting == 0 for s in stats.values())
            if (idle and len(stats) == self.config.parallel.num_workers) or time.monotonic() > deadline:
                return stats
            time.sleep(_POLL_S)

    # ---- the faults -------------------------------------------------------------------

    def inject(self, fault: ScheduledFault, plan: FaultPlan) -> str:
        """Do `fault` -> what it hit. drain_worker includes its hold and the undrain."""
        import ray

        if fault.kind in ("kill_worker", "drain_worker"):
            name, handle = self._busiest_worker(fault.index)
            if fault.kind == "kill_worker":
                ray.kill(handle, no_restart=False)
            else:
                ray.get(handle.drain.remote(plan.drain_grace_s))
                time.sleep(plan.drain_hold_s)
                ray.get(handle.undrain.remote())
            return name
        if fault.kind == "kill_router_replica":
            replicas = self.replica_actors()
            victim = replicas[fault.index % len(replicas)]
            ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
            return victim["name"]
        if fault.kind in REDIS_KINDS:
            if self.redis is None:
                raise InvalidRequestError(f"{fault.kind}: the target owns no redis-server (target.redis: true)")
            if fault.kind == "redis_stop":
                self.redis.kill()
            else:
                self.redis.restart()
            self.redis_down = fault.kind == "redis_stop"
            return self.redis.url
        changed = self._deployed.replace(router={"max_queue_len": self._deployed.router.max_queue_len + 1})
        from kvmesh.router.launch import redeploy_router  # Ray Serve: only where a cluster runs

        redeploy_router(changed, self.app_name)
        self._deployed = changed
        return f"router.max_queue_len={changed.router.max_queue_len}"

    def _busiest_worker(self, turn: int) -> tuple[str, object]:
        """The worker running the most requests (ties: the kinds' turn picks), so the fault
        hits streams."""
        workers = self.workers()
        if not workers:
            raise InvalidRequestError(f"no worker actor of app {self.app_name!r} is alive")
        stats = self.worker_stats()
        names = sorted(workers, key=lambda n: (-(stats[n].num_running if n in stats else -1),
                                               (sorted(workers).index(n) - turn) % len(workers)))
        return names[0], workers[names[0]]
