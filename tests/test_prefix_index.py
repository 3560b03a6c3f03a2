"""router/prefix_index.py: learns from STORED/EVICTED/CLEARED events and resets."""

from __future__ import annotations

import random

from kvmesh.kv.hashing import hash_full_blocks
from kvmesh.router.prefix_index import PrefixIndex
from kvmesh.core.seams import PrefixEvent, PrefixEventBatch, PrefixEventKind

BLOCK = 4
EXTRA = ("model=test", "rev=main", "kv=auto")


def hashes(tokens):
    return hash_full_blocks(tokens, BLOCK, EXTRA)


def stored(worker, seq, block_hashes, next_seq=None):
    return PrefixEventBatch(worker_id=worker, next_seq=seq + 1 if next_seq is None else next_seq,
                            events=(PrefixEvent(seq, PrefixEventKind.STORED, tuple(block_hashes)),))


def test_worked_example_from_the_docstring():
    system = list(range(100, 108))  # two shared blocks
    a = hashes(system + [1, 2, 3, 4, 5, 6, 7, 8])  # h0 h1 h2 h3
    b = hashes(system + [9, 9, 9, 9])  # h0 h1 h5
    index = PrefixIndex()
    index.apply(stored("w1", 0, a[:3]))
    index.apply(stored("w2", 0, b))
    assert index.longest_prefix(a) == {"w1": 3, "w2": 2}
    assert index.longest_prefix(b) == {"w1": 2, "w2": 3}
    assert index.longest_prefix(hashes([7] * 8)) == {}
    assert index.longest_prefix([]) == {}
    index.check_integrity()


def test_a_match_stops_at_the_first_missing_block_even_if_later_ones_are_held():
    h = hashes(list(range(16)))  # 4 blocks
    index = PrefixIndex()
    index.apply(stored("w1", 0, [h[0], h[2], h[3]]))  # block 1 evicted earlier
    assert index.longest_prefix(h) == {"w1": 1}


def test_eviction_and_clear_events_are_learned():
    h = hashes(list(range(16)))
    index = PrefixIndex()
    index.apply(PrefixEventBatch("w1", next_seq=3, events=(
        PrefixEvent(0, PrefixEventKind.STORED, tuple(h)),
        PrefixEvent(1, PrefixEventKind.EVICTED, (h[2],)),
    )))
    assert index.longest_prefix(h) == {"w1": 2}
    index.apply(stored("w2", 0, h))
    index.apply(PrefixEventBatch("w1", next_seq=4, events=(PrefixEvent(3, PrefixEventKind.CLEARED),)))
    assert index.longest_prefix(h) == {"w2": 4}
    assert index.num_blocks("w1") == 0
    assert index.next_seq("w1") == 4
    index.check_integrity()


def test_reset_replaces_everything_known_about_the_worker():
    h = hashes(list(range(16)))
    other = hashes([5] * 8)
    index = PrefixIndex()
    index.apply(stored("w1", 0, h))
    index.apply(PrefixEventBatch("w1", next_seq=50, reset=True, all_hashes=tuple(other)))
    assert index.longest_prefix(h) == {}
    assert index.longest_prefix(other) == {"w1": 2}
    assert index.next_seq("w1") == 50
    index.check_integrity()


def test_a_batch_delivered_twice_is_not_replayed():
    h = hashes(list(range(8)))
    index = PrefixIndex()
    first = stored("w1", 0, h)
    index.apply(first)
    index.apply(PrefixEventBatch("w1", next_seq=2, events=(PrefixEvent(1, PrefixEventKind.EVICTED, tuple(h)),)))
    index.apply(first)  # a late duplicate must not resurrect evicted blocks
    assert index.longest_prefix(h) == {}


def test_removed_worker_is_never_matched_again():
    h = hashes(list(range(8)))
    index = PrefixIndex()
    index.apply(stored("w1", 0, h))
    index.apply(stored("w2", 0, h[:1]))
    index.remove_worker("w1")
    assert index.longest_prefix(h) == {"w2": 1}
    assert index.workers() == ["w2"]
    assert index.next_seq("w1") == 0
    index.check_integrity()


def test_random_event_streams_agree_with_a_brute_force_model():
    rng = random.Random(7)
    families = [hashes([f] * 4 + list(range(f, f + 12))) for f in range(6)]  # 4 blocks each
    index = PrefixIndex()
    truth: dict[str, set] = {f"w{i}": set() for i in range(3)}
    seq = {w: 0 for w in truth}
    for _ in range(300):
        worker = rng.choice(sorted(truth))
        blocks = rng.choice(families)[: rng.randint(1, 4)]
        kind = rng.choice([PrefixEventKind.STORED] * 3 + [PrefixEventKind.EVICTED] * 2 + [PrefixEventKind.CLEARED])
        if kind is PrefixEventKind.STORED:
            truth[worker] |= set(blocks)
        elif kind is PrefixEventKind.EVICTED:
            truth[worker] -= set(blocks)
        else:
            truth[worker].clear()
        payload = () if kind is PrefixEventKind.CLEARED else tuple(blocks)
        index.apply(PrefixEventBatch(worker, seq[worker] + 1, (PrefixEvent(seq[worker], kind, payload),)))
        seq[worker] += 1
        index.check_integrity()
        query = rng.choice(families)
        expected = {}
        for w, held in truth.items():
            n = 0
            while n < len(query) and query[n] in held:
                n += 1
            if n:
                expected[w] = n
        assert index.longest_prefix(query) == expected


def test_a_dispatched_prefix_counts_on_its_worker_until_events_or_time_correct_it():
    clock = [0.0]
    index = PrefixIndex(linger_s=2.0, clock=lambda: clock[0])
    family = hashes(list(range(100, 116)))  # 4 blocks
    token = index.add_in_flight("w1", family)
    # The next request of the family follows the first before any STORED event...
    assert index.longest_prefix(family) == {"w1": 4}
    # ...but what is surely resident (what admission may charge less for) is still nothing.
    assert index.longest_prefix(family, include_in_flight=False) == {}
    index.apply(stored("w1", 0, family[:2]))
    assert index.longest_prefix(family, include_in_flight=False) == {"w1": 2}
    index.end_in_flight(token)
    clock[0] = 1.9
    assert index.longest_prefix(family) == {"w1": 4}  # lingering: its events may still be on the way
    clock[0] = 2.1
    assert index.longest_prefix(family) == {"w1": 2}  # only what the events say is left
    # An EVICTED event beats a claim at once.
    token = index.add_in_flight("w2", family)
    evicted = PrefixEventBatch("w2", 2, (PrefixEvent(0, PrefixEventKind.STORED, tuple(family)),
                                         PrefixEvent(1, PrefixEventKind.EVICTED, tuple(family[1:]))))
    index.apply(evicted)
    assert index.longest_prefix(family)["w2"] == 1
    index.end_in_flight(token)
    clock[0] = 10.0
    assert index.longest_prefix(family) == {"w1": 2, "w2": 1}
    index.remove_worker("w1")
    assert index.longest_prefix(family) == {"w2": 1}
    index.check_integrity()


def test_blocks_known_per_worker_count_reported_and_claimed_blocks_once():
    clock = [0.0]
    index = PrefixIndex(linger_s=1.0, clock=lambda: clock[0])
    family = hashes(list(range(100, 116)))  # 4 blocks
    other = hashes(list(range(200, 208)))  # 2 blocks
    index.apply(stored("w1", 0, family[:2]))
    token = index.add_in_flight("w1", family)  # 2 reported + 2 more claimed
    index.add_in_flight("w2", other)
    assert index.num_blocks_known() == {"w1": 4, "w2": 2}
    index.end_in_flight(token)  # ended, not yet reported: still known while it lingers
    clock[0] = 0.9
    assert index.num_blocks_known()["w1"] == 4
    clock[0] = 1.1
    assert index.num_blocks_known() == {"w1": 2, "w2": 2}


def test_counts_kept_as_claims_and_events_arrive_match_a_recount_after_any_mix_of_them():
    """num_blocks_known is kept incrementally (claims, ends, expiries, STORED, EVICTED,
    CLEARED, resets, removed workers): after each step it equals a recount over everything."""
    rng = random.Random(7)
    clock = [0.0]
    index = PrefixIndex(linger_s=0.5, clock=lambda: clock[0])
    families = [hashes([f * 100 + t for t in range(12)]) for f in range(4)]  # 3 blocks each
    seqs = {"w1": 0, "w2": 0}
    tokens = []

    def event(worker, kind, block_hashes=(), reset=False):
        seq = seqs[worker]
        seqs[worker] += 1
        index.apply(PrefixEventBatch(worker, seq + 1, () if reset else (PrefixEvent(seq, kind, tuple(block_hashes)),),
                                     reset=reset, all_hashes=tuple(block_hashes) if reset else ()))

    for _ in range(400):
        worker, family = rng.choice(("w1", "w2")), rng.choice(families)
        op = rng.randrange(8)
        if op == 0:
            tokens.append(index.add_in_flight(worker, family))
        elif op == 1 and tokens:
            index.end_in_flight(tokens.pop(rng.randrange(len(tokens))))
        elif op == 2:
            event(worker, PrefixEventKind.STORED, family[:rng.randint(1, 3)])
        elif op == 3:
            event(worker, PrefixEventKind.EVICTED, family[rng.randrange(3):])
        elif op == 4 and rng.random() < 0.2:
            event(worker, PrefixEventKind.CLEARED)
        elif op == 5 and rng.random() < 0.2:
            event(worker, PrefixEventKind.STORED, family, reset=True)
        elif op == 6 and rng.random() < 0.05:
            index.remove_worker(worker)
            seqs[worker] = 0
        clock[0] += rng.random() * 0.2
        known = index.num_blocks_known()  # expires lingering claims first
        index.check_integrity()
        for w in ("w1", "w2"):
            claimed = {h for h, claims in index._in_flight_holders.items() if w in claims}
            assert known.get(w, 0) == len(index._blocks.get(w, set()) | claimed)


def test_prompt_hashes_are_the_workers_block_hashes_and_stay_stable():
    """The router hashes a whole prompt at once; the worker's KV manager hashes block by block
    (`hash_block`). Both must give the same bytes, and the same as before (pinned): a change
    would make every cached prefix a miss."""
    from kvmesh.kv.hashing import hash_block

    rng = random.Random(7)
    for extra in ((), ("model=m",), ("model=m", "rev=r", "salt=s")):
        tokens = [rng.randrange(0, 50000) for _ in range(16 * 5 + 3)]
        chained, parent = [], None
        for start in range(0, 16 * 5, 16):
            parent = hash_block(parent, tokens[start:start + 16], extra)
            chained.append(parent)
        assert hash_full_blocks(tokens, 16, extra) == chained
        assert hash_full_blocks(tokens[16:], 16, extra, start_parent=chained[0]) == chained[1:]
    assert hash_full_blocks(list(range(15)), 16) == []
    pinned = hash_full_blocks(list(range(1000, 1040)), 16, ("model=m", "rev=r"))
    assert [h.hex() for h in pinned] == ["548240e63fe924f8424071274cf860a8", "fb8796ce5f6a20c76d8475dd556d1329"]


def test_stored_blocks_are_reported_after_a_workers_first_batch_which_replays_its_history():
    seen = []
    index = PrefixIndex()
    index.on_stored = lambda worker, blocks: seen.append((worker, blocks))
    h = hashes(list(range(3 * BLOCK)))  # 3 blocks
    index.apply(stored("w0", 0, h[:2]))  # the first poll: the worker's history, not recent work
    index.apply(stored("w0", 1, h[2:]))
    index.apply(stored("w0", 1, h[2:]))  # delivered twice: counted once
    assert seen == [("w0", 1)]
