"""The RADOS backend of the shared tier against a real cluster (tests/ceph_cluster.py):
exclusive create as dedup, get/exists/delete, tenants confined to their RADOS
namespace by cephx, and an unreachable cluster answering within the deadline."""
import os
import subprocess
import time

import pytest
import trio

from ceph_cluster import ceph  # noqa: F401  (the session's cluster)
from kvfs.tier.backend import TierDenied, TierTimeout, TierUnavailable
from kvfs.tier.rados import RadosBackend


def backend_for(ceph, tenant, *, namespace=None, deadline=2.0, mon_host=None, **options):
    ceph_id, keyring = ceph.add_tenant(tenant)
    conf = ceph.client_conf(ceph_id, keyring, mon_host=mon_host)
    return RadosBackend(conf=str(conf), ceph_id=ceph_id, pool="kvpool", namespace=namespace or tenant,
                        deadline=deadline, **options)


def test_cluster_starts_quickly(ceph):
    print(f"cluster start: {ceph.started_s:.1f} s")
    assert ceph.started_s < 60
    assert ceph.mon.poll() is None and all(p.poll() is None for p in ceph.osds.values())


def test_the_cluster_bridge_keeps_its_mac_as_hosts_come(ceph):
    """Left to itself a bridge takes its lowest port MAC, so a new host could change it
    and cut off every client that had resolved the mon (tests/ceph_cluster.py)."""
    def bridge_mac():
        return subprocess.run(["ip", "netns", "exec", ceph.netns, "cat", f"/sys/class/net/{ceph.bridge}/address"],
                              capture_output=True, text=True, check=True).stdout.strip()
    before = bridge_mac()
    for i in range(6):      # random port MACs: with a chosen MAC, 6 in 7 runs would change it
        ceph.add_host(f"mac{i}")
    assert bridge_mac() == before


def test_put_if_absent_get_exists_delete(ceph):
    async def main():
        b = backend_for(ceph, "t1")
        await b.connect()
        try:
            name, data = f"bx{os.getpid()}-{time.time_ns()}", os.urandom(3 << 20)
            assert not await b.exists(name)
            assert await b.get(name, 4 << 20) is None
            assert await b.put_if_absent(name, data) is True
            assert await b.put_if_absent(name, b"other bytes") is False      # EEXIST: a dedup hit
            assert await b.get(name, 4 << 20) == data                          # the first put's bytes
            got = await b.get(name, 1 << 20)
            assert len(got) == (1 << 20) + 1                                    # too long shows as too long
            assert await b.exists(name)
            assert await b.delete(name) is True
            assert not await b.exists(name)
            assert await b.delete(name) is False
        finally:
            b.close()
    trio.run(main)


def test_another_tenant_is_refused_by_the_cluster(ceph):
    async def main():
        ours = backend_for(ceph, "t1")
        theirs = backend_for(ceph, "t2", namespace="t1")      # t2's cephx user, aimed at t1's namespace
        await ours.connect()
        await theirs.connect()
        try:
            name = f"bsecret{time.time_ns()}"
            assert await ours.put_if_absent(name, b"t1's bytes")
            for call, args in ((theirs.get, (name, 100)), (theirs.exists, (name,)),
                               (theirs.put_if_absent, (name, b"x")), (theirs.delete, (name,)),
                               (theirs.exists, ("bno-such-object",))):
                with pytest.raises(TierDenied):
                    await call(*args)
            assert await ours.get(name, 100) == b"t1's bytes"
        finally:
            ours.close()
            theirs.close()
    trio.run(main)


def test_unreachable_mon_fails_connect_within_its_timeout(ceph):
    async def main():
        b = backend_for(ceph, "t1", mon_host=f"{ceph.subnet}.253:6789", connect_timeout=1.0)   # nobody there
        t0 = time.monotonic()
        with pytest.raises(TierUnavailable, match="cannot reach the Ceph cluster"):
            await b.connect()
        took = time.monotonic() - t0
        print(f"connect to an unreachable mon failed after {took:.1f} s")
        assert took < 1.0 + 3 + 2          # the timeout, the backstop's 3 s, and slack
        with pytest.raises(TierUnavailable):
            await b.get("bx", 10)             # not connected: at once
    trio.run(main)


def test_stopped_osds_answer_within_the_deadline(ceph):
    async def main():
        b = backend_for(ceph, "t1", deadline=1.0)
        await b.connect()
        name = f"bfrozen{time.time_ns()}"
        assert await b.put_if_absent(name, b"before")
        ceph.pause_osds()
        try:
            for call, args in ((b.get, (name, 100)), (b.put_if_absent, (name + "x", b"y")), (b.exists, (name,))):
                t0 = time.monotonic()
                with pytest.raises(TierTimeout):
                    await call(*args)
                took = time.monotonic() - t0
                assert took < 1.0 + 1.5, took
        finally:
            ceph.resume_osds()
        try:
            with trio.fail_after(30):
                while True:
                    try:
                        assert await b.get(name, 100) == b"before"
                        break
                    except TierTimeout:
                        pass
        finally:
            b.close()
    trio.run(main)
