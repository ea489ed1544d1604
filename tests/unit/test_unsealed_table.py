"""The namespace's table of unsealed files: the seal scans visit it instead of every inode.

Sealing records a file's content once its writers are done; flush_all (unmount,
kvfs-admin flush) seals every file still unsealed. A file the table missed would
never be recorded: its data lost at the next mount. So content_dirty may be set in
one place only, which also enters the file in the table.
"""
import os
import re
from pathlib import Path

from kvfs.namespace import ROOT_INO

from .helpers import close_and_check, mkfs, open_fs, pattern, read_all, running, wait_until

KVFS = Path(__file__).resolve().parents[2] / "kvfs"


def test_content_dirty_is_set_only_where_the_table_learns_of_it():
    setters = []
    for path in KVFS.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\.content_dirty\s*=\s*True", line):
                setters.append((path.relative_to(KVFS).as_posix(), line.strip()))
    assert setters == [("namespace/durability.py", "inode.content_dirty = True")], setters
    source = (KVFS / "namespace" / "durability.py").read_text()
    assert "inode.content_dirty = True\n        self._unsealed[inode.ino] = inode" in source


async def test_background_sealing_and_flush_all_find_every_unsealed_file(tmp_path):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    ns = fs.ns
    contents = {b"f%03d" % i: pattern(i, 3000 + i) for i in range(60)}
    async with running(fs, commit_interval=0.05):
        inos, handles = {}, []
        for name, data in contents.items():
            # Held open for writing: nothing seals them until they are closed.
            ino = inos[name] = ns.make(ROOT_INO, name, 0o100644, 0, 0)
            fh, _, _ = ns.open(ino, os.O_WRONLY)
            await ns.write(fh, 0, data)
            handles.append(fh)
        assert set(ns._unsealed) == set(inos.values())
        # Unlinked before they were sealed: they leave the table, nothing else does.
        for name in list(contents)[:10]:
            ns.unlink(ROOT_INO, name, directory=False)
            del contents[name]
        for fh in handles:
            await ns.release(fh)
        for name in [n for n in inos if n not in contents]:
            ns.forget(inos.pop(name), 1)
        await wait_until(lambda: not ns._unsealed, what="the background seal of every file")
        assert all(not ns.inode(ino).content_dirty for ino in inos.values())
        # Rewritten: unsealed again, and flush_all (not the background) seals it.
        name = next(iter(contents))
        contents[name] = pattern(99, 5000)
        fh, _, _ = ns.open(inos[name], os.O_WRONLY | os.O_TRUNC)
        await ns.write(fh, 0, contents[name])
        assert ns._unsealed == {inos[name]: ns.inode(inos[name])}
        await ns.flush_all()                       # seals open files too
        assert not ns._unsealed and not ns.inode(inos[name]).content_dirty
        await ns.release(fh)
    close_and_check(fs)
    fs = open_fs(path)
    async with running(fs):
        for name, data in contents.items():
            assert await read_all(fs.ns, inos[name]) == data
    close_and_check(fs)
