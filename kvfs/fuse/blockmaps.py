"""Block maps for bypass readers (kvfs.client): two extended attributes on a regular file.

``user.kvfs.blockmap``
    msgpack of a map: ``lease`` (id), ``seconds`` (how long it holds), ``version``
    (the content version it was granted at), ``size``, ``block_size``,
    ``device`` (the store's path), ``seed`` and ``secret`` (what every key
    starts from), and ``blocks``: per block of the file, ``[device offset,
    length, key, salt]``, or nil for a hole. A lease pins those extents
    (kvfs/namespace/leases.py). ENODATA when the file is not exactly its stored
    blocks now (dirty, open for writing, being truncated); EPERM for a caller
    who may not read the device, EACCES for one who may but does not own the
    file (below).
``user.kvfs.lease.end.<id>[.<id>...]`` (ids in hex)
    ends those leases; the answer holds one byte per id, ``1`` if the file's
    content is what it was when the lease was granted (the bytes read under it
    stand), ``0`` if not (the client must read again through the mount).

Both are read with getxattr, the end too: with ``default_permissions`` the
kernel lets a caller set ``user.`` attributes only on files it may write, and a
reader may only read.

Who gets a map: root, and members of the mount's ``bypass_group`` (their
supplementary groups, from /proc/<pid>/status). Anyone holding a map can read
the whole device, so that group is trusted with every tenant; still, a caller
other than root gets maps only of files it owns, so that on a tenant-isolating
mount no uid learns where another uid's blocks lie.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import msgpack
from pyfuse3 import RequestContext

from ..errors import AccessDenied, InvalidArgument, NoData, NotPermitted
from ..namespace.port import NamespacePort

BLOCKMAP_XATTR = b"user.kvfs.blockmap"
LEASE_END_PREFIX = b"user.kvfs.lease.end."
XATTR_SIZE_MAX = 65536           # the kernel's limit on one attribute value (a map of ~1,800 blocks)


@dataclasses.dataclass(frozen=True)
class BypassDevice:
    """What a bypass client needs to read and verify: the device's path and the store's key base."""
    path: str
    seed: int
    secret: bytes


@dataclasses.dataclass(frozen=True)
class BlockMapStatistics:
    block_maps_served: int       # maps handed out (each under a lease)
    block_maps_denied: int       # callers neither root nor in bypass_group, or not the file's owner
    block_maps_unavailable: int  # files not on the device as they are (ENODATA), or maps too large
    bypass_bytes_mapped: int     # bytes of the blocks those maps named


def groups_of(pid: int) -> set[int]:
    """The supplementary groups of process ``pid`` (empty if it is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


class BlockMaps:
    """Answers the two attributes for :class:`~kvfs.fuse.ops.KvfsOperations` (``group``: bypass_group's gid)."""

    def __init__(self, namespace: NamespacePort, device: BypassDevice, group: Optional[int] = None) -> None:
        self.ns, self.device, self.group = namespace, device, group
        self._s = dict.fromkeys(("served", "denied", "unavailable", "bytes"), 0)

    @staticmethod
    def handles(name: bytes) -> bool:
        return name == BLOCKMAP_XATTR or name.startswith(LEASE_END_PREFIX)

    def may_bypass(self, ctx: RequestContext) -> bool:
        if ctx.uid == 0:
            return True
        return self.group is not None and (ctx.gid == self.group or self.group in groups_of(ctx.pid))

    async def answer(self, ino: int, name: bytes, ctx: RequestContext) -> bytes:
        if not self.may_bypass(ctx):
            self._s["denied"] += 1
            raise NotPermitted("block maps are for root and the mount's bypass_group")
        if name != BLOCKMAP_XATTR:
            return self._end(name)
        if ctx.uid != 0 and self.ns.inode(ino).uid != ctx.uid:
            self._s["denied"] += 1
            raise AccessDenied("a block map is given to root and the file's owner only")
        grant = await self.ns.lease_blocks(ino)
        if grant is None:
            self._s["unavailable"] += 1
            raise NoData("the file is not on the device as it is now")
        blob = msgpack.packb({
            "lease": grant.lease_id, "seconds": grant.seconds, "version": grant.generation,
            "size": grant.size, "block_size": grant.block_size, "device": self.device.path,
            "seed": self.device.seed, "secret": self.device.secret,
            "blocks": [None if b is None else list(b) for b in grant.blocks]}, use_bin_type=True)
        if len(blob) > XATTR_SIZE_MAX:
            self.ns.end_leases([grant.lease_id])
            self._s["unavailable"] += 1
            raise NoData("the file's block map is larger than an attribute may be")
        self._s["served"] += 1
        self._s["bytes"] += sum(b[1] for b in grant.blocks if b is not None)
        return blob

    def _end(self, name: bytes) -> bytes:
        try:
            ids = [int(part, 16) for part in name[len(LEASE_END_PREFIX):].split(b".")]
        except ValueError:
            raise InvalidArgument("lease ids are hex numbers joined by '.'") from None
        return bytes(b"1"[0] if valid else b"0"[0] for valid in self.ns.end_leases(ids))

    def statistics(self) -> BlockMapStatistics:
        s = self._s
        return BlockMapStatistics(s["served"], s["denied"], s["unavailable"], s["bytes"])
