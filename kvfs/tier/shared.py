"""The shared tier as the namespace sees it (:class:`kvfs.namespace.port.TierPort`).

Publishing: the namespace offers a file once it is sealed and nobody writes it
(:meth:`SharedTier.offer`, never awaits). Offers wait in a bounded queue; when it
is full the offer is dropped and counted, so ``close()`` never waits for the tier
and a burst of writes costs a fixed amount of memory (the queue holds paths and a
reader, not bytes; ``publish_workers`` files are in RAM at once). While the host
holds no connection (its mount's try failed), offers wait there and spend no try.
A worker reads the file through the namespace, names its blocks (HMAC-SHA-256, in
a worker thread), creates each block object unless it exists (EEXIST: another host of the
tenant published the same bytes, a dedup hit), then the manifest, write-once.

Fetching: a lookup that misses locally asks :meth:`SharedTier.fetch` for the path.
Within ``deadline`` it reads the manifest, checks its MAC, reads the blocks (at
most ``concurrency`` tier calls at once) and recomputes every block's name from its
bytes. Anything that does not verify is a miss, counted, and quarantined: copied
to ``q<name>`` and deleted, so an honest publisher can put the right bytes back.
Misses (and an unreachable cluster) are remembered for ``miss_ttl`` seconds.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import time
from typing import Awaitable, Callable, Optional

import trio

from .backend import TierError, TierUnavailable
from .names import BadManifest, Manifest, TenantNames

log = logging.getLogger(__name__)

TIER_BLOCK = 1 << 20              # bytes per block object: the store's block size (4 MiB writes stalled on memstore)
MAX_MANIFEST = 1 << 20
MAX_PUBLISH_BYTES = 1 << 30       # files larger than this are not published (counted)
MISS_CACHE = 65536                # names remembered as missing, at most
DOWN_BACKOFF = 5.0                # seconds lookups skip a tier that just ran out of time
PUBLISH_TIMEOUT = 10.0            # seconds one publishing call may take (not on anyone's path)
PUBLISH_TRIES = 3                 # a file whose publishing failed is queued again, this often in all
CONNECTED_POLL = 0.5              # seconds a publisher waits before it looks for a connection again


@dataclasses.dataclass
class TierStatistics:
    tier_connected: int = 0
    tier_published_files: int = 0
    tier_published_blocks: int = 0
    tier_published_bytes: int = 0
    tier_publish_dedup_blocks: int = 0      # block objects that existed already (EEXIST)
    tier_publish_errors: int = 0
    tier_publish_skipped: int = 0           # changed, removed or too large before its turn
    tier_queue_len: int = 0
    tier_queue_max: int = 0
    tier_queue_drops: int = 0
    tier_lookups: int = 0                   # local misses that consulted the tier
    tier_hits: int = 0
    tier_misses: int = 0
    tier_misses_cached: int = 0             # of those, answered from the miss cache
    tier_misses_down: int = 0               # of those, answered at once: the tier timed out just before
    tier_fetched_files: int = 0
    tier_fetched_blocks: int = 0
    tier_fetched_bytes: int = 0
    tier_verify_failures: int = 0
    tier_quarantined: int = 0
    tier_timeouts: int = 0
    tier_errors: int = 0
    tier_latency_ms_last: float = 0.0       # one tier call (get or put), last and mean since mount
    tier_latency_ms_mean: float = 0.0
    tier_latency_ms_max: float = 0.0
    tier_lookup_ms_max: float = 0.0         # the longest lookup that consulted the tier
    tier_janitor_sweeps: int = 0            # this host's janitor (tier_capacity=), else all 0
    tier_janitor_deleted: int = 0
    tier_janitor_deleted_bytes: int = 0
    tier_stored_bytes: int = 0              # the tenant's objects at the janitor's last listing


# What the namespace hands over: called when the file's turn comes, it answers the file
# as it is then, (path, mode, content), or None when it changed, went or has no name.
Reader = Callable[[], Awaitable[Optional[tuple[bytes, int, bytes]]]]


class SharedTier:
    def __init__(self, backend, names: TenantNames, *, deadline: float = 2.0, queue: int = 256,
                 miss_ttl: float = 0.5, publish_workers: int = 2, block_size: int = TIER_BLOCK):
        self.backend, self.names = backend, names
        self.deadline, self.miss_ttl = deadline, miss_ttl
        self.queue_limit, self.publish_workers, self.block_size = queue, publish_workers, block_size
        self._queue: collections.deque[Reader] = collections.deque()
        self._queued = trio.Event()
        self._misses: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._inflight: dict[bytes, tuple[trio.Event, list]] = {}
        self._stats = TierStatistics()
        self._latency_sum, self._latency_n = 0.0, 0
        self._nursery = None
        self._down_until = 0.0          # after a timeout, lookups skip the tier until then
        self.janitor = None             # kvfs/tier/janitor.py, on the one host that runs it
        self.warned = False

    # -- the namespace's port -------------------------------------------------------------
    def offer(self, read: Reader) -> bool:
        """Queue a sealed file for publishing; False (counted): the queue is full, dropped."""
        if len(self._queue) >= self.queue_limit:
            self._stats.tier_queue_drops += 1
            return False
        self._queue.append(read)
        self._stats.tier_queue_max = max(self._stats.tier_queue_max, len(self._queue))
        self._queued.set()
        return True

    async def fetch(self, path: bytes) -> Optional[tuple[list[bytes], int]]:
        """(blocks, mode) of ``path`` from the tier, verified; None: a miss. The blocks are
        the content in order, each ``block_size`` long but the last: the caller writes them
        as they are, with no join (a 32 MiB join on the event loop took ~50 ms of it on
        this machine). Returns within ``deadline`` (plus the hashing of what arrived),
        whatever the cluster does."""
        st = self._stats
        st.tier_lookups += 1
        expiry = self._misses.get(path)
        if expiry is not None:
            if expiry > time.monotonic():
                st.tier_misses += 1
                st.tier_misses_cached += 1
                return None
            del self._misses[path]
        if self._down_until > time.monotonic() or not self.backend.connected:
            # Every create is preceded by a lookup of its new name: while the cluster does
            # not answer, those must not each wait for the deadline.
            st.tier_misses += 1
            st.tier_misses_down += 1
            return None
        shared = self._inflight.get(path)
        if shared is not None:                  # another lookup of the same name is fetching
            await shared[0].wait()
            result = shared[1][0]
            if result is None:
                st.tier_misses += 1
            else:
                st.tier_hits += 1
            return result
        done, holder = self._inflight[path] = (trio.Event(), [None])
        t0 = time.monotonic()
        try:
            with trio.move_on_after(self.deadline) as scope:
                holder[0] = await self._fetch(path)
            if scope.cancelled_caught:
                st.tier_timeouts += 1
                self._down_until = time.monotonic() + DOWN_BACKOFF
            if holder[0] is None:
                st.tier_misses += 1
                self._remember_miss(path)
            else:
                st.tier_hits += 1
            return holder[0]
        finally:
            st.tier_lookup_ms_max = round(max(st.tier_lookup_ms_max, (time.monotonic() - t0) * 1000), 3)
            del self._inflight[path]
            done.set()

    def statistics(self) -> TierStatistics:
        self._stats.tier_queue_len = len(self._queue)
        self._stats.tier_connected = int(self.backend.connected)
        j = self.janitor
        if j is not None:
            st = self._stats
            st.tier_janitor_sweeps, st.tier_janitor_deleted = j.sweeps, j.deleted
            st.tier_janitor_deleted_bytes, st.tier_stored_bytes = j.deleted_bytes, j.stored_bytes
        return dataclasses.replace(self._stats)

    # -- fetching -------------------------------------------------------------------------
    def _remember_miss(self, path):
        if self.miss_ttl <= 0:
            return
        self._misses[path] = time.monotonic() + self.miss_ttl
        self._misses.move_to_end(path)
        while len(self._misses) > MISS_CACHE:
            self._misses.popitem(last=False)

    async def _timed(self, call, *args, **kwargs):
        t0 = time.monotonic()
        try:
            return await call(*args, **kwargs)
        finally:
            ms = (time.monotonic() - t0) * 1000
            st = self._stats
            self._latency_sum += ms
            self._latency_n += 1
            st.tier_latency_ms_last = round(ms, 3)
            st.tier_latency_ms_mean = round(self._latency_sum / self._latency_n, 3)
            st.tier_latency_ms_max = round(max(st.tier_latency_ms_max, ms), 3)

    async def _fetch(self, path) -> Optional[tuple[list[bytes], int]]:
        st = self._stats
        if not self.backend.connected:
            return None
        mname = self.names.manifest_name(path)
        try:
            raw = await self._timed(self.backend.get, mname, MAX_MANIFEST)
        except TierError as exc:
            self._count_error(exc)
            return None
        if raw is None:
            return None
        try:
            manifest = self.names.decode_manifest(raw, path)
        except BadManifest as exc:
            log.warning("shared tier: manifest of %r does not verify (%s): quarantined", path, exc)
            st.tier_verify_failures += 1
            self._quarantine(mname, raw)
            return None
        blocks: list[Optional[bytes]] = [None] * len(manifest.blocks)
        failed = []

        async def one(i):
            name = manifest.blocks[i]
            try:
                data = await self._timed(self.backend.get, name, manifest.block_size)
            except TierError as exc:
                self._count_error(exc)
                failed.append(i)
                return
            if data is None:
                failed.append(i)
                return
            # Recompute the name from the bytes before anything uses them.
            good = (len(data) == self.names.block_length(manifest, i) and
                    await trio.to_thread.run_sync(self.names.block_name, data) == name)
            if not good:
                log.warning("shared tier: block %s of %r does not match its name: quarantined", name, path)
                st.tier_verify_failures += 1
                self._quarantine(name, data)
                failed.append(i)
                return
            blocks[i] = data

        async with trio.open_nursery() as nursery:
            for i in range(len(manifest.blocks)):
                nursery.start_soon(one, i)
        if failed:
            return None
        # Each block's length was checked against the manifest, which adds up to its size.
        st.tier_fetched_files += 1
        st.tier_fetched_blocks += len(blocks)
        st.tier_fetched_bytes += manifest.size
        return blocks, manifest.mode

    def _count_error(self, exc):
        if isinstance(exc, TierUnavailable):
            return
        st = self._stats
        if "no answer" in str(exc):
            st.tier_timeouts += 1
            self._down_until = time.monotonic() + DOWN_BACKOFF
        else:
            st.tier_errors += 1
        log.info("shared tier: %s", exc)

    def _quarantine(self, name, data):
        self._stats.tier_quarantined += 1
        if self._nursery is not None:
            self._nursery.start_soon(self._move_to_quarantine, name, data)

    async def _move_to_quarantine(self, name, data):
        """Keep the bad bytes under ``q<name>`` for a look, and delete ``name``."""
        try:
            await self.backend.put_if_absent("q" + name, bytes(data))
            await self.backend.delete(name)
        except TierError as exc:
            log.warning("shared tier: could not quarantine %s: %s", name, exc)

    # -- publishing -----------------------------------------------------------------------
    async def run(self, task_status=trio.TASK_STATUS_IGNORED):
        """Connect (retrying in the background while the cluster is away) and publish."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            nursery.start_soon(self._keep_connected)
            for _ in range(self.publish_workers):
                nursery.start_soon(self._publisher)
            if self.janitor is not None:
                nursery.start_soon(self.janitor.run)

    def close(self) -> None:
        """Disconnect (once no librados call runs: see RadosBackend.close). At unmount."""
        self.backend.close()

    async def connect_at_mount(self) -> None:
        """One try, before the mount: a cluster that cannot be reached is a warning, not an error."""
        try:
            await self.backend.connect()
            log.info("shared tier: connected (tenant %s)", self.names.tenant)
        except TierUnavailable as exc:
            self.warned = True
            log.warning("shared tier unavailable, serving the local store only for now: %s", exc)

    async def _keep_connected(self):
        while True:
            if not self.backend.connected:
                await self.backend.ensure_connected()
            await trio.sleep(1.0)

    async def _publisher(self):
        while True:
            while not self._queue:
                self._queued = trio.Event()
                await self._queued.wait()
            if not self.backend.connected:
                # Wait for the connection with the offer still queued, spending no try: a
                # file closed while the mount's first try failed, or the cluster was away,
                # is published once it is back (the bounded queue drops what does not fit).
                await trio.sleep(CONNECTED_POLL)
                continue
            offer, tries = self._queue.popleft(), 1
            if isinstance(offer, tuple):
                offer, tries = offer
            try:
                await self._publish(offer)
            except TierError as exc:
                self._stats.tier_publish_errors += 1
                log.info("shared tier: publishing failed (try %d of %d): %s", tries, PUBLISH_TRIES, exc)
                await trio.sleep(1.0)
                if tries < PUBLISH_TRIES and len(self._queue) < self.queue_limit:
                    self._queue.append((offer, tries + 1))

    async def _publish(self, read: Reader):
        st = self._stats
        if not self.backend.connected:
            raise TierUnavailable(self.backend.last_error or "not connected")
        got = await read()
        if got is None or len(got[2]) > MAX_PUBLISH_BYTES:
            st.tier_publish_skipped += 1
            return
        path, mode, data = got
        self._misses.pop(path, None)
        bs = self.block_size
        names = await trio.to_thread.run_sync(self.names.block_names, data, bs)
        view = memoryview(data)
        failures = []

        async def put(i, name):
            try:
                created = await self._timed(self.backend.put_if_absent, name, bytes(view[i * bs:(i + 1) * bs]),
                                            timeout=PUBLISH_TIMEOUT)
            except TierError as exc:
                failures.append(exc)
                return
            if created:
                st.tier_published_blocks += 1
                st.tier_published_bytes += min(bs, len(data) - i * bs)
            else:
                st.tier_publish_dedup_blocks += 1

        async with trio.open_nursery() as nursery:
            first = {}
            for i, name in enumerate(names):
                first.setdefault(name, i)
            for name, i in first.items():
                nursery.start_soon(put, i, name)
        if failures:
            raise failures[0]
        manifest = Manifest(path, len(data), bs, tuple(names), mode)
        await self._timed(self.backend.put_if_absent, self.names.manifest_name(path),
                          self.names.encode_manifest(manifest), timeout=PUBLISH_TIMEOUT)
        st.tier_published_files += 1
