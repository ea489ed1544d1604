"""Stores made by past versions of kvfs still check, mount and read back exactly.

tests/images/ keeps one small image per on-disk format version: a real store
made with mkfs.kvfs, mounted, filled with a tree covering every kind of thing
the format records, and unmounted (tests/images/make_image.py documents how).
Its manifest lists every path with its type, mode, owner, link count, size,
times and the sha256 of its contents.

This test rebuilds each store from its image, runs fsck (it must be clean),
mounts it, compares the tree with the manifest, writes and deletes something,
unmounts and checks again, and remounts to read old and new back.

A change to the on-disk format must be a deliberate, versioned step: a change
that makes this test fail is one. Bump FORMAT_VERSION in the format code, make
the new version read (or knowingly refuse, with a test saying so) every older
image kept here, document the change in docs/format.md, and add the new
version's image with ``make_image.py``. Never regenerate a committed image to
make this test pass: an image is the record of what stores of its version
look like on disk, and users have such stores.
"""
import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from images.storeimage import unpack_to

IMAGES = Path(__file__).parent / "images"
MANIFESTS = sorted(IMAGES.glob("format-v*.json"))


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def check_tree(mnt: Path, manifest):
    """Every manifest entry is there as recorded, and nothing else is (besides /.kvfs)."""
    m = os.fsencode(mnt)
    found = set()
    for dirpath, dirnames, filenames in os.walk(m):
        if dirpath == m:
            dirnames[:] = [d for d in dirnames if d != b".kvfs"]
        found |= {os.path.relpath(os.path.join(dirpath, n), m) for n in dirnames + filenames}
    expected = {os.fsencode(e["path"]) for e in manifest["entries"]}
    assert found == expected, f"missing {sorted(expected - found)}, unexpected {sorted(found - expected)}"
    for e in manifest["entries"]:
        path = os.path.join(m, os.fsencode(e["path"]))
        st = os.lstat(path)
        got = {"mode": f"{stat.S_IMODE(st.st_mode):04o}", "uid": st.st_uid, "gid": st.st_gid,
               "nlink": st.st_nlink}
        if stat.S_ISLNK(st.st_mode):
            got.update(type="symlink", target=os.fsdecode(os.readlink(path)))
        elif stat.S_ISDIR(st.st_mode):
            got.update(type="dir", mtime_ns=st.st_mtime_ns)
        else:
            assert stat.S_ISREG(st.st_mode), (e["path"], oct(st.st_mode))
            got.update(type="file", size=st.st_size, sha256=sha256(path), mtime_ns=st.st_mtime_ns)
        want = {k: v for k, v in e.items() if k != "path"}
        assert got == want, f"{e['path']!r}: {got} != recorded {want}"
    for a, b in manifest["hardlinks"]:
        sa, sb = (os.lstat(os.path.join(m, os.fsencode(p))) for p in (a, b))
        assert (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino), f"{a} and {b} are no longer one file"


def test_images_are_kept():
    """The image of the current format is among them (make_image.py makes it)."""
    from kvfs.schema import FORMAT_VERSION
    assert IMAGES / f"format-v{FORMAT_VERSION}.json" in MANIFESTS, (
        f"no image of format version {FORMAT_VERSION} in {IMAGES}: run tests/images/make_image.py")
    for manifest in MANIFESTS:
        image = manifest.with_suffix(".img.xz")
        assert image.stat().st_size < 512 << 10, f"{image.name} is too big to keep in the repository"


@pytest.mark.parametrize("manifest_path", MANIFESTS, ids=[p.stem for p in MANIFESTS])
def test_stored_image_checks_mounts_and_reads_back(kvfs_factory, manifest_path):
    manifest = json.loads(manifest_path.read_text())
    fs = kvfs_factory(manifest_path.stem)
    size = unpack_to(manifest_path.with_suffix(".img.xz").read_bytes(), fs.device)
    assert size == manifest["store_size"]
    assert sha256(fs.device) == manifest["store_sha256"], "the image did not rebuild the store it was made from"
    assert os.stat(fs.device).st_blocks * 512 < size // 4, "the rebuilt store should be sparse"

    fs.assert_fsck_clean()
    fs.mount()
    check_tree(fs.mnt, manifest)
    stats = fs.stats()
    assert stats["block_size"] == manifest["block_size"]
    assert stats["unique_blocks"] == manifest["unique_blocks"], "deduplicated blocks came back apart"

    # Change it with today's code: a new file, a new directory, one of the two
    # deduplicated files gone (the shared blocks' count drops), a rewrite.
    new = os.urandom(3 * manifest["block_size"] + 123)
    (fs.mnt / "new-dir").mkdir()
    (fs.mnt / "new-dir" / "new.bin").write_bytes(new)
    os.unlink(fs.mnt / "dup-a.bin")
    (fs.mnt / "small.txt").write_bytes(b"rewritten\n")
    fs.umount()
    fs.assert_fsck_clean()

    fs.mount()
    assert (fs.mnt / "new-dir" / "new.bin").read_bytes() == new
    assert (fs.mnt / "small.txt").read_bytes() == b"rewritten\n"
    dup = next(e for e in manifest["entries"] if e["path"] == "dir/dup-b.bin")
    assert sha256(fs.mnt / "dir" / "dup-b.bin") == dup["sha256"]
    assert not (fs.mnt / "dup-a.bin").exists()
    # teardown (kvfs_factory): umount, then fsck must be clean once more
