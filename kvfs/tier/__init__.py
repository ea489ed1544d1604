"""The shared block tier: sealed files published to a distributed store, fetched by name elsewhere.

An adapter the server wires in (``tier=rados``); the namespace sees it only as
:class:`kvfs.namespace.port.TierPort`. Its parts:

``backend``  the four calls every backend offers (get, put_if_absent, exists, delete), errors
``rados``    those calls over librados (python3-rados), in worker threads, under a deadline
``names``    tenant secret, HMAC-SHA-256 block and manifest names, the manifest MAC
``shared``   SharedTier: the publish queue and workers, verified fetches, statistics
``janitor``  keeps a tenant's objects under a capacity bound, oldest first (one host runs it)
``options``  the mount options
"""
from __future__ import annotations


def make_tier(opts, *, block_size=None):
    """A SharedTier for parsed TierOptions (kvfs/tier/options.py); not connected yet."""
    from .names import TenantNames
    from .rados import RadosBackend
    from .shared import TIER_BLOCK, SharedTier
    backend = RadosBackend(conf=opts.ceph_conf, ceph_id=opts.ceph_id, pool=opts.ceph_pool, namespace=opts.tenant,
                           deadline=opts.deadline, concurrency=opts.concurrency)
    tier = SharedTier(backend, TenantNames(opts.tenant, opts.secret), deadline=opts.deadline, queue=opts.queue,
                      miss_ttl=opts.miss_ttl, block_size=block_size or TIER_BLOCK)
    if opts.capacity:
        from .janitor import Janitor
        tier.janitor = Janitor(backend, opts.capacity, interval=opts.janitor_interval)
    return tier
