"""Allocator: next-fit allocation, free with coalescing, allocate_at, errors."""
import random

import pytest

from kvfs.errors import FormatError, NoSpace
from kvfs.store.allocator import Allocator

from .helpers import mkfs, assert_fsck_clean

S = 4096
START = 1 << 20


def make(nsectors=64):
    return Allocator(START, nsectors * S)


def test_fresh_allocator_is_one_free_extent():
    a = make()
    assert a.extents() == [(START, 64 * S)]
    assert a.free_bytes == 64 * S


def test_allocate_rounds_up_and_is_next_fit():
    a = make()
    x = a.allocate(1)                  # rounds up to one sector
    y = a.allocate(S + 1)              # two sectors
    z = a.allocate(S)
    assert (x, y, z) == (START, START + S, START + 3 * S)
    assert a.free_bytes == 60 * S
    a.free(x, S)
    # Next-fit: the cursor is past z, so the hole at the start is not reused yet.
    assert a.allocate(S) == START + 4 * S
    # Once the tail is used up, allocation wraps around to the freed hole.
    assert a.allocate(59 * S) == START + 5 * S
    assert a.allocate(S) == START
    assert a.free_bytes == 0
    with pytest.raises(NoSpace, match="no free extent"):
        a.allocate(S)


def test_enospc_when_no_extent_is_large_enough():
    a = make(8)
    offs = [a.allocate(S) for _ in range(8)]
    for off in offs[::2]:
        a.free(off, S)                 # 4 sectors free, but never 2 adjacent
    assert a.free_bytes == 4 * S
    with pytest.raises(NoSpace) as info:
        a.allocate(2 * S)
    assert info.value.errno == 28
    assert "16384 bytes free in total" in str(info.value)
    assert a.allocate(S) in offs[::2]


def test_free_coalesces_with_both_neighbours():
    a = make(10)
    offs = [a.allocate(S) for _ in range(10)]
    a.free(offs[1], S)
    a.free(offs[3], S)
    assert a.extents() == [(offs[1], S), (offs[3], S)]
    a.free(offs[2], S)                 # bridges the two
    assert a.extents() == [(offs[1], 3 * S)]
    a.free(offs[0], S)                 # joins at the front
    assert a.extents() == [(offs[0], 4 * S)]
    a.free(offs[9], S)
    a.free(offs[8], S)                 # joins the following extent
    assert a.extents() == [(offs[0], 4 * S), (offs[8], 2 * S)]
    for off in offs[4:8]:
        a.free(off, S)
    assert a.extents() == [(START, 10 * S)]
    assert a.free_bytes == 10 * S


def test_double_free_and_out_of_range_free_are_refused():
    a = make(10)
    off = a.allocate(4 * S)
    a.free(off + S, S)
    with pytest.raises(FormatError, match="double free"):
        a.free(off + S, S)             # exactly the same extent
    with pytest.raises(FormatError, match="double free"):
        a.free(off, 2 * S)             # overlaps a free extent from the left
    with pytest.raises(FormatError, match="double free"):
        a.free(off + 3 * S, 2 * S)     # overlaps the free tail of the region
    with pytest.raises(FormatError, match="outside the data region"):
        a.free(START - S, S)
    with pytest.raises(FormatError, match="outside the data region"):
        a.free(START + 10 * S, S)
    with pytest.raises(FormatError, match="outside the data region"):
        a.free(off + 1, S)             # unaligned
    # Refused frees changed nothing.
    assert a.free_bytes == 7 * S
    assert a.extents() == [(off + S, S), (off + 4 * S, 6 * S)]


def test_allocate_at_splits_and_refuses_used_space():
    a = make(16)
    a.allocate_at(START + 4 * S, 2 * S)
    assert a.extents() == [(START, 4 * S), (START + 6 * S, 10 * S)]
    a.allocate_at(START, S)
    a.allocate_at(START + 15 * S, S)
    assert a.extents() == [(START + S, 3 * S), (START + 6 * S, 9 * S)]
    assert a.free_bytes == 12 * S
    with pytest.raises(FormatError, match="referenced twice"):
        a.allocate_at(START + 4 * S, S)          # already allocated
    with pytest.raises(FormatError, match="referenced twice"):
        a.allocate_at(START + 3 * S, 2 * S)      # straddles free and used
    with pytest.raises(FormatError, match="outside free space"):
        a.allocate_at(START - S, S)
    assert a.free_bytes == 12 * S


def test_constructed_from_a_free_list():
    a = Allocator(START, 16 * S, [(START + 2 * S, 2 * S), (START + 4 * S, S), (START + 10 * S, 6 * S)])
    assert a.extents() == [(START + 2 * S, 3 * S), (START + 10 * S, 6 * S)]   # adjacent ones merged
    assert a.free_bytes == 9 * S
    assert Allocator(START, 16 * S, []).free_bytes == 0


def test_random_allocate_free_keeps_an_exact_partition():
    rng = random.Random(1234)
    n = 256
    a = make(n)
    used = {}
    for _ in range(3000):
        if used and (rng.random() < 0.45 or a.free_bytes == 0):
            off = rng.choice(list(used))
            a.free(off, used.pop(off))
        else:
            want = rng.randint(1, 6) * S
            try:
                off = a.allocate(want)
            except NoSpace:
                assert all(length < want for _, length in a.extents())
                continue
            used[off] = want
        # Used and free extents tile the region exactly; free extents are maximal.
        spans = sorted(list(used.items()) + a.extents())
        cursor = START
        for off, length in spans:
            assert off == cursor
            cursor += length
        assert cursor == START + n * S
        free = a.extents()
        assert all(x + lx < y for (x, lx), (y, _) in zip(free, free[1:]))
        assert a.free_bytes == sum(length for _, length in free)


def test_store_allocator_matches_the_data_region(tmp_path):
    """The allocator the store builds from mkfs's checkpoint covers the data region."""
    from kvfs.device import Device
    from kvfs.store import ExtentStore
    path = mkfs(tmp_path)
    device = Device.open(str(path))
    try:
        store = ExtentStore.open(device)
        assert store.free_extents() == [(store.sb.data_off, store.sb.data_len)]
        assert store.free_slots() == store.sb.data_len // store.block_size
        assert store.allocate(1) == store.sb.data_off
    finally:
        device.close()
    assert_fsck_clean(path)          # nothing durable changed


def churn(a, rng, steps, *, free_share, sizes, placement=None, promise=None):
    """Random allocations of ``sizes`` (with ``placement(live)``'s keyword arguments, if
    given) and frees on ``a``, checking after each step that ``slots`` is the exact sum
    of ``len // slot``, ``free_bytes`` the sum of the free extents, and that no
    allocation of at most a slot cost more than one; then that as many slot-sized
    allocations (with ``promise``'s arguments) as ``slots`` says all succeed (what
    reservations rely on)."""
    slot, end = a.slot, a.end
    live = []
    for step in range(steps):
        if live and (rng.random() < free_share or a.slots == 0):
            off, n = live.pop(rng.randrange(len(live)))
            a.free(off, n)
        else:
            n = rng.choice(sizes)
            kwargs = placement(live) if placement is not None else {}
            before = a.slots
            try:
                off = a.allocate(n, **kwargs)
            except NoSpace:
                assert n > max((length for _, length in a.extents()), default=0)
                continue
            assert off % S == 0 and START <= off and off + n <= end
            assert before - a.slots <= 1, f"step {step}: {kwargs} cost {before - a.slots} slots"
            live.append((off, n))
        assert a.slots == sum(length // slot for _, length in a.extents())
        assert a.free_bytes == sum(length for _, length in a.extents())
    promised = a.slots
    for _ in range(promised):
        live.append((a.allocate(slot, **(promise or {})), slot))
    assert a.slots == 0


def test_slots_count_whole_block_pieces_and_reservations_always_fit():
    """Random allocations of at most one slot and frees: ``slots`` stays the exact sum
    of ``len // slot``, an allocation costs at most one slot, and as many slot-sized
    allocations as ``slots`` says always succeed (what reservations rely on)."""
    slot = 16 * S
    churn(Allocator(START, 1024 * S, slot=slot), random.Random(7), 3000,
          free_share=0.45, sizes=[S, 3 * S, 8 * S, 15 * S, slot])


def test_small_allocations_keep_whole_slots_when_a_tail_has_room():
    slot = 16 * S
    a = Allocator(START, 3 * slot + 4 * S, slot=slot)          # 3 slots and a 4-sector tail
    assert a.slots == 3
    for _ in range(4):
        a.allocate(S)
    assert a.slots == 3                                          # the tail took them
    a.allocate(S)
    assert a.slots == 2                                          # now one slot had to give


# -- runs: follow, window, lead (a file's blocks kept together) -------------------

SLOT = 16 * S


def make_slotted(nslots=64):
    return Allocator(START, nslots * SLOT, slot=SLOT)


def test_a_block_follows_its_file_where_that_space_is_free():
    a = make_slotted()
    first = a.allocate(SLOT, window=8 * SLOT)
    assert first == START
    # Another file's run starts past the first one's window, not right after it.
    other = a.allocate(SLOT, window=8 * SLOT)
    assert other == START + 8 * SLOT
    # The first file's next blocks go on from its block, inside its window...
    assert a.allocate(SLOT, follow=first + SLOT) == first + SLOT
    # ...even ahead of a block still on its way (a whole number of slots in).
    assert a.allocate(SLOT, follow=first + 3 * SLOT) == first + 3 * SLOT
    assert a.allocate(SLOT, follow=first + 2 * SLOT) == first + 2 * SLOT
    # A plain allocation (a small file's block) takes the cursor, past both windows.
    assert a.allocate(SLOT) == START + 16 * SLOT
    assert a.slots == sum(n // SLOT for _, n in a.extents())


def test_follow_is_only_a_preference():
    a = make_slotted()
    used = a.allocate(SLOT)
    # Taken already, cut at a part of a slot, outside the region: next-fit instead.
    assert a.allocate(SLOT, follow=used) == START + SLOT
    assert a.allocate(SLOT, follow=START + 3 * SLOT + S) == START + 2 * SLOT
    assert a.allocate(SLOT, follow=START - SLOT) == START + 3 * SLOT
    assert a.allocate(SLOT, follow=START + 64 * SLOT) == START + 4 * SLOT


def test_a_run_started_late_leaves_room_for_the_blocks_before_it():
    a = make_slotted()
    a.allocate(SLOT)                                  # something at the start
    third = a.allocate(SLOT, window=8 * SLOT, lead=2)
    assert third == START + 3 * SLOT                  # two free slots before it, in the run
    assert a.allocate(SLOT, follow=third - 2 * SLOT) == START + SLOT
    assert a.allocate(SLOT, follow=third - SLOT) == START + 2 * SLOT
    # The window counts from the run's start.
    assert a.allocate(SLOT, window=8 * SLOT) == START + 9 * SLOT


def test_a_window_is_free_space_once_next_fit_comes_round():
    a = make_slotted(16)
    a.allocate(SLOT, window=8 * SLOT)                 # a run that never grows
    rest = [a.allocate(SLOT) for _ in range(15)]      # everything else, windows included
    assert sorted(rest) == [START + i * SLOT for i in range(1, 16)]
    with pytest.raises(NoSpace):
        a.allocate(SLOT)


def test_a_run_that_does_not_fit_with_its_lead_starts_without_it():
    a = make_slotted(4)
    a.allocate(SLOT)
    a.allocate(SLOT)
    # Two free slots left: no room for a lead of 3 before the block, so no lead.
    assert a.allocate(SLOT, window=8 * SLOT, lead=3) == START + 2 * SLOT


def test_runs_keep_the_slot_invariant_under_random_placement():
    """Random follows (right, wrong, misaligned), windows, leads and frees: ``slots`` stays
    exact and no allocation of at most a slot costs more than one (reservations)."""
    rng = random.Random(11)

    def placement(live):
        kwargs = {}
        if live and rng.random() < 0.6:
            base = rng.choice(live)[0]
            kwargs["follow"] = base + rng.choice([SLOT, 2 * SLOT, -SLOT, S, 3 * SLOT])
        if rng.random() < 0.5:
            kwargs["window"] = rng.choice([SLOT, 8 * SLOT])
            kwargs["lead"] = rng.choice([0, 0, 1, 3])
        return kwargs

    churn(Allocator(START, 512 * SLOT, slot=SLOT), rng, 4000, free_share=0.4,
          sizes=[S, 5 * S, SLOT, SLOT], placement=placement, promise={"window": 8 * SLOT})
