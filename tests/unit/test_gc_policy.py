"""kvfs.base.gcpolicy: full collections walk only what was created since the last one.

Deterministic: the collector's generations are observed with gc.get_objects and
gc.get_freeze_count, never timed. The policy is always uninstalled at the end,
so the objects of the test process go back to the collector.
"""
import gc
import threading
import weakref

import pytest

from kvfs.base import gcpolicy
from kvfs.base.gcpolicy import FreezeAfterFullCollections, collections_paused
from kvfs.namespace import ROOT_INO

from .helpers import close_and_check, mkfs, open_fs, running, write_file


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
    policy.count_frozen()
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


def test_the_frozen_count_is_taken_at_install_and_on_demand_not_per_statistics_call(policy, monkeypatch):
    assert policy.statistics().frozen_objects > 0      # install counted them
    counted = policy.count_frozen()
    assert counted == gc.get_freeze_count()
    more = [[i] for i in range(5_000)]
    gc.collect()                                      # freezes the 5,000 lists
    st = policy.statistics()
    assert st.frozen_objects == counted               # not recounted: a walk of everything frozen
    assert 0.0 <= st.frozen_counted_s_ago < gcpolicy.FROZEN_COUNT_MAX_AGE_S
    assert policy.count_frozen() >= counted + len(more)
    assert policy.statistics().frozen_objects >= counted + len(more)
    del more
    monkeypatch.setattr(gcpolicy, "FROZEN_COUNT_MAX_AGE_S", -1.0)   # every count is too old
    assert policy.statistics().frozen_objects == gc.get_freeze_count()


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


def test_collections_pause_nests_across_threads_and_restores_the_collector():
    assert gc.isenabled()
    with collections_paused():
        assert not gc.isenabled()
        inner_done = threading.Event()

        def other_thread():
            with collections_paused():
                assert not gc.isenabled()
            inner_done.set()
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert inner_done.is_set() and not gc.isenabled()    # the outer pause still holds
    assert gc.isenabled()
    gc.disable()
    try:
        with collections_paused():
            pass
        assert not gc.isenabled()                            # it was off before: it stays off
    finally:
        gc.enable()


async def test_a_checkpoint_runs_with_collections_paused(tmp_path):
    fs = open_fs(mkfs(tmp_path))
    seen = []
    async with running(fs):
        await write_file(fs.ns, ROOT_INO, b"f", b"x" * 5000)
        build = fs.ns.tree.cut

        def cut_and_look():
            seen.append(gc.isenabled())
            return build()
        fs.ns.tree.cut = cut_and_look
        await fs.ns.checkpoint()
        fs.ns.tree.cut = build
    assert seen == [False] and gc.isenabled()
    close_and_check(fs)


def test_release_in_pieces_empties_lists_and_frees_what_only_they_held():
    class Row:
        pass
    rows = [Row() for _ in range(3 * gcpolicy.RELEASE_SLICE + 5)]
    watched = weakref.ref(rows[7])
    other = [1, 2]
    gcpolicy.release_in_pieces(rows, other, [])
    assert rows == [] and other == []
    assert watched() is None                         # freed by reference counting, no collection


def test_frozen_when_loaded_pauses_collections_then_freezes_what_the_load_made():
    assert gc.isenabled()
    frozen_before = gc.get_freeze_count()
    try:
        with gcpolicy.frozen_when_loaded():
            assert not gc.isenabled()
            loaded = [[i] for i in range(10_000)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= frozen_before + len(loaded)
        assert tracked_in_generations() < 1_000     # the first collection after it walks none of them
    finally:
        gc.unfreeze()


def test_collect_and_count_freezes_what_is_alive_and_counts_it(policy):
    counted = policy.count_frozen()
    alive = [[i] for i in range(5_000)]              # tracked, not frozen yet
    assert policy.count_frozen() == counted          # a plain count does not see them
    full = policy.statistics().full_collections
    assert policy.collect_and_count() >= counted + len(alive)
    assert policy.statistics().full_collections == full + 1
    assert policy.statistics().frozen_objects >= counted + len(alive)   # the count stats report
    del alive
