"""The mount's checkpoint checks in a forked child (kvfs/store/childcheck.py), through the real mount.kvfs.

The unit tests (tests/unit/test_child_check.py) take the child path in
process with the size bar lowered. Here a store is made big enough to take it
for real (a checkpoint payload over childcheck.MIN_PAYLOAD), and the daemon
forks while its multi-mount claim thread runs: the mount serves every file,
and a checkpoint whose rows are bad (checksums right) is refused with the
one-line message the in-process check gives.
"""
import os
import stat
import subprocess

import msgpack
import pytest
import trio

from kvfs import schema
from kvfs.device import Device
from kvfs.errors import FormatError
from kvfs.namespace import ROOT_INO
from kvfs.store import childcheck
from kvfs.store.loader import load
from kvfsmount import KvfsMount, new_log_records, run_tool
from unit.helpers import open_fs, pattern, poke, running

FILES = 45_000          # empty files with LMCache-length names: a checkpoint of about 6 MB
NAME = b"vllm@meta-llama_Llama-3.1-8B-Instruct@4@0@%064x@bfloat16.pt"


@pytest.fixture(scope="module")
def large_store(tmp_path_factory):
    """A store whose checkpoint takes the child path; returns (mount, {name: bytes} of the files with data)."""
    m = KvfsMount(tmp_path_factory.mktemp("childcheck"), size="1G")
    m.mkfs()
    with_data = {b"chunk-%d" % i: pattern(i, 5000 + 4096 * i) for i in range(4)}

    async def fill(fs):
        async with running(fs):
            ns = fs.ns
            d = ns.make(ROOT_INO, b"flat", stat.S_IFDIR | 0o755, 0, 0)
            for i in range(FILES):
                ns.forget(ns.make(d, NAME % i, stat.S_IFREG | 0o644, 0, 0), 1)
            for name, data in with_data.items():
                ino = ns.make(ROOT_INO, name, stat.S_IFREG | 0o644, 0, 0)
                fh, _, _ = ns.open(ino, os.O_WRONLY)
                await ns.write(fh, 0, data)
                await ns.release(fh)
                ns.forget(ino, 1)
    fs = open_fs(m.device)
    trio.run(fill, fs)
    fs.close()
    assert active_payload_len(m.device) >= childcheck.MIN_PAYLOAD
    yield m, with_data
    m.teardown()


def active_payload_len(path):
    device = Device.open(str(path), readonly=True, lock=False)
    try:
        loaded = load(device, decode_checkpoint=False)
        return loaded._read_header(loaded.active_slot)[1]
    finally:
        device.close()


def test_a_large_store_is_checked_in_a_child_and_serves_every_file(large_store):
    m, with_data = large_store
    m.mount()
    try:
        mounted = [r for r in new_log_records(m.log) if "mounted " in r[1]]
        assert mounted and "'checkpoint_check': 'child process'" in mounted[-1][1]
        assert len(os.listdir(m.mnt / "flat")) == FILES
        for name, data in with_data.items():
            assert (m.mnt / name.decode()).read_bytes() == data
    finally:
        m.umount()
    m.assert_fsck_clean()


@pytest.mark.expect_errors(r"daemon failed: .*checkpoint inode")
def test_bad_rows_in_a_large_checkpoint_are_refused_with_the_in_process_message(large_store, tmp_path):
    m, _ = large_store
    saved = tmp_path / "saved"
    subprocess.run(["cp", "--sparse=always", m.device, saved], check=True)
    device = Device.open(str(m.device), readonly=True, lock=False)
    try:
        loaded = load(device)
        sb, slot = loaded.sb, loaded.active_slot
        _, length, _ = loaded._read_header(slot)
        off = (sb.checkpoint_a_off, sb.checkpoint_b_off)[slot]
        wire = msgpack.unpackb(device.pread_sync(off + schema.SECTOR, length), strict_map_key=False)
    finally:
        device.close()
    # The last file's mode as text: a row late in the array, met after most of the build.
    rows = [r for r in wire["inodes"] if r[1] & 0o170000 == 0o100000]
    rows[-1][1] = "rw-r--r--"
    payload = msgpack.packb(wire)
    other = (sb.checkpoint_a_off, sb.checkpoint_b_off)[1 - slot]
    poke(m.device, other, schema.encode_checkpoint_header(loaded.generation + 1, payload, sb.hash_seed) + payload)
    try:
        with pytest.raises(FormatError) as in_process:
            saved_bar, childcheck.MIN_PAYLOAD = childcheck.MIN_PAYLOAD, 1 << 62
            try:
                open_fs(m.device, readonly=True).close()
            finally:
                childcheck.MIN_PAYLOAD = saved_bar
        proc = run_tool("mount", m.device, m.mnt, "-o", f"log={m.log}", check=False, timeout=120)
        assert proc.returncode != 0 and not m.mounted
        line = proc.stderr.strip()
        assert "\n" not in line and str(in_process.value) in line, (line, str(in_process.value))
        refused = [r for r in new_log_records(m.log) if "daemon failed" in r[1]]
        assert refused and "Traceback" not in refused[-1][2]
    finally:
        subprocess.run(["cp", "--sparse=always", saved, m.device], check=True)
    m.assert_fsck_clean()
