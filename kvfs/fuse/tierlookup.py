"""Lookups that consult the shared tier (mount option ``tier=``).

:class:`TierOperations` is :class:`kvfs.fuse.ops.KvfsOperations` with one handler
changed: a name this host lacks is looked up in the shared tier
(:meth:`kvfs.namespace.Namespace.lookup_remote`, within the tier's deadline)
before the miss is answered. The kernel then caches the miss for the tier's
``miss_ttl`` only, not an hour: another host may publish the name at any time.
The daemon serves this class only when a tier is configured, so a mount without
one answers lookups exactly as before.
"""
from __future__ import annotations

from typing import Optional

from pyfuse3 import EntryAttributes, FileNameT, InodeT, RequestContext

from ..errors import NotFound
from ..namespace import BY_HASH_INO
from .ops import KvfsOperations, _fuse_error


class TierOperations(KvfsOperations):
    async def lookup(self, parent_inode: InodeT, name: FileNameT,
                     ctx: Optional[RequestContext] = None) -> EntryAttributes:
        entry = await super().lookup(parent_inode, name, ctx)
        if entry.st_ino or parent_inode == BY_HASH_INO:
            return entry
        try:
            return self._entry(await self.ns.lookup_remote(parent_inode, name))
        except NotFound:
            pass
        except Exception as exc:
            raise _fuse_error("lookup", exc) from None
        tier = self.ns.tier
        entry.entry_timeout = tier.miss_ttl if tier is not None else entry.entry_timeout
        return entry
