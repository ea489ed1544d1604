"""Eviction policies: order, skipping, scan resistance, and the simulated trace."""
import bisect
import collections
import importlib.machinery
import importlib.util
import random
import types
from pathlib import Path

import pytest

from kvfs.namespace import packedqueue
from kvfs.namespace.packedqueue import PackedQueue
from kvfs.namespace.policy import LRU, POLICIES, S3FIFO

from .policy_reference import ReferenceLRU, ReferenceS3FIFO


def load_sim():
    path = Path(__file__).resolve().parents[2] / "tools" / "evict-sim"
    loader = importlib.machinery.SourceFileLoader("evict_sim", str(path))
    spec = importlib.util.spec_from_loader("evict_sim", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_lru_evicts_least_recently_used_and_skipped_files_wait():
    p = LRU()
    for ino in (1, 2, 3, 4):
        p.insert(ino, 10)
    p.access(1)
    walk = p.victims()
    assert next(walk) == 2
    # The evictor skipped 2 (say it is open): 3 is next, and 2 moved to the back.
    assert next(walk) == 3
    p.remove(3)
    assert list(p.victims()) == [4, 1, 2]
    assert 3 not in p and len(p) == 3


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_yields_each_file_at_most_a_few_times_and_ends(name):
    p = POLICIES[name]()
    for ino in range(50):
        p.insert(ino, 1)
        if ino % 3 == 0:
            p.access(ino)
    seen = list(p.victims())            # nothing evicted: the walk must still end
    assert set(seen) <= set(range(50)) and len(seen) <= 5 * 51
    for ino in range(50):
        p.remove(ino)
    assert len(p) == 0 and list(p.victims()) == []


def test_s3fifo_keeps_the_hot_set_through_a_scan_that_flushes_lru():
    hot = list(range(20))
    results = {}
    for policy in (LRU(), S3FIFO()):
        for ino in hot:
            policy.insert(ino, 1)
        for _ in range(3):
            for ino in hot:
                policy.access(ino)
        for ino in range(1000, 1200):   # a scan: 200 one-off files, capacity 40
            policy.insert(ino, 1)
            while len(policy) > 40:
                policy.remove(next(policy.victims()))
        results[policy.name] = sum(1 for ino in hot if ino in policy)
    assert results["lru"] == 0          # LRU lost every hot file to the scan
    assert results["s3fifo"] == len(hot)


def test_s3fifo_ghosts_return_to_the_main_queue():
    p = S3FIFO()
    for ino in range(10):
        p.insert(ino, 1)
    first = next(p.victims())           # from the small queue, remembered as a ghost
    p.remove(first)
    p.insert(first, 1)                  # back soon: it is wanted, into the main queue
    assert first in p._main


def test_s3fifo_beats_lru_on_the_simulated_kv_trace():
    sim = load_sim()
    events = list(sim.trace(4000, seed=7, scan_every=800, scan_size=600))
    for capacity in (500, 1500):
        assert sim.simulate("s3fifo", capacity, events) > sim.simulate("lru", capacity, events)


@pytest.mark.parametrize("name", ["lru", "s3fifo"])
@pytest.mark.parametrize("seed", range(40))
def test_packed_policies_decide_as_the_ordereddict_ones_did_loaded_or_inserted(name, seed, monkeypatch):
    """The policies' queues are PackedQueues, and a mount load()s its files in one go.
    Neither may change a decision: three policies see the same random history (the
    OrderedDict reference with the files inserted one by one, the packed policy
    inserted, the packed policy loaded) and must yield the same victims, with the
    same membership and byte counts throughout, while walks move files around, the
    evictor removes some, and reinserts, reads and removals come and go."""
    if seed % 2:
        monkeypatch.setattr(packedqueue, "_NEAR_END", 8)     # numbers out of order go to _extra too
    rng = random.Random(seed)
    files = rng.sample(range(16, 5000), rng.choice([1, 5, 60, 1500]))
    sizes = {ino: rng.choice([4096, 1 << 20, 3 << 20]) for ino in files}
    reference = {"lru": ReferenceLRU, "s3fifo": ReferenceS3FIFO}[name]()
    inserted, loaded = POLICIES[name](), POLICIES[name]()
    for ino in files:
        reference.insert(ino, sizes[ino])
        inserted.insert(ino, sizes[ino])
    loaded.load(list(files), sizes.__getitem__)
    policies = (reference, inserted, loaded)
    universe = files + list(range(6000, 6100))
    fresh = iter(range(10_000, 20_000))           # new files: numbers above all others
    for _ in range(400):
        op = rng.random()
        ino = rng.choice(universe)
        if op < 0.2:
            for p in policies:
                p.access(ino)
        elif op < 0.35:
            size = rng.choice([4096, 1 << 20])
            ino = next(fresh) if rng.random() < 0.5 else ino
            for p in policies:
                p.insert(ino, size)
        elif op < 0.55:
            for p in policies:
                p.remove(ino)
        else:
            # A walk: take some victims, evict (remove) some of them, skip the others.
            walks = [p.victims() for p in policies]
            for _ in range(rng.randrange(1, 60)):
                got = [next(w, None) for w in walks]
                assert got[0] == got[1] == got[2]
                if got[0] is None:
                    break
                if rng.random() < 0.5:
                    for p in policies:
                        p.remove(got[0])
        assert len(reference) == len(inserted) == len(loaded)
        assert (ino in reference) == (ino in inserted) == (ino in loaded)
        if name == "s3fifo":
            bytes_ = {(p._small_bytes, p._main_bytes) for p in policies}
            assert len(bytes_) == 1
    walks = [list(p.victims()) for p in policies]
    assert walks[0] == walks[1] == walks[2]


@pytest.mark.parametrize("step", [2, 3, packedqueue._STEP])
@pytest.mark.parametrize("near_end", [8, packedqueue._NEAR_END])
@pytest.mark.parametrize("seed", range(10))
def test_a_packed_queue_keeps_fifo_order_sizes_and_membership_through_compactions(seed, near_end, step, monkeypatch):
    """PackedQueue against an OrderedDict, with enough churn for several compactions,
    numbers inserted in place, and (with a small near_end) numbers kept in _extra.
    With a small slack, and a tiny step, compactions run most of the time, so every
    operation meets them half done (a log half copied, slots half moved, _extra
    numbers due to be folded in)."""
    monkeypatch.setattr(packedqueue, "_NEAR_END", near_end)
    monkeypatch.setattr(packedqueue, "_STEP", step)
    monkeypatch.setattr(packedqueue, "_SLACK", slack := 16)
    rng = random.Random(seed)
    start = rng.sample(range(100, 3000), 300)
    queue = PackedQueue(list(start), lambda ino: ino * 3)
    model = collections.OrderedDict((ino, ino * 3) for ino in start)
    next_new, used_extra = 3000, False
    for n in range(6000):
        op = rng.random()
        if op < 0.3:                                           # a new file (the largest number yet)
            next_new += rng.randrange(1, 4)
            ino, size = next_new, rng.randrange(1, 1 << 20)
        elif op < 0.55:                                        # a file moved to the back, or any (re)queued
            ino = rng.choice(list(model)) if model and rng.random() < 0.7 else rng.randrange(100, next_new + 1)
            size = rng.randrange(1, 1 << 20)
        else:
            ino = rng.choice(list(model)) if model and rng.random() < 0.8 else rng.randrange(100, next_new + 1)
            assert queue.remove(ino) == model.pop(ino, None)
            continue
        queue.push(ino, size)
        used_extra = used_extra or bool(queue._extra)
        model[ino] = size
        model.move_to_end(ino)
        # Garbage stays bounded: a compaction starts once entries pass twice the
        # files (+ slack) and only shrinks them while it runs (measured: never
        # above 1.002 times that line). Without compactions the log would reach
        # ~3x the files by the end.
        stats = queue.statistics()
        line = 2 * len(model) + slack
        assert stats["log_entries"] <= 1.1 * line and stats["slots"] <= 1.1 * line, (stats, len(model))
        if n % 97 == 0:
            assert list(queue) == list(model.items())
            assert queue.sizes_total() == sum(model.values())
        assert len(queue) == len(model)
        assert queue.first() == next(iter(model.items()), None)
        probe = rng.randrange(100, next_new + 1)
        assert queue.get(probe) == model.get(probe) and (probe in queue) == (probe in model)
    assert used_extra == (near_end == 8), "_extra is for numbers far below the largest only"
    stats = queue.statistics()
    assert stats["log_compactions"] >= 3 and stats["slot_compactions"] >= 2, stats
    while model:                                               # drain from the front
        assert queue.first() == next(iter(model.items()))
        assert queue.remove(queue.first()[0]) == model.popitem(last=False)[1]
    assert queue.first() is None and len(queue) == 0 and list(queue) == []


def test_no_queue_call_does_work_in_proportion_to_the_files(monkeypatch):
    """A compaction runs a step per call: rebuilt whole, it held the event loop for
    1.3 s on the one remove that crossed the line at a million files. Here 30,000
    files go through removals and moves enough for several compactions of the log
    and of the slots, and no single call may bisect more than a step's worth
    (a whole rebuild bisects once per live file: 9,000 or more here)."""
    bisections = [0]

    def counting_bisect_left(*args):
        bisections[0] += 1
        return bisect.bisect_left(*args)
    monkeypatch.setattr(packedqueue, "bisect", types.SimpleNamespace(bisect_left=counting_bisect_left))
    rng = random.Random(5)
    files = list(range(1000, 31000))
    queue = PackedQueue(list(files), lambda ino: 4096)
    calls, most = 0, 0

    def counted(call, *args):
        nonlocal calls, most
        before = bisections[0]
        result = call(*args)
        calls += 1
        most = max(most, bisections[0] - before)
        return result
    rng.shuffle(files)
    for ino in files[:21000]:                              # 70% leave
        assert counted(queue.remove, ino) == 4096
    survivors = files[21000:]
    for i in range(3 * len(survivors)):                    # the rest are moved to the back three times over
        counted(queue.push, survivors[i % len(survivors)], 4096)
    for ino in range(40000, 45000):                        # and new ones arrive
        counted(queue.push, ino, 4096)
    stats = queue.statistics()
    assert stats["log_compactions"] >= 3 and stats["slot_compactions"] >= 1, stats
    assert most <= packedqueue._STEP + 4, most
    assert stats["most_moved_in_one_call"] <= 2 * packedqueue._STEP
    assert calls == 21000 + 3 * 9000 + 5000
    # and the queue is still right: front to back, the survivors in their last order, then the new ones
    assert [ino for ino, _ in queue] == survivors + list(range(40000, 45000))
    assert queue.sizes_total() == 4096 * (len(survivors) + 5000)
