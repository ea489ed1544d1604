"""Shared-tier names and proofs (kvfs/tier/names.py) and the tier's mount options; no cluster."""
import hashlib
import hmac
import os

import pytest

from kvfs.errors import InvalidArgument
from kvfs.tier.names import BadManifest, Manifest, TenantNames, load_secret
from kvfs.tier.options import parse_tier_options


def write_key(tmp_path, mode=0o600, data=b"s" * 32):
    path = tmp_path / "tenant.key"
    path.write_bytes(data)
    os.chmod(path, mode)
    return path


def test_secret_file_must_be_private(tmp_path):
    assert load_secret(str(write_key(tmp_path))) == b"s" * 32
    for mode in (0o640, 0o604, 0o660, 0o644):
        path = write_key(tmp_path, mode)
        with pytest.raises(InvalidArgument, match="readable or writable by group or others"):
            load_secret(str(path))
    with pytest.raises(InvalidArgument, match="shorter than 16"):
        load_secret(str(write_key(tmp_path, data=b"short")))
    with pytest.raises(InvalidArgument, match="cannot open"):
        load_secret(str(tmp_path / "missing"))


def test_names_are_keyed_per_tenant_and_deterministic():
    a, a2, b = TenantNames("t1", b"k" * 32), TenantNames("t1", b"k" * 32), TenantNames("t2", b"j" * 32)
    data = os.urandom(1000)
    assert a.block_name(data) == a2.block_name(data) != b.block_name(data)
    assert a.block_name(data) != a.block_name(data + b"x")
    assert a.manifest_name(b"/x/chunk") == a2.manifest_name(b"/x/chunk") != b.manifest_name(b"/x/chunk")
    assert a.manifest_name(b"/x/chunk") != a.manifest_name(b"/x/chunk2")
    assert len(a.block_name(data)) == 65 and a.block_name(data)[0] == "b"
    assert a.block_names(b"a" * 10 + b"b" * 10, 10) == [a.block_name(b"a" * 10), a.block_name(b"b" * 10)]


def test_the_names_are_the_documented_macs():
    """Format 2 (kvfs/tier/names.py): blocks are HMAC-SHA-256, manifest names keyed
    BLAKE2b-256, each under a key derived from the secret with its own label."""
    secret, data = b"k" * 32, os.urandom(5000)
    names = TenantNames("t1", secret)

    def derived(label):
        return hashlib.blake2b(label, key=secret, digest_size=64).digest()
    assert names.block_name(data) == "b" + hmac.new(derived(b"kvfs-tier block v2"), data, "sha256").hexdigest()
    assert names.manifest_name(b"/p") == "m" + hashlib.blake2b(
        b"/p", key=derived(b"kvfs-tier manifest-name v2"), digest_size=32).hexdigest()


def test_a_manifest_of_another_format_is_refused():
    names = TenantNames("t1", b"k" * 32)
    m = Manifest(b"/d/f", 4, 4, (names.block_name(b"abcd"),), 0o644)
    body = names.encode_manifest(m).rpartition(b"\n")[0].replace(b'"v":2', b'"v":1')
    with pytest.raises(BadManifest, match="format 1, not 2"):
        names.decode_manifest(body + b"\n" + names._mac(body).encode(), b"/d/f")


def test_manifest_roundtrip_and_every_forgery_fails():
    names = TenantNames("t1", b"k" * 32)
    blocks = tuple(names.block_name(bytes([i]) * 4) for i in range(3))
    m = Manifest(b"/d/f", 10, 4, blocks, 0o644)
    raw = names.encode_manifest(m)
    assert names.decode_manifest(raw, b"/d/f") == m
    with pytest.raises(BadManifest, match="another"):
        names.decode_manifest(raw, b"/d/other")              # a manifest copied under another path's name
    with pytest.raises(BadManifest, match="MAC"):
        TenantNames("t1", b"j" * 32).decode_manifest(raw, b"/d/f")   # another secret
    with pytest.raises(BadManifest, match="MAC"):
        names.decode_manifest(raw.replace(b'"size":10', b'"size":11'), b"/d/f")
    with pytest.raises(BadManifest, match="MAC"):
        names.decode_manifest(raw[:-1] + (b"0" if raw[-1:] != b"0" else b"1"), b"/d/f")
    other = TenantNames("t2", b"k" * 32)                      # same secret, another tenant id
    with pytest.raises(BadManifest):
        names.decode_manifest(other.encode_manifest(m), b"/d/f")
    with pytest.raises(BadManifest, match="size and block count"):
        names.decode_manifest(names.encode_manifest(Manifest(b"/d/f", 20, 4, blocks, 0o644)), b"/d/f")


def test_mount_options(tmp_path):
    key = write_key(tmp_path)
    conf = tmp_path / "ceph.conf"
    conf.write_text("[global]\n")
    base = [("tier", "rados"), ("ceph_conf", str(conf)), ("ceph_id", "kv-t1"), ("ceph_pool", "kvpool"),
            ("tenant", "t1"), ("tenant_key", str(key))]
    opts = parse_tier_options(base + [("tier_deadline", "0.5"), ("tier_queue", "3"), ("tier_capacity", "2G")])
    assert opts.capacity == 2 << 30
    assert (opts.tenant, opts.ceph_id, opts.deadline, opts.queue, opts.secret) == ("t1", "kv-t1", 0.5, 3, b"s" * 32)
    assert parse_tier_options([]) is None
    bad = {
        "need 'tier=rados'": base[1:],
        "use rados": [("tier", "s3")] + base[1:],
        "needs mount options tenant_key": base[:-1],
        "not a readable file": [base[0], ("ceph_conf", str(tmp_path / "nope"))] + base[2:],
        "'tenant'": base[:4] + [("tenant", "t/1"), base[5]],
        "without 'client.'": base[:2] + [("ceph_id", "client.kv")] + base[3:],
        "tier_deadline": base + [("tier_deadline", "0")],
        "tier_queue": base + [("tier_queue", "x")],
        "tier_capacity": base + [("tier_capacity", "lots")],
        "needs a value": base + [("tier_miss_ttl", "")],
    }
    for message, items in bad.items():
        with pytest.raises(InvalidArgument, match=message):
            parse_tier_options(items)
    os.chmod(key, 0o644)
    with pytest.raises(InvalidArgument, match="group or others"):
        parse_tier_options(base)
