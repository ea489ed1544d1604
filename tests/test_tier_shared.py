"""SharedTier (kvfs/tier/shared.py) against the real cluster: publish, fetch verified,
tenants apart, a poisoned object never served, the queue bounded, the deadline kept."""
import os
import time

import pytest
import trio

from ceph_cluster import ceph  # noqa: F401  (the session's cluster)
from kvfs.tier.names import TenantNames
from kvfs.tier.rados import RadosBackend, load_rados
from kvfs.tier.shared import SharedTier


_backends = []


@pytest.fixture(autouse=True)
def close_backends():
    """Every connection a test made is closed after it: librados aborts the process at
    exit while a connection is open."""
    yield
    while _backends:
        _backends.pop().close()


def make(ceph, tenant, secret, *, deadline=3.0, queue=16, block=1 << 20, **backend_options):
    ceph_id, keyring = ceph.add_tenant(tenant)
    conf = ceph.client_conf(ceph_id, keyring)
    backend = RadosBackend(conf=str(conf), ceph_id=ceph_id, pool="kvpool", namespace=tenant, deadline=deadline,
                           **backend_options)
    _backends.append(backend)
    return SharedTier(backend, TenantNames(tenant, secret), deadline=deadline, queue=queue, miss_ttl=0.3,
                      block_size=block)


async def running(tier, nursery):
    await tier.connect_at_mount()
    await nursery.start(tier.run)


def joined(fetched):
    """(content, mode) of a fetch's (blocks, mode), after checking that every block but the
    last is one tier block long, as the namespace writes them at offset i * block size."""
    blocks, mode = fetched
    assert all(len(b) == 1 << 20 for b in blocks[:-1]) and 0 < len(blocks[-1]) <= 1 << 20
    return b"".join(blocks), mode


def reader(path, data, mode=0o644):
    async def read():
        return path, mode, data
    return read


async def published(tier, files, timeout=20):
    with trio.fail_after(timeout):
        while tier.statistics().tier_published_files < files:
            await trio.sleep(0.02)


def test_publish_fetch_dedup_and_tenants(ceph):
    async def main():
        async with trio.open_nursery() as nursery:
            a = make(ceph, "t1", b"A" * 32)
            a2 = make(ceph, "t1", b"A" * 32)           # the tenant's second host
            b = make(ceph, "t2", b"B" * 32)            # another tenant
            for t in (a, a2, b):
                await running(t, nursery)
            path, data = f"/m/{time.time_ns()}".encode(), os.urandom((3 << 20) + 123)
            assert await a2.fetch(path) is None          # not there yet
            assert a.offer(reader(path, data))
            await published(a, 1)
            s = a.statistics()
            assert (s.tier_published_blocks, s.tier_published_bytes) == (4, len(data))
            await trio.sleep(0.35)                       # a2's remembered miss expires
            assert joined(await a2.fetch(path)) == (data, 0o644)
            assert a2.statistics().tier_fetched_bytes == len(data)
            assert await b.fetch(path) is None           # another tenant: nothing
            s = b.statistics()
            assert (s.tier_hits, s.tier_verify_failures, s.tier_errors) == (0, 0, 0)
            # The same bytes under another path from the second host: every block a dedup hit.
            assert a2.offer(reader(path + b".copy", data))
            await published(a2, 1)
            s = a2.statistics()
            assert (s.tier_publish_dedup_blocks, s.tier_published_blocks) == (4, 0)
            nursery.cancel_scope.cancel()
        for t in (a, a2, b):
            t.backend.close()
    trio.run(main)


def test_a_poisoned_block_is_never_served_and_is_quarantined(ceph):
    async def main():
        async with trio.open_nursery() as nursery:
            a = make(ceph, "t1", b"P" * 32)
            await running(a, nursery)
            path, data = f"/p/{time.time_ns()}".encode(), os.urandom(2 << 20)
            a.offer(reader(path, data))
            await published(a, 1)
            names = a.names.block_names(data, 1 << 20)
            # Wrong bytes under a valid name, written with the tenant's own credentials
            # straight to RADOS (not through kvfs).
            rados = load_rados()
            ceph_id, keyring = ceph.add_tenant("t1")
            cluster = rados.Rados(conffile=str(ceph.client_conf(ceph_id, keyring)), rados_id=ceph_id)
            cluster.connect(timeout=5)
            ioctx = cluster.open_ioctx("kvpool")
            ioctx.set_namespace("t1")
            poison = bytearray(data[1 << 20:])
            poison[5] ^= 1
            ioctx.write_full(names[1], bytes(poison))
            fresh = make(ceph, "t1", b"P" * 32)
            await running(fresh, nursery)
            assert await fresh.fetch(path) is None
            s = fresh.statistics()
            assert (s.tier_verify_failures, s.tier_quarantined, s.tier_hits, s.tier_misses) == (1, 1, 0, 1)
            with trio.fail_after(10):                   # moved aside in the background
                while True:
                    try:
                        ioctx.stat(names[1])
                    except rados.ObjectNotFound:
                        break
                    await trio.sleep(0.05)
            assert ioctx.read("q" + names[1], 4 << 20) == bytes(poison)
            # A forged manifest (right name, no MAC made with the secret) is a miss too.
            ioctx.write_full(a.names.manifest_name(b"/forged"), b'{"v":1}\n' + b"0" * 64)
            assert await fresh.fetch(b"/forged") is None
            assert fresh.statistics().tier_verify_failures == 2
            # The honest publisher puts the block back; then the file is served again.
            a.offer(reader(path + b".again", data))
            await published(a, 2)
            await trio.sleep(0.35)
            assert joined(await fresh.fetch(path)) == (data, 0o644)
            ioctx.close()
            cluster.shutdown()
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_a_file_offered_before_the_first_connection_is_published_once_there_is_one(ceph):
    """The mon does not answer at the mount: offers wait in the queue without spending their
    tries, and go out when a later try connects. (They were tried at once, three times a
    second apart, and dropped: a host whose first connection failed never published the
    files closed in its first seconds.)"""
    async def main():
        a = make(ceph, "t1", b"C" * 32, connect_timeout=1, retry_s=1)
        ceph.pause_mon()
        try:
            async with trio.open_nursery() as nursery:
                await running(a, nursery)
                assert a.warned and not a.statistics().tier_connected
                path, data = f"/c/{time.time_ns()}".encode(), os.urandom((1 << 20) + 5)
                assert a.offer(reader(path, data))
                await trio.sleep(4)                 # longer than the three tries took
                s = a.statistics()
                assert (s.tier_connected, s.tier_queue_len, s.tier_publish_errors) == (0, 1, 0)
                ceph.resume_mon()
                await published(a, 1, timeout=30)
                assert a.statistics().tier_published_bytes == len(data)
                nursery.cancel_scope.cancel()
        finally:
            ceph.resume_mon()
    trio.run(main)


def test_queue_is_bounded_and_drops_are_counted(ceph):
    async def main():
        a = make(ceph, "t1", b"Q" * 32, queue=4)        # no workers running: nothing drains
        offered = [a.offer(reader(b"/q/%d" % i, b"x")) for i in range(10)]
        assert offered == [True] * 4 + [False] * 6
        s = a.statistics()
        assert (s.tier_queue_len, s.tier_queue_drops, s.tier_queue_max) == (4, 6, 4)
    trio.run(main)


def test_fetch_answers_within_the_deadline_while_osds_are_stopped(ceph):
    async def main():
        async with trio.open_nursery() as nursery:
            a = make(ceph, "t1", b"D" * 32, deadline=1.0)
            await running(a, nursery)
            path = f"/d/{time.time_ns()}".encode()
            ceph.pause_osds()
            try:
                t0 = time.monotonic()
                assert await a.fetch(path) is None
                took = time.monotonic() - t0
                print(f"fetch with stopped OSDs: miss after {took:.2f} s (deadline 1 s)")
                assert took < 1.5
                assert a.statistics().tier_timeouts >= 1
                t0 = time.monotonic()
                assert await a.fetch(path) is None          # remembered: no cluster call
                assert time.monotonic() - t0 < 0.1
                a.offer(reader(path, b"late"))              # publishing fails and is counted
                with trio.fail_after(15):
                    while not a.statistics().tier_publish_errors:
                        await trio.sleep(0.05)
            finally:
                ceph.resume_osds()
            a.offer(reader(path, b"late"))                  # resumes once the OSDs answer
            await published(a, 1, timeout=40)
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_the_janitor_keeps_the_tenant_under_its_bound_oldest_first(ceph):
    from kvfs.tier.janitor import Janitor

    async def main():
        async with trio.open_nursery() as nursery:
            a = make(ceph, "tj", b"J" * 32)              # a namespace of its own: nothing else in it
            await running(a, nursery)
            files = [(f"/j/{i}".encode(), os.urandom(1 << 20)) for i in range(3)]
            for n, (path, data) in enumerate(files):
                a.offer(reader(path, data))
                await published(a, n + 1)
                await trio.sleep(0.05)
            janitor = Janitor(a.backend, int(2.5 * (1 << 20)))
            assert await janitor.sweep() == 1            # the oldest object, file 0's block, is enough
            assert janitor.stored_bytes <= int(2.5 * (1 << 20) * 0.9)
            assert await janitor.sweep() == 0            # under the bound: nothing more
            fresh = make(ceph, "tj", b"J" * 32)
            await running(fresh, nursery)
            assert await fresh.fetch(files[0][0]) is None            # the oldest is gone
            for path, data in files[1:]:
                assert joined(await fresh.fetch(path)) == (data, 0o644)      # the newer ones stay
            nursery.cancel_scope.cancel()
    trio.run(main)
