"""RequestWait (kvfs/fuseloop.py): pyfuse3's wait for the next request, in-process.

The "connection" is a pipe: poll() and trio's epoll treat its read end as they
treat /dev/fuse (readable while something is queued). Mounted, every test of
the suite runs its requests through the real one; tests/test_fuseloop.py checks
its statistics there.
"""
import os

import pyfuse3
import pytest
import trio
import trio.testing

from kvfs.fuseloop import PYFUSE3_VERSIONS, RequestWait


async def answer_into(answers, wait):
    answers.append(await wait.wait())


@pytest.fixture
def pipe():
    r, w = os.pipe()
    yield r, w
    os.close(r)
    os.close(w)


async def test_a_queued_request_is_taken_without_parking(pipe):
    r, w = pipe
    wait = RequestWait(r)
    os.write(w, b"request")
    assert await wait.wait() is True
    s = wait.statistics()
    assert (s.fuse_waits_queued, s.fuse_waits_idle) == (1, 0)


async def test_with_nothing_queued_it_parks_until_a_request_comes(pipe):
    r, w = pipe
    wait = RequestWait(r)
    answers = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer_into, answers, wait)
        await trio.testing.wait_all_tasks_blocked()
        assert answers == []                       # parked: nothing to read
        os.write(w, b"request")
    assert answers == [True]
    s = wait.statistics()
    assert (s.fuse_waits_queued, s.fuse_waits_idle) == (0, 1)


async def test_other_tasks_run_while_requests_keep_coming(pipe):
    """Taking the lock is a checkpoint: a loop that always finds a request queued
    must not starve the tasks that finish earlier requests."""
    r, w = pipe
    wait = RequestWait(r)
    os.write(w, b"many requests queued")
    ticks = []

    async def other():
        while True:
            ticks.append(None)
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        for _ in range(50):
            assert await wait.wait() is True       # the pipe stays readable: never parks
        nursery.cancel_scope.cancel()
    assert wait.statistics().fuse_waits_idle == 0
    assert len(ticks) >= 40, len(ticks)


async def test_a_stopped_session_ends_parked_and_later_waits(pipe):
    r, w = pipe
    wait = RequestWait(r)
    answers = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer_into, answers, wait)
        nursery.start_soon(answer_into, answers, wait)   # queued behind the first, on the lock
        await trio.testing.wait_all_tasks_blocked()
        # What RequestWait.terminate() does, without a FUSE session to end:
        # pyfuse3.terminate() is fuse_session_exit plus notify_closing of the fd.
        wait.stopping = True
        trio.lowlevel.notify_closing(r)
    assert answers == [False, False]
    os.write(w, b"late request")
    assert await wait.wait() is False              # even with a request queued


def test_install_replaces_pyfuse3s_wait_only_for_a_known_version(pipe, monkeypatch):
    monkeypatch.setattr(pyfuse3, "_wait_fuse_readable", pyfuse3._wait_fuse_readable)  # restored after
    monkeypatch.setattr(pyfuse3, "__version__", "0.0-unknown")
    assert RequestWait.install(pipe[0]) is None
    monkeypatch.setattr(pyfuse3, "__version__", PYFUSE3_VERSIONS[0])
    wait = RequestWait.install(pipe[0])
    assert wait is not None and pyfuse3._wait_fuse_readable == wait.wait
