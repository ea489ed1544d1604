"""Content keys: which files hold which whole content, for /.kvfs/by-hash and ``user.kvfs.key``.

A content key is a keyed hash of a file's size and block keys (two hash calls
per file). Computing every file's key when the store loads took a quarter of the
load, and the index a dict entry per file, for a view that most mounts never
open. So the index is built on first use instead: the by-hash view awaits
:meth:`ContentIndex.ready`, which walks the files in slices (yielding to the
event loop between them); a single file's key (``user.kvfs.key``) is computed on
demand without the index.

States: *unbuilt* (keys of files are None unless asked for; nothing is in
``by_content``), *building* (the walk is running: contents that change are
entered at once, the walk skips them) and *built* (every committed content is
entered, and changes keep it so).

``by_content`` maps a content key to one inode number, or to a set of them when
dedup copies share it (see :meth:`owners`).
"""
from typing import Sequence
import trio

from ..schema.port import JournalPort
from .inodes import Inode, members, with_member, without_member

HOLE_KEY = b"\0" * 16           # stands for a hole in the bytes a content key hashes
SLICE = 2048                   # files keyed between two yields of the walk

_UNBUILT, _BUILDING, _BUILT = range(3)


class ContentIndex:
    journal: JournalPort

    def __init__(self, journal: JournalPort, inodes: dict[int, Inode]) -> None:
        self.journal = journal
        self.inodes = inodes       # the tree's live inodes (the same dict)
        self.by_content = {}
        self._state = _UNBUILT
        self._built = None         # trio.Event while the walk runs

    @property
    def built(self) -> bool:
        return self._state == _BUILT

    def key_of(self, size: int, keys: Sequence[bytes | None]) -> bytes:
        """The public key of a whole content: what ``user.kvfs.key`` shows and by-hash names.

        Block keys are domain-keyed, so the same bytes owned by two tenants get
        two keys; the public form reveals nothing about the secret behind them.
        """
        internal = self.journal.key_of(size.to_bytes(8, "little") + b"".join(k or HOLE_KEY for k in keys))
        return self.journal.public_id(internal)

    def key(self, inode: Inode) -> bytes:
        """``inode``'s content key (computed now if it was not)."""
        if inode.content_key is None:
            inode.content_key = self.key_of(inode.size_committed, inode.committed)
        return inode.content_key

    # -- changes ---------------------------------------------------------------
    def committed(self, inode: Inode) -> None:
        """``inode`` has a new committed content (its size_committed and committed)."""
        self.forget(inode)
        inode.content_key = None
        if self._state != _UNBUILT:
            self._enter(inode)

    def forget(self, inode: Inode) -> None:
        key = inode.content_key
        if key is None or key not in self.by_content:
            return
        owners = without_member(self.by_content[key], inode.ino)
        if owners:
            self.by_content[key] = owners
        else:
            del self.by_content[key]

    def _enter(self, inode):
        """Enter ``inode``'s content (idempotent)."""
        key = self.key(inode)
        self.by_content[key] = with_member(self.by_content.get(key), inode.ino)

    # -- queries ---------------------------------------------------------------
    def owners(self, key: bytes) -> set[int] | tuple[int, ...]:
        """The inode numbers whose committed content is ``key`` (a set or a tuple); needs :meth:`ready`."""
        return members(self.by_content.get(key))

    def _holds_content(self, inode):
        return inode.is_file and not inode.provisional

    async def ready(self) -> None:
        """Build the index if it is not built (yielding between slices); wait if another task builds it."""
        if self._state == _BUILT:
            return
        if self._state == _BUILDING:
            await self._built.wait()
            return
        self._state, self._built = _BUILDING, trio.Event()
        try:
            todo = list(self.inodes)
            for start in range(0, len(todo), SLICE):
                for ino in todo[start:start + SLICE]:
                    inode = self.inodes.get(ino)
                    if inode is not None and self._holds_content(inode):
                        self._enter(inode)         # a change meanwhile entered it already: no-op
                await trio.lowlevel.checkpoint()
            self._state = _BUILT
        except BaseException:
            self._state = _UNBUILT        # cancelled: the next user starts over
            self.by_content.clear()
            raise
        finally:
            self._built.set()

    def ready_now(self) -> None:
        """:meth:`ready` without yielding (sync callers; a large tree stalls the caller).

        Overtaking a walk in progress is harmless: it skips what is entered."""
        if self._state == _BUILT:
            return
        for inode in list(self.inodes.values()):
            if self._holds_content(inode):
                self._enter(inode)
        self._state = _BUILT
