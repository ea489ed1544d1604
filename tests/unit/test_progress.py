"""Progress lines of long work (fsck's read-back, flush, evict) on a terminal."""
import io

from kvfs.server import fsck
from kvfs.cli import progress

from kvfs.namespace import ROOT_INO

from .helpers import mkfs, open_fs, pattern, running, write_file


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_line_has_done_total_rate_and_time_left():
    text = progress.line("verifying blocks", 1 << 30, 4 << 30, 2.0)
    assert text == "verifying blocks: 1.0 GiB of 4.0 GiB (25%), 512.0 MiB/s, 7 s left"
    assert progress.line("evicting", 3 << 20, None, 1.0) == "evicting: 3.0 MiB, 3.0 MiB/s"


def test_nothing_is_shown_off_a_terminal_and_a_terminal_line_is_cleared():
    quiet = progress.Progress("x", out=io.StringIO())
    quiet.update(1, 2)
    quiet.close()
    assert not quiet.lines and quiet.out.getvalue() == ""
    tty = Terminal()
    shown = progress.Progress("x", out=tty)
    shown.update(5, 10)
    shown.close()
    assert len(shown.lines) == 1 and shown.lines[0].startswith("x: 5 B of 10 B (50%), ")
    assert tty.getvalue().endswith("\r\033[K")


async def test_fsck_reports_the_bytes_it_verified(tmp_path, monkeypatch):
    path = mkfs(tmp_path)
    fs = open_fs(path)
    async with running(fs):
        for i in range(3):
            await write_file(fs.ns, ROOT_INO, f"f{i}".encode(), pattern(i, 200_000))
    fs.close()
    monkeypatch.setattr(progress, "INTERVAL", 0.0)
    seen = []

    class Sink:
        def update(self, done, total):
            seen.append((done, total))

    report = fsck.check(str(path), progress=Sink())
    assert report.clean
    total = seen[-1][1]
    assert seen[-1][0] == total and total >= 3 * 200_000
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
