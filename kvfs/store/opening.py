"""Opening a store for writing: the load runs while the multi-mount claim waits.

A claim (kvfs/store/mmp.py) writes our record and then waits two heartbeat
intervals (5 s by default) before it checks that the record is still ours; the
load of a large store is seconds of CPU. They ran one after the other, so every
mount paid both. Now the claim waits in a thread while the calling thread loads.

Why loading before the claim holds is safe. Only an owner writes metadata, and an
owner heartbeats: the probe at the start of the claim watches a record in use
and refuses (Busy), and a host claiming at the same moment makes one of the two
claims fail. So when the claim succeeds, no other host wrote metadata while we
loaded, with one exception: an owner forced out (``force``) writes until its next
heartbeat sees our record. With force the claim still comes first. As a second
line, once the claim holds we check that the metadata is as the load saw it:
the superblocks and both checkpoint slot headers byte for byte (a checkpoint
writes its slot's header last), and no valid frame after the journal's end (the
journal only appends, so a new commit starts exactly there). If anything moved,
the store is loaded again, now that it is ours.

The caller may hand over ``prepare``: the rest of its start-up that needs only
what was loaded (the daemon builds its block index and namespace, a million
inodes being most of a remount's CPU). It runs in the loading thread too, so
the claim's wait covers it; what it built is thrown away and built again from
the second load if the metadata moved. It must not write to the device.

A load that fails (a damaged store) fails before the claim has decided, and the
claim's thread is waited for and its record released, as before: a refused mount
leaves the MMP sector as the release writes it (clean), never the data.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, TypeVar

from .. import schema
from ..device.port import DevicePort
from ..errors import KvfsError
from .mmp import MmpGuard, MmpSettings
from .mmp import claim as claim_record
from .mmp import probe as probe_record
from .loader import Loaded
from .loader import load as load_store
from .loader import read_superblock

log = logging.getLogger(__name__)

T = TypeVar("T")


def _fingerprint(device, sb):
    """The bytes a new checkpoint or a superblock rewrite would change."""
    return b"".join(device.pread_sync(off, schema.SECTOR)
                    for off in (0, schema.SECTOR, sb.checkpoint_a_off, sb.checkpoint_b_off))


def release_quietly(guard: MmpGuard) -> None:
    try:
        guard.stop_background(quiet=True)
        guard.release_sync()
    except KvfsError as exc:
        log.warning("could not release the multi-mount protection record (%s): the next mount "
                    "waits for its grace period", exc)


def _claim(device, sb, settings):
    # Heartbeats start the moment the claim holds, however long the load
    # still takes: a record that stands still looks like a crashed owner.
    guard = claim_record(device, sb, settings)
    guard.start_background()
    return guard


def _loaded(loaded):
    return loaded


def claim_and_load(device: DevicePort, sb: schema.Superblock, settings: MmpSettings, *, salvage: bool = False,
                   prepare: Callable[[Loaded], T] = _loaded, stream_inodes: bool = False) -> tuple[T, MmpGuard]:
    """(prepare(Loaded), MmpGuard) of a store this host now owns, its guard heartbeating;
    Busy if another owns it. ``prepare`` runs on the loaded store while the claim waits.
    ``stream_inodes``: see :func:`kvfs.store.loader.load`."""
    def load(device, salvage):
        return load_store(device, salvage=salvage, stream_inodes=stream_inodes)

    if settings.force:
        guard = _claim(device, sb, settings)
        try:
            return prepare(load(device, salvage=salvage)), guard
        except BaseException:
            release_quietly(guard)
            raise
    outcome: dict[str, Any] = {}

    def claiming():
        try:
            outcome["guard"] = _claim(device, sb, settings)
        except BaseException as exc:  # noqa: BLE001 - handed to the loading thread
            outcome["error"] = exc

    before = _fingerprint(device, sb)
    claimer = threading.Thread(target=claiming, name="kvfs-mmp-claim", daemon=True)
    claimer.start()
    try:
        loaded = load(device, salvage=salvage)
        prepared = prepare(loaded)
    except BaseException:
        claimer.join()
        if "guard" in outcome:
            release_quietly(outcome["guard"])
        raise
    claimer.join()
    if "error" in outcome:
        raise outcome["error"]
    guard = outcome["guard"]
    try:
        if _fingerprint(device, sb) != before or loaded.journal_grew():
            log.warning("%s: the store's metadata changed while it was loaded and claimed; "
                        "loading it again", device.path)
            loaded = load(device, salvage=salvage)
            prepared = prepare(loaded)
        return prepared, guard
    except BaseException:
        release_quietly(guard)
        raise


def probe_mountable(device: DevicePort, mmp: MmpSettings) -> None:
    """What mount.kvfs checks before it forks the daemon, reading only: Busy if a
    live owner holds the MMP record; FormatError if the superblock, either
    checkpoint's checksum or the journal says the store must not be mounted.
    The checkpoint payload is not decoded (see :func:`~kvfs.store.loader.load`)."""
    sb = read_superblock(device)
    if sb.has_mmp:
        probe_record(device, sb, mmp)
    load_store(device, decode_checkpoint=False)

