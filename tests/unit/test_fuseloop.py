"""RequestWait (kvfs/fuse/loop.py): pyfuse3's wait for the next request, in-process.

The "connection" is a pipe: poll() and trio's epoll treat its read end as they
treat /dev/fuse (readable while something is queued). Mounted, every test of
the suite runs its requests through the real one; tests/test_fuseloop.py checks
its statistics there.
"""
import os
import random

import pyfuse3
import pytest
import trio
import trio.testing

from kvfs.fuse.loop import PYFUSE3_VERSIONS, SKIPS_BETWEEN_CHECKPOINTS, RequestWait


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
    assert (s.fuse_waits_queued, s.fuse_waits_idle, s.fuse_waits_unlocked) == (1, 0, 1)


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
    """A loop that always finds a request queued must not starve the tasks that
    finish earlier requests: most waits skip the lock's checkpoint, but never
    more than SKIPS_BETWEEN_CHECKPOINTS in a row."""
    r, w = pipe
    wait = RequestWait(r)
    os.write(w, b"many requests queued")
    ticks = []

    async def other():
        while True:
            ticks.append(None)
            await trio.sleep(0)

    ticks_at_each_wait = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(other)
        for _ in range(90):
            assert await wait.wait() is True       # the pipe stays readable: never parks
            ticks_at_each_wait.append(len(ticks))
        nursery.cancel_scope.cancel()
    s = wait.statistics()
    assert s.fuse_waits_idle == 0 and s.fuse_waits_queued == 90
    assert s.fuse_waits_unlocked == 90 * SKIPS_BETWEEN_CHECKPOINTS // (SKIPS_BETWEEN_CHECKPOINTS + 1)
    # Every SKIPS_BETWEEN_CHECKPOINTS + 1 waits, the loop went through trio's
    # scheduler once, and the other task ran in each of those batches. trio
    # shuffles the order within a batch, so one wait may see the tick of the batch
    # it resumed in and the next none: any two such spans hold a tick.
    span = 2 * (SKIPS_BETWEEN_CHECKPOINTS + 1)
    assert ticks_at_each_wait[-1] >= 90 // span
    for start in range(0, 90 - span):
        assert ticks_at_each_wait[start + span] > ticks_at_each_wait[start], (start, ticks_at_each_wait)


@pytest.mark.parametrize("seed", range(6))
async def test_no_wait_says_a_request_is_queued_when_another_task_took_it(pipe, seed):
    """Request tasks as pyfuse3 runs them: wait, then read one request at once (no
    await between), then a handler that awaits or not. A producer queues requests
    in bursts, and sometimes lets every task block, so that one parks in trio's
    I/O wait and is woken while others keep taking requests without the lock.
    Every read must find a request: the read end is non-blocking here, and an
    EAGAIN would be, in the daemon, a blocking read of /dev/fuse that stalls the
    whole loop (the hazard of a wait that skips the lock while a task parked in
    wait_readable has been woken for the one request queued)."""
    r, w = pipe
    os.set_blocking(r, False)
    wait = RequestWait(r)
    rng = random.Random(seed)
    taken = []

    async def request_task():
        while await wait.wait():
            taken.append(os.read(r, 1))             # BlockingIOError: nothing was queued
            for _ in range(rng.randrange(3)):
                await trio.sleep(0)

    sent = 0
    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(request_task)
        for _ in range(400):
            burst = rng.randrange(1, 12)
            os.write(w, b"x" * burst)
            sent += burst
            for _ in range(rng.randrange(0, 12)):
                await trio.sleep(0)
            if rng.random() < 0.3:
                await trio.testing.wait_all_tasks_blocked()     # all taken: one parks
        while len(taken) < sent:
            await trio.testing.wait_all_tasks_blocked()
        wait.stopping = True
        trio.lowlevel.notify_closing(r)
    assert len(taken) == sent
    s = wait.statistics()
    assert s.fuse_waits_idle > 50 and s.fuse_waits_unlocked > 500, s
    assert s.fuse_waits_queued > s.fuse_waits_unlocked, s     # some queued waits took the lock


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
