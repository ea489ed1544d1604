#!/usr/bin/env python3
"""Make the stored image of today's kvfs on-disk format, and its manifest.

    cd <repo> && .venv/bin/python tests/images/make_image.py       # as root, with /dev/fuse

It runs the real tools: ``mkfs.kvfs --size 64M --block-size 64K`` (the smallest
legal store, so the image stays small), mounts the store, writes the tree below
through the mount, sets fixed modes and times, unmounts through kvfs-admin,
checks the store with fsck.kvfs, and then writes two files next to this script:

    format-v<N>.img.xz      the store's non-zero sectors (see storeimage.py)
    format-v<N>.json        what tests/test_format_image.py expects to find in it

where N is the on-disk FORMAT_VERSION the store was made with. An image, once
committed, is never remade: it is the record of what stores of that version
look like. A new format version gets a new image next to the old ones.

The tree covers every kind of thing the format records: an empty file, files
smaller than a block, a file of exactly one block, files with a partial tail
block, two identical files (deduplicated blocks with a reference count of
two), a nested directory, a symlink, a hard link, a name that is not UTF-8,
and modes other than the defaults. Contents are text lines, so lzma squeezes
them, but every block is distinct unless it is meant to be shared.
"""
import hashlib
import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]       # this checkout's kvfs; kvfsmount, images

from images.storeimage import pack                    # noqa: E402
from kvfsmount import KvfsMount                        # noqa: E402

from kvfs.schema import FORMAT_VERSION                 # noqa: E402

BLOCK = 64 << 10
MTIME_NS = 1_700_000_000_123_456_789                   # every entry gets fixed times
NON_UTF8 = b"caf\xe9-latin1.bin"                        # "café" in Latin-1: not valid UTF-8


def lines(tag, nbytes):
    """``nbytes`` of numbered text lines naming ``tag``: compressible, distinct per block."""
    out = bytearray()
    i = 0
    while len(out) < nbytes:
        out += f"{tag} line {i:07d} of a kvfs format image\n".encode()
        i += 1
    return bytes(out[:nbytes])


# path (bytes, relative to the mount) -> content, for the regular files.
FILES = {
    b"empty": b"",
    b"one-byte": b"x",
    b"small.txt": lines("small", 4095),
    b"exact-block.bin": lines("exact", BLOCK),
    b"tail.bin": lines("tail", 2 * BLOCK + 1000),
    b"dup-a.bin": lines("dup", BLOCK + 77),
    b"dir/dup-b.bin": lines("dup", BLOCK + 77),       # same bytes as dup-a.bin: its blocks are shared
    b"dir/nested.bin": lines("nested", 3 * BLOCK + 5),
    b"dir/sub/deep.txt": lines("deep", 300),
    NON_UTF8: lines("latin1", 5000),
}
DIRS = {b"dir": 0o755, b"dir/sub": 0o700}
MODES = {b"small.txt": 0o600, b"tail.bin": 0o640, b"dir/sub/deep.txt": 0o755}
SYMLINKS = {b"link-to-nested": b"dir/nested.bin", b"dir/dangling": b"../nowhere"}
HARDLINKS = {b"dir/tail-hardlink": b"tail.bin"}        # new name -> existing file


def populate(mnt: Path):
    m = os.fsencode(mnt)
    for d in DIRS:
        os.mkdir(os.path.join(m, d))
    for name, data in FILES.items():
        with open(os.path.join(m, name), "wb") as f:
            f.write(data)
    for name, target in SYMLINKS.items():
        os.symlink(target, os.path.join(m, name))
    for name, existing in HARDLINKS.items():
        os.link(os.path.join(m, existing), os.path.join(m, name))
    for name in FILES:
        os.chmod(os.path.join(m, name), MODES.get(name, 0o644))
    for name, mode in DIRS.items():
        os.chmod(os.path.join(m, name), mode)
    # Times last, deepest first, so that no later change touches them.
    for name in sorted([*FILES, *DIRS], key=lambda p: -p.count(b"/")):
        os.utime(os.path.join(m, name), ns=(MTIME_NS, MTIME_NS))


def manifest_of(mnt: Path):
    """Every entry under the mount (the /.kvfs view excluded), as the manifest records it."""
    m = os.fsencode(mnt)
    entries = []
    for dirpath, dirnames, filenames in os.walk(m):
        if dirpath == m:
            dirnames[:] = [d for d in dirnames if d != b".kvfs"]
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, m)
            st = os.lstat(full)
            entry = {"path": os.fsdecode(rel), "mode": f"{stat.S_IMODE(st.st_mode):04o}",
                     "uid": st.st_uid, "gid": st.st_gid, "nlink": st.st_nlink}
            if stat.S_ISLNK(st.st_mode):
                entry.update(type="symlink", target=os.fsdecode(os.readlink(full)))
            elif stat.S_ISDIR(st.st_mode):
                entry.update(type="dir", mtime_ns=st.st_mtime_ns)
            else:
                with open(full, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
                entry.update(type="file", size=st.st_size, sha256=digest, mtime_ns=st.st_mtime_ns)
            entries.append(entry)
    return entries


def main():
    os.chdir(REPO)                                     # the tools run as python -m kvfs.cli.*: this kvfs
    with tempfile.TemporaryDirectory(prefix="kvfs-image-") as tmp:
        fs = KvfsMount(Path(tmp), size="64M", block_size="64K")
        fs.mkfs()
        fs.mount()
        try:
            populate(fs.mnt)
            entries = manifest_of(fs.mnt)
            stats = fs.stats()
        finally:
            fs.umount()
        fs.assert_fsck_clean()
        store = fs.device.read_bytes()
        image = pack(store)
    expected = {(os.fsdecode(p), hashlib.sha256(d).hexdigest()) for p, d in FILES.items()}
    recorded = {(e["path"], e["sha256"]) for e in entries if e["type"] == "file"}
    assert expected <= recorded, expected - recorded
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    manifest = {
        "format_version": FORMAT_VERSION,
        "made_by": "tests/images/make_image.py: mkfs.kvfs --size 64M --block-size 64K, "
                   "mount, populate, kvfs-admin umount, fsck.kvfs clean",
        "made_at_commit": commit,
        "store_size": len(store),
        "block_size": BLOCK,
        "store_sha256": hashlib.sha256(store).hexdigest(),
        "unique_blocks": stats["unique_blocks"],
        "hardlinks": [[os.fsdecode(a), os.fsdecode(b)] for a, b in HARDLINKS.items()],
        "entries": entries,
    }
    name = f"format-v{FORMAT_VERSION}"
    (HERE / f"{name}.img.xz").write_bytes(image)
    # ensure_ascii keeps the non-UTF-8 name as a \udcXX escape, which json.loads gives back.
    (HERE / f"{name}.json").write_text(json.dumps(manifest, indent=1, ensure_ascii=True) + "\n")
    print(f"{name}.img.xz: {len(image)} bytes for a {len(store)}-byte store; "
          f"{len(entries)} entries, {stats['unique_blocks']} unique blocks")


if __name__ == "__main__":
    main()
