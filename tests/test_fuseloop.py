"""The daemon's wait for the next FUSE request (kvfs/fuse/loop.py), through a real mount.

Every mounted test runs its requests through it; this one checks that
concurrent requests are taken from the queue without parking in epoll, that
``request_poll=off`` leaves pyfuse3's own wait in place, and that the daemon
still unmounts cleanly either way (fsck at the end, by the fixture).
"""
import os

import pytest

from threads import run_in_threads

LOOKUPS_PER_THREAD = 2000


def miss_lookups(directory, threads=4):
    """Stat names that do not exist, from several threads: each is a LOOKUP the kernel cannot answer."""
    def work(t):
        for i in range(LOOKUPS_PER_THREAD):
            try:
                os.stat(directory / f"absent-{t}-{i}")
            except FileNotFoundError:
                continue
            raise AssertionError("an absent name was found")

    run_in_threads(work, range(threads))            # re-raises a worker's failure here
    return threads * LOOKUPS_PER_THREAD


@pytest.mark.parametrize("poll", ["on", "off"])
def test_queued_requests_are_taken_without_an_epoll_wait(kvfs_factory, poll):
    fs = kvfs_factory(mount_options=[f"request_poll={poll}"])
    fs.mkfs()
    fs.mount()
    before = fs.stats()
    lookups = miss_lookups(fs.mnt)
    stats = fs.stats()
    if poll == "off":
        assert not {"fuse_waits_queued", "fuse_waits_idle", "fuse_waits_unlocked"} & set(stats), stats
    else:
        waits = sum(stats[k] - before[k] for k in ("fuse_waits_queued", "fuse_waits_idle"))
        assert waits >= lookups, (waits, lookups)           # one wait per request at least
        # Four threads queue requests faster than one at a time: some waits find one
        # queued and take it without parking (how many depends on the machine).
        assert stats["fuse_waits_queued"] - before["fuse_waits_queued"] > 0, stats
        # and most of those skip the lock's trio checkpoint (all but one in SKIPS + 1 at most)
        unlocked = stats["fuse_waits_unlocked"] - before["fuse_waits_unlocked"]
        assert 0 < unlocked <= stats["fuse_waits_queued"] - before["fuse_waits_queued"], stats
    fs.remount()                                             # a clean unmount, and a mount again
    assert miss_lookups(fs.mnt, threads=1)
