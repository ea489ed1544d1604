"""Dedup domains: which uids may share stored blocks (part of the block index layer).

Split out of kvfs/blockindex/__init__.py, which keys every block with its domain; see
that module's doc for why tenants get domains of their own.
"""
from __future__ import annotations

import hashlib

from ..errors import InvalidArgument


class DedupDomains:
    """Which uids share dedup: ``groups`` is None (every uid its own domain), "all"
    (one domain for everybody: the single-tenant host), or a list of uid sets.

    A domain's number is a keyed BLAKE2b of its member list, so it names the
    group, not any one uid: a group whose membership changes gets a new domain,
    and blocks stored under the old membership are never shared with a newcomer.
    Domain 0 (no domain) is what format version 1 stores use; they have no secret.
    """

    def __init__(self, secret: bytes, groups: str | list[frozenset[int]] | None = None) -> None:
        self._secret = secret
        self._groups = groups
        self._of_uid = {}

    @staticmethod
    def parse(text: str | None) -> str | list[frozenset[int]] | None:
        """``dedup_groups=`` mount option: "all", or uid groups like "1000+1001:2000+2001"
        (``+`` joins the uids of a group, ``:`` separates groups; a comma would end the option)."""
        if text in (None, "", "none"):
            return None
        if text == "all":
            return "all"
        groups, seen = [], set()
        for part in text.split(":"):
            try:
                uids = frozenset(int(u) for u in part.split("+"))
            except ValueError:
                raise InvalidArgument(f"dedup_groups: {part!r} is not a list of uids joined by '+'") from None
            if any(u < 0 for u in uids) or uids & seen:
                raise InvalidArgument(f"dedup_groups: uid lists must be disjoint lists of uids, not {text!r}")
            seen |= uids
            groups.append(uids)
        return groups

    def of(self, uid: int) -> int:
        if not self._secret:
            return 0
        domain = self._of_uid.get(uid)
        if domain is None:
            if self._groups == "all":
                members = "all"
            else:
                group = next((g for g in self._groups or () if uid in g), (uid,))
                members = ",".join(str(u) for u in sorted(group))
            digest = hashlib.blake2b(b"kvfs dedup domain " + members.encode(), key=self._secret,
                                     digest_size=8).digest()
            domain = self._of_uid[uid] = int.from_bytes(digest, "little") | 1
        return domain
