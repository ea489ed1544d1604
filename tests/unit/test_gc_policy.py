"""kvfs.gcpolicy: full collections walk only what was created since the last one.

Deterministic: the collector's generations are observed with gc.get_objects and
gc.get_freeze_count, never timed. The policy is always uninstalled at the end,
so the objects of the test process go back to the collector.
"""
import gc
import weakref

import pytest

from kvfs.gcpolicy import FreezeAfterFullCollections


class Node:
    def __init__(self):
        self.me = self                  # a reference cycle: only the collector frees it


@pytest.fixture
def policy():
    p = FreezeAfterFullCollections()
    gc.collect()
    p.install()
    try:
        yield p
    finally:
        p.uninstall()


def tracked_in_generations():
    return sum(len(gc.get_objects(generation=g)) for g in range(3))


def test_install_freezes_what_is_loaded_and_each_full_collection_freezes_its_survivors(policy):
    loaded = [[i] for i in range(20_000)]          # frozen by install (it ran before this list)
    assert policy.statistics().full_collections == 0
    frozen_before = gc.get_freeze_count()
    gc.collect()
    st = policy.statistics()
    assert st.full_collections == 1
    # The survivors, the 20,000 lists among them, left the generations the next
    # full collection walks.
    assert st.frozen_objects >= frozen_before + len(loaded)
    assert tracked_in_generations() < 1_000
    grown = [[i] for i in range(5_000)]
    assert tracked_in_generations() >= len(grown)  # new objects are collected as usual
    gc.collect()
    assert policy.statistics().full_collections == 2
    assert tracked_in_generations() < 1_000
    assert policy.statistics().full_collection_max_s >= 0.0


def test_cycles_made_after_a_freeze_are_still_collected(policy):
    gc.collect()                                     # freeze what exists
    node = Node()
    gone = weakref.ref(node)
    del node
    assert gone() is not None                        # a cycle: reference counting cannot free it
    gc.collect()
    assert gone() is None


def test_frozen_objects_freed_by_reference_count_leave_the_frozen_count():
    p = FreezeAfterFullCollections()
    gc.collect()
    p.install()
    try:
        files = [[i] for i in range(10_000)]
        gc.collect()
        with_files = gc.get_freeze_count()
        del files                                    # no cycles, as in the namespace: freed at once
        assert gc.get_freeze_count() <= with_files - 10_000
    finally:
        p.uninstall()


def test_uninstall_gives_everything_back():
    p = FreezeAfterFullCollections()
    p.install()
    assert gc.get_freeze_count() > 0
    p.uninstall()
    assert gc.get_freeze_count() == 0
    assert p._on_collection not in gc.callbacks
    p.uninstall()                                    # idempotent
