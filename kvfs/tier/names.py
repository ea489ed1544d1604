"""Names and proofs in the shared tier, all under one tenant's secret.

The secret (``tenant_key=PATH``: a file only its owner may read, 16 bytes or more)
is never used directly; three keys are derived from it with keyed BLAKE2b:

- a block is named ``b`` + HMAC-SHA-256(K_block, bytes): the name is a MAC of the
  content, so a fetched block proves itself (recompute, compare), and another
  tenant, holding another secret, names the same bytes differently. SHA-256, not
  BLAKE2b, because every fetched byte is hashed on the read path and OpenSSL's
  SHA-256 uses the CPU's SHA extensions: 1.46 GB/s a core here, BLAKE2b 0.76
  (docs/benchmarks.md, measurements behind design choices);
- a file's manifest is named ``m`` + BLAKE2b-256(path, key=K_name): a host finds
  the manifest of a path it never wrote, and the name reveals nothing of the path;
- a manifest (JSON: tenant, path, size, block size, block names) ends with
  BLAKE2b-256(body, key=K_mac): a manifest not made with the secret does not verify.

The derivation labels and the manifest carry a format version (2; version 1 named
blocks with BLAKE2b). Hosts of different versions find different manifest names,
so neither judges the other's objects: they age out through the janitor.

Local block keys (xxh3-128 under the store's own secret) never leave the host.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from dataclasses import dataclass

from ..errors import InvalidArgument

NAME_BYTES = 32
FORMAT = 2
MIN_SECRET = 16


class BadManifest(Exception):
    """A manifest that is not ours, not this path's, or inconsistent."""


def load_secret(path: str) -> bytes:
    """The tenant secret in ``path``; refuses a file its group or others may read or write,
    or one owned by someone other than root or us (the mount option error says why)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise InvalidArgument(f"tenant_key={path}: cannot open: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgument(f"tenant_key={path}: not a regular file")
        if st.st_mode & 0o077:
            raise InvalidArgument(f"tenant_key={path}: readable or writable by group or others "
                                  f"(mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
        if st.st_uid not in (0, os.geteuid()):
            raise InvalidArgument(f"tenant_key={path}: owned by uid {st.st_uid}, not root")
        secret = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(secret) < MIN_SECRET:
        raise InvalidArgument(f"tenant_key={path}: the secret is shorter than {MIN_SECRET} bytes")
    return secret


def _derive(secret: bytes, purpose: bytes) -> bytes:
    root = hashlib.blake2b(secret, digest_size=64).digest() if len(secret) > 64 else secret
    return hashlib.blake2b(purpose, key=root, digest_size=64).digest()


@dataclass(frozen=True)
class Manifest:
    path: bytes
    size: int
    block_size: int
    blocks: tuple[str, ...]
    mode: int


class TenantNames:
    def __init__(self, tenant: str, secret: bytes):
        self.tenant = tenant
        self._k_block = _derive(secret, b"kvfs-tier block v%d" % FORMAT)
        self._k_name = _derive(secret, b"kvfs-tier manifest-name v%d" % FORMAT)
        self._k_mac = _derive(secret, b"kvfs-tier manifest-mac v%d" % FORMAT)

    def block_name(self, data) -> str:
        """``b`` + the block's MAC (hashing drops the GIL: callers run it in worker threads)."""
        return "b" + hmac.digest(self._k_block, data, "sha256").hex()

    def block_names(self, data, block_size: int) -> list[str]:
        """The names of ``data``'s blocks (runs in a worker thread: hashing drops the GIL)."""
        view = memoryview(data)
        return [self.block_name(view[i:i + block_size]) for i in range(0, len(view), block_size)]

    def manifest_name(self, path: bytes) -> str:
        return "m" + hashlib.blake2b(path, key=self._k_name, digest_size=NAME_BYTES).hexdigest()

    def _mac(self, body: bytes) -> str:
        return hashlib.blake2b(body, key=self._k_mac, digest_size=NAME_BYTES).hexdigest()

    def encode_manifest(self, m: Manifest) -> bytes:
        body = json.dumps({"v": FORMAT, "tenant": self.tenant, "path": m.path.hex(), "size": m.size,
                           "block_size": m.block_size, "blocks": list(m.blocks), "mode": m.mode},
                          sort_keys=True, separators=(",", ":")).encode()
        return body + b"\n" + self._mac(body).encode()

    def decode_manifest(self, raw: bytes, path: bytes) -> Manifest:
        """The manifest of ``path`` in ``raw``, or :class:`BadManifest`: wrong MAC, another
        tenant's or path's, or block names that do not add up to its size."""
        body, sep, mac = raw.rpartition(b"\n")
        if not sep or not hmac.compare_digest(mac, self._mac(body).encode()):
            raise BadManifest("MAC does not verify")
        try:
            d = json.loads(body)
            m = Manifest(bytes.fromhex(d["path"]), int(d["size"]), int(d["block_size"]),
                         tuple(str(b) for b in d["blocks"]), int(d["mode"]))
            tenant = d["tenant"]
        except (ValueError, KeyError, TypeError) as exc:
            raise BadManifest(f"malformed: {exc}") from None
        if d.get("v") != FORMAT:
            raise BadManifest(f"format {d.get('v')!r}, not {FORMAT}")
        if tenant != self.tenant or m.path != path:
            raise BadManifest("another tenant's or another path's manifest")
        if m.block_size <= 0 or m.size < 0 or len(m.blocks) != -(-m.size // m.block_size):
            raise BadManifest("size and block count disagree")
        if any(len(b) != 1 + 2 * NAME_BYTES or b[0] != "b" for b in m.blocks):
            raise BadManifest("malformed block name")
        return m

    @staticmethod
    def block_length(m: Manifest, i: int) -> int:
        return min(m.block_size, m.size - i * m.block_size)
