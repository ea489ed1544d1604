"""Eviction policies: order, skipping, scan resistance, and the simulated trace."""
import importlib.machinery
import importlib.util
from pathlib import Path

import pytest

from kvfs.namespace.policy import LRU, POLICIES, S3FIFO


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
