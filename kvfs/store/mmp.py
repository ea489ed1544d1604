"""Multi-mount protection (MMP): one writer at a time for a store that several hosts can see.

An NVMe-oF namespace may be attached to many hosts, and the ``flock`` that
Device.open takes only protects against a second mount on the same host. As in
ext4's MMP, the store's MMP sector (``sb.mmp_off``, format version 2) holds a
record of its owner (``schema.MmpRecord``): host, pid, mount time, and a
sequence number that the owner advances every heartbeat interval.

Mounting (:func:`claim`):

1. Read the record. All zero (fresh mkfs) or CLEAN (the last owner unmounted):
   go to 3.
2. IN_USE: the owner is alive if its record changes while we watch it for the
   grace period (:func:`grace_period` of the *owner's* interval: 3 intervals
   plus a margin). Hosts' clocks may differ, so liveness is judged by watching
   the record, never by comparing its timestamps with ours. A live owner: refuse
   (Busy) with a message naming it. A record that did not change: the owner
   crashed, take it over (with a warning naming it). Two shortcuts: ``force``
   takes over without watching; a record of this very host whose pid no longer
   runs (a crash here: kill -9, then mount again) is taken over at once.
3. Write our own record (fdatasync), wait :func:`claim_wait` (2 of our
   intervals, or of the previous owner's if longer: a forced-out owner that
   still runs must see our record and fence itself before we load anything)
   and read it back: anything else there means another host claimed the store
   at the same moment, and we refuse. ``force`` does not skip this.

While mounted, :meth:`MmpGuard.heartbeat_sync` reads the record, checks that it
is still exactly ours, and writes it with the sequence advanced. If the record
is not ours (another host took over), the heartbeat cannot be read or written,
or it has not been written for :func:`overdue_limit` (a heartbeat stuck in a
path loss: another host may soon take over), the store fences its device:
nothing more is written (kvfs.store).
A clean unmount writes the record back as CLEAN (:meth:`MmpGuard.release_sync`).

Everything here is synchronous: the daemon runs claim before its event loop
starts, and each heartbeat in a device worker thread.
"""
from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import random
import socket
import threading
import time
from typing import Any, Callable, Optional

from .. import schema
from ..device.port import DevicePort
from ..errors import Busy, FormatError

log = logging.getLogger(__name__)

DEFAULT_INTERVAL = 1.0          # seconds between heartbeats (mount option mmp_interval=)
MIN_INTERVAL = 0.05
MAX_INTERVAL = 60.0
# Test hook, like KVFS_TEST_FAULTS: pretend to be another host (two "hosts" on one machine).
HOST_ID_ENV = "KVFS_TEST_HOST_ID"
MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id")


def interval_for(io_retry: float) -> float:
    """The default heartbeat interval: long enough that a path loss the device rides
    out (``io_retry`` seconds of retries) does not fence the owner first, since the
    owner fences itself after ``overdue_limit`` = 4 intervals + 2.5 s without a
    heartbeat. io_retry 10 (the default) gives 2.5 s: a mount claims in 5 s and a
    crashed owner is taken over after 13 s. Never below DEFAULT_INTERVAL."""
    return max(DEFAULT_INTERVAL, min(MAX_INTERVAL, io_retry / 4))


def grace_period(interval: float) -> float:
    """How long a record must stay unchanged before its owner counts as dead:
    3 heartbeat intervals, plus a margin of one more and 3 s for a loaded owner
    whose heartbeat runs late (a busy disk delays a 4 KiB write by seconds; the
    margin is absolute because such hiccups do not scale with the interval)."""
    return 4 * interval + 3.0


def overdue_limit(interval: float) -> float:
    """How old the owner's last heartbeat may get before it fences itself: another host
    may take over once the record has stood still for a grace period, and the owner
    must have stopped writing by then (with half a second to spare)."""
    return grace_period(interval) - 0.5


def claim_wait(interval: float) -> float:
    """How long a claim waits before reading its record back (ext4 waits about as long)."""
    return 2 * interval


def this_host_id() -> str:
    """This host's id: $KVFS_TEST_HOST_ID (tests), else /etc/machine-id, else the hostname."""
    forced = os.environ.get(HOST_ID_ENV)
    if forced:
        return forced[:32]
    for path in MACHINE_ID_FILES:
        try:
            with open(path) as f:
                text = f.read().strip()
            if text:
                return text[:32]
        except OSError:
            pass
    return socket.gethostname()[:32]


@dataclasses.dataclass
class MmpSettings:
    """What a mount (or fsck) claims the store with."""

    interval: float = DEFAULT_INTERVAL
    force: bool = False                 # take over a record in use without watching it
    program: str = "mount.kvfs"
    host_id: str = dataclasses.field(default_factory=this_host_id)
    hostname: str = dataclasses.field(default_factory=socket.gethostname)
    # The bytes of a record that a probe watched go stale. mount.kvfs probes
    # before it forks the daemon, which inherits this: finding the very same
    # bytes, the daemon's claim need not watch them for a second grace period.
    seen_stale: Optional[bytes] = None
    sleep: Callable[[float], None] = time.sleep     # unit tests pass their own clock
    clock: Callable[[], float] = time.monotonic


def describe(record: Optional[schema.MmpRecord]) -> str:
    """The owner in words: host, id, pid, program, mount time, heartbeat."""
    if record is None:
        return "nobody (never claimed)"
    when = datetime.datetime.fromtimestamp(record.mount_ns / 1e9, datetime.timezone.utc)
    return (f"host {record.hostname or '?'} (host id {record.host_id or '?'}), pid {record.pid} "
            f"({record.program or '?'}), mounted {when:%Y-%m-%d %H:%M:%S} UTC, heartbeat sequence "
            f"{record.seq} every {record.interval_s:g} s")


def read_record(device: DevicePort, sb: schema.Superblock
                ) -> tuple[bytes, Optional[schema.MmpRecord], Optional[FormatError]]:
    """(raw sector, record or None, FormatError or None) of the MMP sector."""
    raw = bytes(device.pread_sync(sb.mmp_off, schema.SECTOR))
    try:
        return raw, schema.MmpRecord.decode(raw, sb.hash_seed), None
    except FormatError as exc:
        return raw, None, exc


def _pid_running(pid):
    """Whether ``pid`` runs on this host; a zombie (killed, not yet reaped) does not."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _same_host(record, settings):
    # Both must match: cloned machines sometimes share a machine-id.
    return record.host_id == settings.host_id and record.hostname == settings.hostname


@dataclasses.dataclass
class Verdict:
    """What probing found: ``how`` the store may be claimed, and the record that was there."""

    how: str            # "free", "stale", "forced" or "crashed here"
    record: Optional[schema.MmpRecord]  # None: never claimed, or damaged
    damage: Optional[str] = None  # why the sector did not decode, if it did not

    def takeover(self) -> Optional[str]:
        """A warning's text if claiming takes an owner's place, else None."""
        if self.how == "free":
            return None
        owner = describe(self.record) if self.record else f"an unknown owner ({self.damage})"
        why = {"stale": "its heartbeat stopped", "forced": "force was given",
               "crashed here": "its process no longer runs on this host"}[self.how]
        return f"taking over from {owner}: {why}"


def probe(device: DevicePort, sb: schema.Superblock, settings: MmpSettings) -> Verdict:
    """Decide whether the store may be claimed now; raise Busy naming a live owner.

    Watching an IN_USE record takes up to a grace period; nothing is written.
    """
    raw, record, damage = read_record(device, sb)
    if damage is None and (record is None or record.state == schema.MMP_CLEAN):
        return Verdict("free", record)
    if settings.force:
        return Verdict("forced", record, damage and str(damage))
    if settings.seen_stale == raw:
        return Verdict("stale", record, damage and str(damage))
    if record is not None and _same_host(record, settings) and not _pid_running(record.pid):
        return Verdict("crashed here", record)
    # A damaged record is an owner we cannot read: watch it as one with a long interval.
    interval = record.interval_s if record else max(settings.interval, DEFAULT_INTERVAL)
    grace = grace_period(interval)
    deadline = settings.clock() + grace
    while True:
        left = deadline - settings.clock()
        if left <= 0:
            break
        settings.sleep(min(interval / 2, left))
        now_raw, now_record, now_damage = read_record(device, sb)
        if now_raw == raw:
            continue
        if now_damage is None and (now_record is None or now_record.state == schema.MMP_CLEAN):
            return Verdict("free", now_record)          # the owner unmounted while we watched
        owner = now_record or record
        raise Busy(f"{device.path}: the store is in use (multi-mount protection): owner "
                   f"{describe(owner) if owner else 'unknown'}; its heartbeat is alive (the record "
                   f"changed while we watched). Unmount it on that host first. If that host is down, "
                   f"its record goes stale: a mount takes the store over by itself once the heartbeat "
                   f"has stopped for {grace_period(owner.interval_s if owner else interval):.1f} s; "
                   f"--force (mount option force) takes over at once, but only use it when you are "
                   f"sure the owner no longer writes to the device")
    settings.seen_stale = raw
    return Verdict("stale", record, damage and str(damage))


def _new_record(settings, state=schema.MMP_IN_USE):
    now = time.time_ns()
    return schema.MmpRecord(state=state, interval_ms=max(1, round(settings.interval * 1000)),
                            seq=random.getrandbits(32), claim_id=random.getrandbits(64),
                            pid=os.getpid(), mount_ns=now, heartbeat_ns=now, host_id=settings.host_id,
                            hostname=settings.hostname, program=settings.program)


def claim(device: DevicePort, sb: schema.Superblock, settings: MmpSettings) -> MmpGuard:
    """Probe, then write our record, wait, and make sure it is still ours. Returns an MmpGuard."""
    verdict = probe(device, sb, settings)
    warning = verdict.takeover()
    if warning:
        log.warning("%s: multi-mount protection: %s", device.path, warning)
    mine = _new_record(settings)
    encoded = mine.encode(sb.hash_seed)
    started = time.monotonic()
    device.pwrite_sync(sb.mmp_off, encoded)
    device.sync_sync()
    guard = MmpGuard(device, sb, mine, encoded, settings, started)
    # Taking over from a (forced) owner that may still run: wait long enough for
    # its next heartbeat to see our record and fence itself, whatever its interval.
    # Meanwhile heartbeat as usual: each heartbeat first checks the record is
    # still ours, and a third host must not see it stand still.
    previous = verdict.record.interval_s if verdict.how == "forced" and verdict.record else 0
    left = claim_wait(max(settings.interval, previous))
    try:
        while left > 0:
            step = min(settings.interval, left)
            settings.sleep(step)
            left -= step
            if left > 0:
                guard.heartbeat_sync()
            else:
                guard.check_still_ours()
    except Busy:
        raw, record, damage = read_record(device, sb)
        owner = describe(record) if record else f"an unreadable record ({damage})"
        raise Busy(f"{device.path}: another host claimed the store at the same time (multi-mount "
                   f"protection): {owner}. Mount it on one host only") from None
    return guard


class MmpGuard:
    """The claimed MMP record of a mounted store: heartbeats and the release."""

    def __init__(self, device: DevicePort, sb: schema.Superblock, record: schema.MmpRecord, encoded: bytes,
                 settings: MmpSettings, written: float) -> None:
        self.device = device
        self.sb = sb
        self.record = record
        self._encoded = encoded
        self.interval = settings.interval
        self.heartbeats = 0
        self.last_heartbeat = written           # time.monotonic() when the last write of our record began
        self._thread: Optional[threading.Thread] = None
        self._stop: Optional[threading.Event] = None
        self._failure: Optional[Exception] = None

    # Between the claim and the daemon's heartbeat task (loading, replay), and for
    # fsck --repair, a plain thread keeps the heartbeat going.
    def start_background(self) -> None:
        self._stop, self._failure = threading.Event(), None
        self._thread = threading.Thread(target=self._background, name="kvfs-mmp-heartbeat", daemon=True)
        self._thread.start()

    def _background(self):
        while not self._stop.wait(self.interval):
            try:
                self.heartbeat_sync()
            except Exception as exc:  # noqa: BLE001 - handed to stop_background's caller
                self._failure = exc
                return

    def stop_background(self, quiet: bool = False) -> None:
        """Stop the thread; raise what made it stop early, if anything (unless ``quiet``)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        failure, self._failure = self._failure, None
        if failure is not None and not quiet:
            raise failure

    def check_still_ours(self) -> None:
        raw, record, damage = read_record(self.device, self.sb)
        if raw != self._encoded:
            owner = describe(record) if record else f"an unreadable record ({damage})"
            raise Busy(f"another host took the store over (multi-mount protection): the record now "
                       f"says {owner}")

    def _write(self, record, sync):
        encoded = record.encode(self.sb.hash_seed)
        self.device.pwrite_sync(self.sb.mmp_off, encoded)
        if sync:
            self.device.sync_sync()
        self.record, self._encoded = record, encoded

    def heartbeat_sync(self) -> None:
        """One heartbeat (worker thread): check the record is ours, advance its sequence.

        With O_DIRECT the write reaches the device itself, which every host reads;
        buffered (a device that refuses O_DIRECT) it needs an fdatasync first.
        """
        self.check_still_ours()
        started = time.monotonic()          # a host watching may have seen the old record until now
        self._write(self.record.replace(seq=(self.record.seq + 1) % (1 << 64), heartbeat_ns=time.time_ns()),
                    sync=not self.device.direct_io)
        self.heartbeats += 1
        self.last_heartbeat = started

    def release_sync(self) -> None:
        """Clean unmount: mark the record CLEAN (it keeps naming its last owner)."""
        self.check_still_ours()
        self._write(self.record.replace(state=schema.MMP_CLEAN, seq=(self.record.seq + 1) % (1 << 64),
                                        heartbeat_ns=time.time_ns()), sync=True)

    def heartbeat_age(self) -> float:
        """Seconds since our record was last written."""
        return time.monotonic() - self.last_heartbeat

    def statistics(self) -> dict[str, Any]:
        return {"mmp_owner": describe(self.record), "mmp_seq": self.record.seq,
                "mmp_interval_s": self.interval, "mmp_heartbeats": self.heartbeats,
                "mmp_heartbeat_age_s": round(self.heartbeat_age(), 3)}
