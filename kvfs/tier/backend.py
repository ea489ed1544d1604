"""What every shared-tier backend offers: four calls on opaque object names.

Kept this small so that an S3 backend (radosgw, or any S3) can follow: a PUT with
``If-None-Match: *`` is ``put_if_absent``, GET, HEAD and DELETE the rest. Names are
ASCII and carry no tenant: a backend confines each tenant itself (RADOS: a namespace
its cephx user is limited to; S3: a bucket or prefix policy).
"""
from __future__ import annotations

from typing import Optional, Protocol

from ..errors import KvfsError


class TierError(KvfsError):
    """The tier did not do what was asked; a cache miss for every caller."""


class TierUnavailable(TierError):
    """The cluster cannot be reached (or its client is not installed)."""


class TierTimeout(TierError):
    """The call did not finish within its deadline."""


class TierDenied(TierError):
    """The cluster refused our credentials for this object (another tenant's namespace)."""


class TierBackend(Protocol):
    async def get(self, name: str, max_size: int) -> Optional[bytes]: ...   # None: no such object
    async def put_if_absent(self, name: str, data: bytes) -> bool: ...        # False: it existed (dedup hit)
    async def exists(self, name: str) -> bool: ...
    async def delete(self, name: str) -> bool: ...                            # False: it was not there
