"""The block index: content key -> extent, with reference counts and dedup.

A block is named by the keyed xxh3-128 of its bytes, so identical blocks are
stored once. The key: xxh3-128 seeded with the filesystem's random ``hash_seed``
over its 256-bit ``key_secret``, then the block's dedup domain (8 bytes, only
when it is not 0), then the bytes. A version 1 store has no secret and only
domain 0, so its keys are xxh3-128(bytes, seed) as they always were.

Dedup domains (issue 12, tenants): a file's blocks are keyed in the domain of
its owner, so two tenants' identical blocks get different keys and are stored
twice. No tenant can then learn, from space, timing or keys, whether another
stored some content, and no crafted collision can make one tenant's block
stand for another's bytes. By default each uid is its own domain; a mount
option groups uids that may share (``DedupDomains``). ``dedup_verify`` adds a
byte comparison on every dedup hit, for operators who want more than a keyed
128-bit hash.

Each entry counts two kinds of users:
``refs``  references from *durable* file contents, i.e. from content records in
          the journal or checkpoint. Only record application changes them, so
          replay reproduces them exactly.
``pins``  live users in RAM (the current block lists of open or cached files,
          a flush in progress). They keep a block alive between the moment its
          data is written and the moment a content record names it.

An entry is dropped, and its extent freed, when both reach zero. The extent
store delays reuse of the extent until the freeing record is durable.

The block cache above uses the index for block bytes, pins and reservations.
The namespace holds it as its journal port (kvfs/schema/port.py): records,
commits and checkpoints pass on to the store; references and space are here.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any, Iterable, Sequence

import trio
import xxhash

from .. import schema
from ..base.aligned import SECTOR, Buffer, WritableBuffer, align_up
from ..base.crashpoints import crashpoint
from ..base.gcpolicy import release_off_loop
from ..base.sharedints import shared
from ..errors import CorruptBlock, DedupCollision, FormatError, KvfsError, NoSpace, SpaceAwaitsCommit
from ..store.port import BlockCheck, StoreCut, StorePort
from .cut import IndexCut
from .domains import DedupDomains
from .entries import BlockEntry, IndexStatistics
from .runs import RUN_WINDOW_BLOCKS, RunHint, run_position

log = logging.getLogger(__name__)


class BlockIndex:
    def __init__(self, store: StorePort, hash_limiter: trio.CapacityLimiter | None = None, *,
                 dedup_groups: str | list[frozenset[int]] | None = None, dedup_verify: bool = False) -> None:
        self.store = store
        self.domains = DedupDomains(store.key_secret, dedup_groups)
        self.dedup_verify = dedup_verify
        # The public identifier key (user.kvfs.key): a BLAKE2b PRF of the internal
        # key, so users who see it learn nothing that helps an offline search for the secret.
        self._public_key = store.key_secret or store.hash_seed.to_bytes(8, "little")
        self.block_size = store.block_size
        self._key_base = xxhash.xxh3_128(seed=store.hash_seed)
        self._key_base.update(store.key_secret)     # never changed after this: threads copy it
        self.entries = {}
        self._writing = {}          # key -> (Event, off, length) while its data is being written
        self.used_bytes = 0         # allocated bytes of all entries (4 KiB granular)
        self.reserved_bytes = 0     # space promised to dirty blocks not yet flushed
        self.hash_limiter = hash_limiter or trio.CapacityLimiter(4)
        self._blocks_written = self._data_bytes_written = 0
        self._dedup_hits = self._corrupt_reads = 0
        self._dedup_verify_reads = self._dedup_collisions = 0
        self._cut = None            # an IndexCut while a checkpoint builds its rows

    # -- keys -------------------------------------------------------------
    def key_of(self, data: Buffer, domain: int = 0) -> bytes:
        h = self._key_base.copy()
        if domain:
            h.update(domain.to_bytes(8, "little"))
        h.update(data)
        return h.digest()

    async def hash(self, data: Buffer, domain: int = 0) -> bytes:
        return await trio.to_thread.run_sync(self.key_of, data, domain, limiter=self.hash_limiter)

    def domain_of(self, uid: int) -> int:
        """The dedup domain of files owned by ``uid``."""
        return self.domains.of(uid)

    def public_id(self, key: bytes) -> bytes:
        """What users see of an internal key: keyed BLAKE2b-128, not invertible without the secret."""
        return hashlib.blake2b(key, key=self._public_key, digest_size=16, person=b"kvfs public id").digest()

    # -- state ------------------------------------------------------------
    def load(self, blocks: list[schema.BlockRow | None], *, consume: bool = False) -> None:
        """Enter the checkpoint's BlockRows (dropped from ``blocks`` as they go with ``consume``)."""
        # msgpack decodes every length and domain into an int object of its own:
        # most blocks have one of a few of each (kvfs/base/sharedints.py). A million
        # blocks at a remount: the few common lengths are kept at hand, domain 0
        # (Python's own) is not looked up, and each entry's slots are set here,
        # as BlockEntry() sets them, without its call (1.1 -> 0.75 s).
        entries, used, sector, new_entry = self.entries, 0, SECTOR, object.__new__
        common_lengths = {}
        for i, row in enumerate(blocks):
            length, key, domain = row.length, row.key, row.domain
            common = common_lengths.get(length)
            if common is None:
                common = shared(length)
                if len(common_lengths) < 64:
                    common_lengths[length] = common
            entry = new_entry(BlockEntry)
            entry.off, entry.length, entry.refs, entry.pins, entry.key = row.off, common, row.refs, 0, key
            entry.domain = shared(domain) if domain else 0
            entries[key] = entry
            used += (common + sector - 1) // sector * sector        # align_up, inline
            if consume:
                blocks[i] = None
        self.used_bytes += used

    def snapshot(self) -> tuple[list[schema.BlockRow], list[tuple[int, int]]]:
        """(BlockRows named by durable contents, extents only RAM knows about), synchronously.

        Extents held only by pins or writes in flight are free as far as the
        checkpoint is concerned: no durable record references them.
        """
        return IndexCut(self).build()

    # -- the journal port (kvfs/schema/port.py): the namespace holds the index as its
    # ``journal``; records and checkpoints go on to the store, references stay here.
    def append_record(self, record: Any) -> None:
        self.store.append(record)

    async def commit(self) -> None:
        await self.store.commit()

    def cut(self) -> tuple[IndexCut, StoreCut]:
        """Cut the index and the store at this instant, for a checkpoint (see IndexCut)."""
        assert self._cut is None, "one checkpoint at a time"
        self._cut = IndexCut(self)
        return self._cut, self.store.cut()

    def list_cut(self, cuts: tuple[IndexCut, StoreCut]) -> None:
        """On the loop, in a later step than ``cut``: list the entries (see IndexCut)."""
        cuts[0].list_entries()

    def end_cut(self) -> None:
        self._cut = None

    async def write_checkpoint(self, cuts: tuple[IndexCut, StoreCut], writer: schema.CheckpointWriter) -> None:
        """Add the cut's blocks to ``writer`` (in a worker thread), after the namespace's part, and write it."""
        index_cut, store_cut = cuts
        try:
            transient = await trio.to_thread.run_sync(index_cut.write, writer, limiter=self.hash_limiter)
        finally:
            self.end_cut()
        try:
            await self.store.write_checkpoint(store_cut, writer, transient)
        finally:
            # Freed off the loop, in pieces: freeing it here held the loop (kvfs/base/gcpolicy.py).
            await release_off_loop(index_cut.entries, index_cut.gone, limiter=self.hash_limiter)

    def checkpoint_capacity(self) -> int:
        return self.store.checkpoint_capacity()

    @property
    def journal_fill(self) -> float:
        return self.store.journal_fill

    def rows(self) -> list[schema.BlockRow]:
        """Every entry as a BlockRow (fsck)."""
        return [schema.BlockRow(key, e.off, e.length, e.refs, e.domain) for key, e in self.entries.items()]

    def block_count(self) -> int:
        return len(self.entries)

    def has_block(self, key: bytes) -> bool:
        """Whether a block is stored under ``key`` (it may be freed meanwhile: ask again after an await)."""
        return key in self.entries

    def extent(self, key: bytes) -> tuple[int, int]:
        e = self.entries[key]
        return e.off, e.length

    def stored_keys(self, keys: Iterable[bytes | None]) -> list[bytes | None]:
        """The index's own object for each key (equal to it); None for None and for a key no block has.

        One call a file: mount asks it for every file's block list."""
        get = self.entries.get
        return [None if (entry := get(key)) is None else entry.key for key in keys]

    def block_ref(self, key: bytes) -> schema.BlockRef:
        """What a content record says about a stored block."""
        e = self.entries[key]
        return schema.BlockRef(key, e.off, e.length, e.domain)

    # -- references -------------------------------------------------------
    def add_ref(self, key: bytes, off: int, length: int, domain: int = 0) -> None:
        """A content record names ``key`` at ``off``; during replay this allocates it."""
        e = self.entries.get(key)
        if e is None:
            self.store.allocate_at(off, length)
            self.entries[key] = e = BlockEntry(off, length, domain=domain, key=key)
            self.used_bytes += align_up(length)
            if self._cut is not None:
                self._cut.made(key, e)
        elif (e.off, e.length, e.domain) != (off, length, domain):
            raise FormatError(f"block {key.hex()} recorded at two extents")
        if self._cut is not None:
            self._cut.preserve(key, e)
        e.refs += 1

    def drop_ref(self, key: bytes) -> None:
        e = self.entries[key]
        if self._cut is not None:
            self._cut.preserve(key, e)
        e.refs -= 1
        self._maybe_free(key, e)

    def pin(self, key: bytes) -> None:
        self.entries[key].pins += 1

    def unpin(self, key: bytes) -> None:
        e = self.entries[key]
        e.pins -= 1
        self._maybe_free(key, e)

    def unreferenced_bytes(self, keys: Iterable[bytes]) -> int:
        """Device bytes of the blocks ``keys`` that no durable content names: only pins keep them."""
        entries = self.entries
        return sum(align_up(e.length) for e in map(entries.get, keys) if e is not None and e.refs <= 0)

    def _maybe_free(self, key, e):
        if e.refs <= 0 and e.pins <= 0:
            if self._cut is not None:
                self._cut.forget(key, e)
            del self.entries[key]
            self.used_bytes -= align_up(e.length)
            self.store.free(e.off, e.length)

    # -- space --------------------------------------------------------------
    def capacity_bytes(self) -> int:
        return self.store.capacity_bytes

    def available_bytes(self) -> int:
        """Bytes that new blocks can still be given: whole free block slots, less reservations.

        Counted in slots rather than free bytes because a block needs one
        contiguous extent (see Allocator): a reservation then guarantees the
        allocation, so a write that returned success never fails its flush
        for want of space.
        """
        return self.store.free_slots() * self.block_size - self.reserved_bytes

    async def reserve(self, nbytes: int) -> None:
        """Promise space to a dirty block, so the writer gets ENOSPC, not a lost flush.

        When frees waiting for a journal commit would make room, this says so
        (SpaceAwaitsCommit): the namespace, which drives commits, commits through its
        journal port (this index, kvfs/schema/port.py) and retries.
        """
        self.store.check_writable()         # fenced (multi-mount protection): refuse at write()
        if self.available_bytes() < nbytes:
            if self.store.pending_free_bytes:
                raise SpaceAwaitsCommit("space is waiting for frees to be committed")
            raise NoSpace("no space left on the kvfs device")
        self.reserved_bytes += nbytes

    def unreserve(self, nbytes: int) -> None:
        self.reserved_bytes -= nbytes

    # -- data ---------------------------------------------------------------
    async def store_block(self, data: Buffer, source: WritableBuffer | None = None, domain: int = 0) -> bytes:
        """Make ``data`` a stored block of dedup ``domain`` and pin it; write it only if it is new.

        ``source``, if given, is a page-aligned buffer that starts with ``data``
        and is zero after it: the device may write from it directly.
        """
        return await self._store_keyed(await self.hash(data, domain), data, source, domain)

    async def store_blocks(self, blocks: Sequence[tuple[Buffer, WritableBuffer | None, int]],
                           hints: Sequence[RunHint | None] | None = None) -> list[bytes | KvfsError]:
        """:meth:`store_block` for each (data, source, domain), with one hashing hand-off and one
        device call for all the new ones: per block, its key or the KvfsError it failed with.

        ``hints``, if given, holds per block a :class:`~kvfs.blockindex.runs.RunHint` (or None): a new block
        goes next to its file's other blocks, so that a reader fetches the file in runs
        of one device call each, and its own placement is filled in before the write.

        Why one call: a small file's flush was three thread hand-offs (hash, write, and their
        wake-ups on the loop) of about 100 us each on a 2-core host, more than the
        rest of its create. Blocks that dedup, that another flush is writing, or
        that repeat one earlier in the batch take the one-at-a-time path.
        """
        keys = await trio.to_thread.run_sync(self._keys_of, blocks, limiter=self.hash_limiter)
        outcomes, fresh, claimed = [None] * len(blocks), [], set()
        for i, ((data, source, domain), key) in enumerate(zip(blocks, keys)):
            if key in self.entries or key in self._writing or key in claimed:
                continue
            try:
                off = self._claim(key, len(data), hints[i] if hints is not None else None)
            except KvfsError as exc:
                outcomes[i] = exc
                continue
            claimed.add(key)
            fresh.append((i, key, off))
        if fresh:
            await self._write_fresh(blocks, fresh, outcomes)
        for i, ((data, source, domain), key) in enumerate(zip(blocks, keys)):
            if outcomes[i] is None:
                try:
                    outcomes[i] = await self._store_keyed(key, data, source, domain)
                except KvfsError as exc:
                    outcomes[i] = exc
        return outcomes

    def _keys_of(self, blocks):
        return [self.key_of(data, domain) for data, _, domain in blocks]

    async def _write_fresh(self, blocks, fresh, outcomes):
        """Write the claimed new blocks in one device call; enter those written (pinned)."""
        writes = [(off, blocks[i][0], blocks[i][1]) for i, _, off in fresh]
        failures = None
        try:
            failures = await self.store.write_extents(writes)
        except KvfsError as exc:                # the whole call failed (a device timeout)
            failures = [exc] * len(fresh)
        finally:
            for (i, key, _), failed in zip(fresh, failures or [True] * len(fresh)):
                self._unclaim(key, failed=failed is not None)
                if failed is not None:
                    outcomes[i] = failed
        for (i, key, off), failed in zip(fresh, failures):
            if failed is None:
                self._enter_written(key, off, len(blocks[i][0]), blocks[i][2])
                outcomes[i] = key

    async def _store_keyed(self, key, data, source, domain):
        while True:
            e = self.entries.get(key)
            if e is not None:
                e.pins += 1                 # held across the verification read too
                try:
                    if e.domain != domain or (self.dedup_verify and not await self._same_bytes(key, e, data)):
                        self._dedup_collisions += 1
                        log.critical("block %s: a dedup hit whose stored bytes differ (a key "
                                     "collision): the write fails with EIO", key.hex())
                        raise DedupCollision(f"block {key.hex()}: content key collision")
                except BaseException:
                    self.unpin(key)
                    raise
                self._dedup_hits += 1
                return key
            writing = self._writing.get(key)
            if writing is None:
                break
            await writing[0].wait()         # same block being written by another flusher
        off = self._claim(key, len(data))
        written = False
        try:
            await self.store.write_extent(off, data, source)
            written = True
        finally:
            self._unclaim(key, failed=not written)
        self._enter_written(key, off, len(data), domain)
        return key

    def extent_off(self, key: bytes) -> int | None:
        """Where stored block ``key`` lies on the device (None if it is not stored): what the
        placement of the blocks beside it in its file goes by (:meth:`store_blocks`)."""
        e = self.entries.get(key)
        return None if e is None else e.off

    def placements(self, keys: Sequence[bytes | None]) -> list[tuple[int, int, bytes, bytes] | None] | None:
        """Per key its (offset, length, key, salt) for a reader outside the index (the native
        read plane verifies with the same key and salt), None for a hole; None if one is not stored."""
        out = []
        for key in keys:
            e = None if key is None else self.entries.get(key)
            if key is not None and e is None:
                return None
            out.append(None if e is None else (e.off, e.length, key, self._check(key, e.length, e.domain).salt))
        return out

    def _claim(self, key, length, hint=None):
        """An extent for a new block, marked as being written (flushes of the same bytes wait).

        With a RunHint, a whole block that cannot go by its neighbours starts a run
        (kvfs/blockindex/runs.py), with room for RUN_WINDOW_BLOCKS of its file's blocks.
        """
        if hint is None:
            off = self.store.allocate(length)
        else:
            follow, lead = run_position(hint, self.block_size)
            off = self.store.allocate(length, follow=follow, lead=lead,
                                      window=RUN_WINDOW_BLOCKS * self.block_size)
            hint.own.at = off
        self._writing[key] = (trio.Event(), off, length)
        return off

    def _unclaim(self, key, failed):
        """The write of a claimed block is over: wake who waits; a failed one's extent goes back."""
        done, off, length = self._writing.pop(key)
        done.set()
        if failed:
            self.store.release_unused(off, length)      # never referenced by anything

    def _enter_written(self, key, off, length, domain):
        crashpoint("block-written")
        self.entries[key] = e = BlockEntry(off, shared(length), pins=1, domain=domain, key=key)
        if self._cut is not None:
            self._cut.made(key, e)
        self.used_bytes += align_up(length)
        self._blocks_written += 1
        self._data_bytes_written += length

    async def _same_bytes(self, key, e, data):
        """dedup_verify=bytes: does the stored block hold exactly ``data``? (A corrupt one does not.)"""
        self._dedup_verify_reads += 1
        stored = await self.store.read_verified(e.off, self._check(key, e.length, e.domain), None, self._key_base)
        if stored is None:
            self._failed_check(key, e.off)
            return False
        return stored == data

    @staticmethod
    def _check(key, length, domain):
        """The plain description of a block that the store's verified reads take."""
        return BlockCheck(length, key, domain.to_bytes(8, "little") if domain else b"")

    def _failed_check(self, key, off):
        """A stored block did not hash to its key: count it, log it, and name the error (EIO)."""
        self._corrupt_reads += 1
        log.error("block %s at device offset %d fails its checksum: returning EIO", key.hex(), off)
        return CorruptBlock(f"block {key.hex()} at offset {off} is corrupt")

    def read_verified_sync(self, key: bytes, off: int, length: int, buf: WritableBuffer | None = None, domain: int = 0) -> memoryview:
        """Read one extent and check it against ``key`` (in a thread, for fsck); CorruptBlock if it fails."""
        data = self.store.read_verified_sync(off, self._check(key, length, domain), buf, self._key_base)
        if data is None:
            raise self._failed_check(key, off)
        return data

    async def read_block(self, key: bytes, buf: WritableBuffer | None = None) -> memoryview:
        """Read and verify one block; a mismatch raises CorruptBlock (EIO), never bad bytes.

        Returns a read-only memoryview (see Device.read_block_sync), filled
        into ``buf`` if one is given.
        """
        e = self.entries[key]
        data = await self.store.read_verified(e.off, self._check(key, e.length, e.domain), buf, self._key_base)
        if data is None:
            raise self._failed_check(key, e.off)
        return data

    def adjacent_runs(self, keys: Iterable[bytes], most: int) -> list[list[bytes]]:
        """``keys`` (stored, distinct) grouped into runs of at most ``most`` whose extents
        follow each other on the device, in device order: each run is one device read."""
        placed = sorted((self.entries[k].off, k) for k in keys if k in self.entries)
        runs, end = [], None
        for off, key in placed:
            if runs and off == end and len(runs[-1]) < most:
                runs[-1].append(key)
            else:
                runs.append([key])
            end = off + align_up(self.entries[key].length)
        return runs

    async def read_run(self, run: Sequence[bytes], bufs: Sequence[WritableBuffer | None]) -> list[memoryview | CorruptBlock]:
        """Read and verify a run from :meth:`adjacent_runs` with one hand-off to a device thread.

        The extents are looked up here, on the event loop, before the hand-off.
        Returns, per block, its verified view or the CorruptBlock it failed with:
        one bad block fails alone, never its neighbours.
        """
        entries = [self.entries[key] for key in run]
        checks = [self._check(key, e.length, e.domain) for key, e in zip(run, entries)]
        views = await self.store.read_run_verified(entries[0].off, checks, bufs, self._key_base)
        return [view if view is not None else self._failed_check(key, e.off)
                for key, e, view in zip(run, entries, views)]

    def statistics(self) -> IndexStatistics:
        return IndexStatistics(len(self.entries), self.used_bytes, self._blocks_written,
                               self._data_bytes_written, self._dedup_hits, self._corrupt_reads,
                               self.reserved_bytes, self._dedup_verify_reads, self._dedup_collisions)
