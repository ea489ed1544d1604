"""No metadata exhaustion through a mount (issue 12, "Bad names and arguments").

The largest metadata one call can add: a 4095-byte symlink target under a
255-byte name, and hard links with 255-byte names. A loop of them on a small
store must end in ENOSPC, with the daemon alive, committed files intact, a clean
unmount (the checkpoint still fits), the store mountable again and fsck clean.
Extended attributes cost nothing: kvfs stores none (EOPNOTSUPP, see the
conformance table). The errno of each bad name and argument is in
tests/test_conformance.py's table.
"""
import errno
import os

from filedata import pattern, write_file

MiB = 1 << 20


def long_name(prefix, i):
    name = f"{prefix}{i:07d}"
    return name + "n" * (255 - len(name))


def test_flood_of_huge_symlinks_and_links_ends_in_enospc(kvfs_factory):
    fs = kvfs_factory(size="64M", mount_options=["eviction_policy=none"])
    fs.mkfs()
    fs.mount()
    committed = {f"data{i}": pattern(100 + i, MiB + i) for i in range(3)}
    for name, data in committed.items():
        write_file(fs.mnt / name, data, fsync=True)
    flood = fs.mnt / "flood"
    flood.mkdir()
    made = links = 0
    failure = None
    for i in range(100_000):
        try:
            os.symlink("t" * 4095, flood / long_name("s", i))
            made += 1
            if i % 4 == 0:
                os.link(fs.mnt / "data0", flood / long_name("h", i))
                links += 1
            if i % 100 == 0:
                try:
                    os.setxattr(flood / long_name("s", i), "user.big", b"v" * 65536, follow_symlinks=False)
                except OSError as exc:
                    assert exc.errno in (errno.EOPNOTSUPP, errno.EPERM), exc    # never stored
        except OSError as exc:
            failure = exc.errno
            break
    assert failure == errno.ENOSPC, f"the flood ended with {failure} after {made} symlinks"
    assert made > 500, made
    # The daemon is alive: it answers, serves committed files, and frees space on unlink.
    stats = fs.stats()
    assert stats["metadata_bytes"] <= stats["metadata_capacity"]
    for name, data in committed.items():
        assert (fs.mnt / name).read_bytes() == data
    assert os.stat(fs.mnt / "data0").st_nlink == 1 + links
    for i in range(0, 40, 4):
        os.unlink(flood / long_name("s", i))
    os.symlink("t" * 4095, flood / "after-unlinks")
    fs.umount()                                         # the checkpoint of a full slot fits
    fs.assert_fsck_clean()
    fs.mount()
    for name, data in committed.items():
        assert (fs.mnt / name).read_bytes() == data
    assert len(os.listdir(flood)) == made - 10 + links + 1
    assert os.readlink(flood / "after-unlinks") == "t" * 4095
