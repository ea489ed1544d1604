"""Eviction policies: order, skipping, scan resistance, and the simulated trace."""
import importlib.machinery
import importlib.util
import random
from pathlib import Path

import pytest

from kvfs.namespace.policy import LRU, POLICIES, S3FIFO, Backlog


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
def test_files_loaded_at_mount_behave_as_if_inserted_one_by_one(name, seed):
    """load() keeps a mount's files packed (policy.Backlog); nothing else may differ.

    Two policies see the same random history: one had the files inserted one by
    one, the other load()ed. Every walk must yield the same files, and
    membership and sizes must agree throughout (a walk moves files around, the
    evictor removes some, reinserts and reads come and go)."""
    rng = random.Random(seed)
    files = rng.sample(range(16, 5000), rng.choice([1, 5, 60, 1500]))
    sizes = {ino: rng.choice([4096, 1 << 20, 3 << 20]) for ino in files}
    inserted, loaded = POLICIES[name](), POLICIES[name]()
    for ino in files:
        inserted.insert(ino, sizes[ino])
    loaded.load(list(files), sizes.__getitem__)
    universe = files + list(range(6000, 6100))
    for _ in range(300):
        op = rng.random()
        ino = rng.choice(universe)
        if op < 0.25:
            for p in (inserted, loaded):
                p.access(ino)
        elif op < 0.4:
            size = rng.choice([4096, 1 << 20])
            for p in (inserted, loaded):
                p.insert(ino, size)
        elif op < 0.6:
            for p in (inserted, loaded):
                p.remove(ino)
        else:
            # A walk: take some victims, evict (remove) some of them, skip the others.
            walks = [p.victims() for p in (inserted, loaded)]
            for _ in range(rng.randrange(1, 40)):
                got = [next(w, None) for w in walks]
                assert got[0] == got[1]
                if got[0] is None:
                    break
                if rng.random() < 0.5:
                    for p in (inserted, loaded):
                        p.remove(got[0])
        assert len(inserted) == len(loaded)
        assert (ino in inserted) == (ino in loaded)
        if name == "s3fifo":
            assert (inserted._small_bytes, inserted._main_bytes) == (loaded._small_bytes, loaded._main_bytes)
    assert list(inserted.victims()) == list(loaded.victims())
    assert sorted(i for i in universe if i in inserted) == sorted(i for i in universe if i in loaded)


def test_a_backlog_compacts_once_most_files_left_and_keeps_the_rest_in_order():
    files = list(range(100, 5100))
    backlog = Backlog(files, lambda ino: ino * 2)
    assert len(backlog) == 5000 and backlog.bytes == sum(2 * i for i in files)
    for ino in files[::3] + files[1::3]:                 # two thirds leave, out of queue order
        assert backlog.remove(ino) == ino * 2
    assert backlog.remove(files[0]) is None              # already gone
    assert len(backlog._order) < 5000                   # compacted: the departed take no room
    left = files[2::3]
    assert len(backlog) == len(left) and backlog.bytes == sum(2 * i for i in left)
    assert all(i in backlog for i in left) and not any(i in backlog for i in files[::3])
    seen = []
    while (head := backlog.head()) is not None:
        seen.append(head)
        backlog.remove(head[0])
    assert seen == [(i, 2 * i) for i in left] and len(backlog) == 0 and backlog.bytes == 0
