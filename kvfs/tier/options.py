"""The tier's mount options: ``tier=rados,ceph_conf=,ceph_id=,ceph_pool=,tenant=,tenant_key=``.

Checked before anything is mounted (kvfs/cli/mount.py hands them here); a bad value
is :class:`kvfs.errors.InvalidArgument` with a one-line message. That the cluster
answers is not checked here: a mount whose cluster cannot be reached serves its
local store and logs a warning (kvfs/tier/shared.py).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re

from ..errors import InvalidArgument
from .names import load_secret

TIER_OPTIONS = {"tier", "ceph_conf", "ceph_id", "ceph_pool", "tenant", "tenant_key", "tier_deadline",
                "tier_queue", "tier_concurrency", "tier_miss_ttl", "tier_capacity", "tier_janitor_interval"}
REQUIRED = ("ceph_conf", "ceph_id", "ceph_pool", "tenant", "tenant_key")
_IDENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")


@dataclasses.dataclass
class TierOptions:
    kind: str
    ceph_conf: str
    ceph_id: str
    ceph_pool: str
    tenant: str
    tenant_key: str
    secret: bytes = dataclasses.field(repr=False, default=b"")
    deadline: float = 2.0           # seconds a lookup that consults the tier may take, at most
    queue: int = 256                # sealed files waiting to be published; more are dropped (counted)
    concurrency: int = 16           # tier calls in flight at once (fetches and publishes)
    miss_ttl: float = 0.5           # seconds a name the tier lacks is remembered as missing
    capacity: int = 0               # > 0: this host runs the tenant's janitor with this bound (bytes)
    janitor_interval: float = 60.0


def _float(name, value, lo, hi):
    try:
        number = float(value)
    except ValueError:
        raise InvalidArgument(f"bad value for mount option {name!r}: {value!r} is not a number") from None
    if not (math.isfinite(number) and lo <= number <= hi):
        raise InvalidArgument(f"bad value for mount option {name!r}: {value!r} must be from {lo:g} to {hi:g}")
    return number


def _int(name, value, lo, hi):
    try:
        number = int(value)
    except ValueError:
        raise InvalidArgument(f"bad value for mount option {name!r}: {value!r} is not a whole number") from None
    if not lo <= number <= hi:
        raise InvalidArgument(f"bad value for mount option {name!r}: {value!r} must be from {lo} to {hi}")
    return number


def parse_tier_options(items: list[tuple[str, str]]) -> TierOptions | None:
    """TierOptions from the (name, value) pairs of the tier's options; None when none was given."""
    given = {}
    for name, value in items:
        if not value:
            raise InvalidArgument(f"mount option {name!r} needs a value ({name}=...)")
        given[name] = value
    if not given:
        return None
    if "tier" not in given:
        raise InvalidArgument(f"mount options {', '.join(sorted(given))} need 'tier=rados' too")
    if given["tier"] != "rados":
        raise InvalidArgument(f"bad value for mount option 'tier': {given['tier']!r} (use rados)")
    missing = [name for name in REQUIRED if name not in given]
    if missing:
        raise InvalidArgument(f"tier=rados needs mount options {', '.join(missing)}")
    conf = os.path.abspath(given["ceph_conf"])
    if not os.path.isfile(conf) or not os.access(conf, os.R_OK):
        raise InvalidArgument(f"bad value for mount option 'ceph_conf': {conf} is not a readable file")
    for name in ("ceph_id", "ceph_pool", "tenant"):
        if not _IDENT.match(given[name]):
            raise InvalidArgument(f"bad value for mount option {name!r}: {given[name]!r} "
                                  "(letters, digits, '_', '.', '-'; at most 64)")
    if given["ceph_id"].startswith("client."):
        raise InvalidArgument("bad value for mount option 'ceph_id': give the user without 'client.'")
    key_path = os.path.abspath(given["tenant_key"])
    opts = TierOptions("rados", conf, given["ceph_id"], given["ceph_pool"], given["tenant"], key_path,
                       secret=load_secret(key_path))
    if "tier_deadline" in given:
        opts.deadline = _float("tier_deadline", given["tier_deadline"], 0.05, 60)
    if "tier_queue" in given:
        opts.queue = _int("tier_queue", given["tier_queue"], 1, 1_000_000)
    if "tier_concurrency" in given:
        opts.concurrency = _int("tier_concurrency", given["tier_concurrency"], 1, 256)
    if "tier_miss_ttl" in given:
        opts.miss_ttl = _float("tier_miss_ttl", given["tier_miss_ttl"], 0, 3600)
    if "tier_capacity" in given:
        opts.capacity = _size("tier_capacity", given["tier_capacity"])
    if "tier_janitor_interval" in given:
        opts.janitor_interval = _float("tier_janitor_interval", given["tier_janitor_interval"], 0.1, 86400)
    return opts


def _size(name, value):
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = value.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1:] if text[-1:] in units else ""
    try:
        number = int(float(text[:-1] if unit else text) * units[unit])
    except ValueError:
        raise InvalidArgument(f"bad value for mount option {name!r}: {value!r} (e.g. 500G)") from None
    if number <= 0:
        raise InvalidArgument(f"bad value for mount option {name!r}: {value!r} must be positive")
    return number
