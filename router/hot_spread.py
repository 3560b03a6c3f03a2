"""Bounded spreading of hot prefix families, and the recent work each worker was sent.

A *family* is the requests that share a prompt's first `router.spread_family_blocks` full
blocks (its key: the chain hash of the last of them, kv/hashing.py, so it covers all of
them). A family normally lives where its prefix is cached. When its worker's load runs
ahead of the cluster (router/routing.py, the predicted-latency policy), the family gets one
more worker, chosen deterministically by rendezvous hashing with bounded loads (Mirrokni,
Thorup and Zadimoghaddam, "Consistent hashing with bounded loads", 2018): walk the family's
preference order over the workers,

    order(family) = workers sorted by blake2b(family key + worker id)

and take the first one whose load is within the bound. Every router replica computes the
same order, so replicas spreading the same family pick the same second worker, and a family
of a hot tenant takes the same few workers each time it heats up (their caches may still
hold it). The new member computes (or pulls, via the transfer hint) the prefix once.

When to grow is the routing policy's call (router/routing.py `_grow`: a queue running ahead,
or recent work running ahead because of the family itself, and only when the family's own
recent work pays for the prefix the newcomer computes); this module keeps the result.

Hysteresis: a family grows at once when its members run ahead by the load guard's full
thresholds, but gives back its newest member only after `cooldown_s` during which the
members without it would not have run ahead by half the thresholds (`SpreadAction.needed`).
Shrinking one member per cooldown, so a family returns to one worker stepwise as the heat
passes and does not flap on a single quiet poll.

    members:  {family_key: (home, second, third)}    newest last; absent = not spread
    needed_at {family_key: t}                          when the newest member was last needed

State is kept for at most `max_families` spread families (least recently used dropped): a
family absent from the map routes on its cached prefix alone.
"""

from __future__ import annotations

import collections
import hashlib
import math
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SpreadAction:
    """What a routing decision asks of the family's spread state (applied by `FamilySpread.apply`
    when the request is dispatched; a decision only evaluated, as the affinity wait does,
    changes nothing)."""

    family_key: bytes
    members: tuple[str, ...]  # the family's workers after the decision, newest last
    grown: bool  # True: `members[-1]` was just added
    needed: bool  # the members without the newest would run ahead (keeps the newest)
    cause: str = ""  # on growth: "queue" (its best worker ran ahead in queue) or "work" (in recent work)


def preference_order(family_key: bytes, worker_ids: Iterable[str]) -> list[str]:
    """The family's workers in rendezvous-hash order (highest random weight first)."""
    def weight(worker_id: str) -> bytes:
        return hashlib.blake2b(family_key + worker_id.encode(), digest_size=8).digest()
    return sorted(worker_ids, key=weight, reverse=True)


class FamilySpread:
    """Spread families' workers, with the cooldown that returns them to one (module docstring)."""

    def __init__(self, cooldown_s: float, clock: Callable[[], float] = time.monotonic,
                 max_families: int = 4096) -> None:
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._max_families = max_families
        self._members: collections.OrderedDict[bytes, tuple[str, ...]] = collections.OrderedDict()
        self._needed_at: dict[bytes, float] = {}

    def members(self, family_key: bytes | None) -> tuple[str, ...]:
        """The family's workers, home first; () when it is not spread. Drops members whose
        cooldown has run out first, so a quiet family comes back narrower."""
        if family_key is None or family_key not in self._members:
            return ()
        self._shrink(family_key)
        return self._members.get(family_key, ())

    def apply(self, action: SpreadAction | None) -> None:
        if action is None:
            return
        key, now = action.family_key, self._clock()
        if action.grown:
            self._members[key] = action.members
            self._members.move_to_end(key)
            self._needed_at[key] = now
            while len(self._members) > self._max_families:
                old, _ = self._members.popitem(last=False)
                self._needed_at.pop(old, None)
            return
        if key not in self._members:
            return
        self._members.move_to_end(key)
        if action.needed:
            self._needed_at[key] = now

    def num_spread(self) -> int:
        """Families currently on more than one worker."""
        return sum(len(m) > 1 for m in self._members.values())

    def _shrink(self, family_key: bytes) -> None:
        members, now = self._members[family_key], self._clock()
        idle_s = now - self._needed_at[family_key]
        if len(members) < 2 or idle_s < self.cooldown_s:
            return
        steps = min(len(members) - 1, math.floor(idle_s / self.cooldown_s)) if self.cooldown_s > 0 else len(members) - 1
        self._members[family_key] = members[:len(members) - steps]
        # The next member goes one cooldown later (not at once: the shrink is stepwise).
        self._needed_at[family_key] = now


class WorkMeter:
    """Tokens the router sent each worker (or family) to compute (its tickets' uncached
    costs), decayed with half-life `half_life_s`: the recent work that breaks ties when a new
    prefix is placed, so prefixes go where less work went, not where a coin fell, and that
    tells a hot family from a worker kept busy by others.

    Every value decays at the same rate, so each is kept scaled to a common epoch
    (value x e^(rate x (t - epoch))): reading one, all, or their sum costs one exp, not one
    per worker (the epoch moves forward before the scale could overflow). `max_keys` bounds
    the keys kept (the least recently observed dropped): one per family is unbounded otherwise."""

    def __init__(self, half_life_s: float, clock: Callable[[], float] = time.monotonic,
                 max_keys: int | None = None) -> None:
        self._rate = math.log(2) / half_life_s
        self._clock = clock
        self._scaled: collections.OrderedDict[Hashable, float] = collections.OrderedDict()
        self._first_seen: dict[Hashable, float] = {}  # when each key kept was first observed
        self._epoch = clock()
        self._total_scaled = 0.0
        self._max_keys = max_keys

    def _decay(self) -> float:
        """e^(-rate x (now - epoch)); moves the epoch to now once that is below e^-40."""
        now = self._clock()
        factor = math.exp(-self._rate * (now - self._epoch))
        if factor < 1e-17:
            self._scaled = collections.OrderedDict((k, v * factor) for k, v in self._scaled.items())
            self._total_scaled *= factor
            self._epoch, factor = now, 1.0
        return factor

    def observe(self, key: Hashable, tokens: int) -> None:
        scaled = tokens / self._decay()
        if key not in self._scaled:
            self._first_seen[key] = self._clock()
        self._scaled[key] = self._scaled.get(key, 0.0) + scaled
        self._total_scaled += scaled
        if self._max_keys is not None:
            self._scaled.move_to_end(key)
            while len(self._scaled) > self._max_keys:
                old, value = self._scaled.popitem(last=False)
                self._total_scaled -= value
                self._first_seen.pop(old, None)

    def value(self, key: Hashable) -> float:
        return self._scaled.get(key, 0.0) * self._decay()

    def values(self, keys: Sequence[Hashable]) -> dict:
        factor = self._decay()
        return {w: self._scaled.get(w, 0.0) * factor for w in keys}

    def total(self) -> float:
        """Sum over every worker observed (forgotten ones excluded)."""
        return self._total_scaled * self._decay()

    def age_s(self, key: Hashable) -> float | None:
        """Seconds since the key was first observed (None: not kept)."""
        first = self._first_seen.get(key)
        return None if first is None else self._clock() - first

    def steady_value(self, value: float, age_s: float) -> float:
        """What a meter reading `value` for a key observed for `age_s` seconds would read had
        the key run at the same rate for ever: a decayed sum started `age_s` ago holds only
        (1 - e^(-rate x age)) of its steady value (the bias correction of a young mean)."""
        return value / -math.expm1(-self._rate * age_s) if age_s > 0 else math.inf

    def forget(self, key: Hashable) -> None:
        self._total_scaled -= self._scaled.pop(key, 0.0)
        self._first_seen.pop(key, None)
