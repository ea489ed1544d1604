"""The oracle of tests/test_stress.py: self-describing contents and what a read may return.

Contents
    A content is named by a *spec* ``(seed, length)``. Its bytes are 64-bit
    little-endian words, word ``k`` being ``seed << 32 | k``, cut to ``length``
    bytes. Any 8 aligned bytes of it therefore say which content and which
    offset they came from (``describe``), zeros never occur in one (seeds are
    >= 1), and two files with the same seed share every whole block at the same
    offsets (dedup), with the same spec they are identical.

History
    ``History`` records, under one lock, what every name and every file object
    (inode) held and when. A mutator records an event *before* its system call
    (``t_from`` is taken then) and closes it after the call returns (``t_to``),
    so a reader that checks after its own read sees every event that could have
    affected it, and each state is taken to hold from the start of the event
    that made it to the end of the event that replaced it: a state counts as
    possible wherever it might have held. Mutators of one name are serialized
    by the test (per-name locks), so each name's history is exact.

    A name holds an object or nothing. An object holds a full content, or is
    being rewritten in place (O_TRUNC, then the new content written in order)
    from one content to another.

What a read may return (``History.check_read``)
    Readers read whole files from offset 0. A name's read interval is
    [t0, t1], the open's [t0, t_open]; the object read is one the name held at
    some moment during the open, and its bytes must come from the contents that
    object held during [t0, t1]:

    * ENOENT only if the name held nothing at some moment during the open
      (a rename over a name never makes it vanish);
    * if no in-place rewrite of the object overlapped the read: exactly one of
      the complete contents, whole: no short read, no mix;
    * if one did: any state a rewrite passes through is legitimate, the old
      content, the empty file, and every prefix of the new content, and,
      because Linux does not make a buffered read atomic against a write (a
      read copies page by page, and an O_TRUNC truncates the page cache under
      it), a read may switch from one of those states to another at a 4 KiB
      page boundary, or where one of the states ends: an O_DIRECT read of a
      page-cache file that comes back short at the end of the state it met
      (the old content's end, or the end of a prefix of the new content:
      wherever the writer's last WRITE had reached) goes on through the page
      cache once the file has grown (generic_file_read_iter's fallback), so an
      O_DIRECT read may also switch where its first part, read from offset 0,
      stops being a prefix of a content being written. Every piece between
      those split points must be the bytes, at that offset, of one content
      the object held (the last piece may end early: a prefix, or EOF after a
      truncation). Never bytes from no content, never a piece mixing two
      contents within a page, never zeros;
    * except in a mapping: an mmap read copies a length taken when it mapped
      the file, and a mapping reads zeros past the file's end (POSIX zero-
      fills the partial page at the end; a page wholly past the end raises
      SIGBUS, counted apart, unless the fault came before the kernel learnt
      of an O_TRUNC the daemon had already done: then the kernel fills it
      with zeros). So when a rewrite shrank the file under the mapping, a
      piece of an mmap read may be zeros past the end of a state: the old
      content's end, the empty file's, or the end of any prefix of the new
      content (a piece may start with those bytes).
    * a buffered or mapped read copies each page while the writer's write() may
      be copying into that same page (the kernel locks a page for the writer's
      copy, not for a reader's; a reader's copy stops at a page fault of its own
      buffer, a mapping's at any point). So within a page such a read may switch
      once from one state's bytes to another's, where one copy overtook the other
      (seen under load: 244 bytes of the old content, then the new). Not to
      zeros: nothing zeroes a page in place under a reader in these workloads.

    Anything else is a ``Violation`` naming the name, offset, what was allowed
    and what was read.
"""
import dataclasses
import functools
import math
import threading

import numpy as np

PAGE = 4096
EMPTY = (0, 0)                   # the spec of an empty file


@functools.lru_cache(maxsize=512)
def content(seed, length):
    words = -(-length // 8)
    return (np.arange(words, dtype="<u8") | np.uint64(seed << 32)).tobytes()[:length]


def describe(data, off):
    """What the bytes at ``data[off:]`` are: which content's word, or zeros."""
    chunk = data[off:off + 16]
    if not chunk:
        return "nothing (the read ended here)"
    if not any(chunk):
        return f"zeros ({chunk[:16].hex()})"
    aligned = off - off % 8
    word = int.from_bytes(data[aligned:aligned + 8].ljust(8, b"\0"), "little")
    return (f"{chunk.hex()} = word {word & 0xffffffff} (offset {8 * (word & 0xffffffff)}) "
            f"of seed {word >> 32}")


class Violation(AssertionError):
    pass


@dataclasses.dataclass
class Seg:
    """What a name or object held from ``t_from`` to ``t_to`` (None: still holds)."""
    value: object                 # name: object id or None; object: ("full", spec) or ("rewrite", spec)
    t_from: float
    t_to: float | None = None

    def overlaps(self, a, b):
        return self.t_from <= b and (self.t_to is None or self.t_to >= a)


class History:
    def __init__(self):
        self.lock = threading.Lock()
        self.names = {}               # name -> [Seg(object id or None)]
        self.objects = {}             # object id -> [Seg(("full"|"rewrite", spec))]
        self._next_obj = 1

    # -- recording (callers hold the name's lock, so "current" is exact) ------
    def _name_segs(self, name):
        return self.names.setdefault(name, [Seg(None, -math.inf)])

    def current(self, name):
        with self.lock:
            return self._name_segs(name)[-1].value

    def spec_of(self, obj):
        with self.lock:
            return self.objects[obj][-1].value[1]

    def new_object(self, spec, now):
        """A new object holding ``spec`` from ``now`` on: a temp file written and
        closed, or ``EMPTY`` for a file an in-place rewrite is about to create."""
        with self.lock:
            obj = self._next_obj
            self._next_obj += 1
            self.objects[obj] = [Seg(("full", spec), now)]
            return obj

    def begin(self, changes, now):
        """Start changes: ``("name", name, object id or None)`` and in-place rewrites
        ``("obj", object id, new spec)``; returns a token for ``end``."""
        with self.lock:
            token = []
            for kind, key, value in changes:
                segs = self._name_segs(key) if kind == "name" else self.objects[key]
                if kind == "name":
                    new = [Seg(value, now)]
                else:
                    new = [Seg(("rewrite", value), now), Seg(("full", value), now)]
                token.append((segs, segs[-1], new))
                segs.extend(new)
            return token

    def end(self, token, now, *, happened=True):
        """Close the changes of ``token``: they took effect by ``now``, or did not happen."""
        with self.lock:
            for segs, old, new in token:
                if happened:
                    old.t_to = now
                    if len(new) == 2:
                        new[0].t_to = now          # the rewrite's intermediate states are over
                else:
                    for s in new:
                        segs.remove(s)

    # -- checking ---------------------------------------------------------------
    def final(self):
        """name -> spec of what each name holds now (every mutator has finished)."""
        with self.lock:
            return {name: self.objects[segs[-1].value][-1].value[1]
                    for name, segs in self.names.items() if segs[-1].value is not None}

    def check_read(self, name, t0, t_open, t1, data, kind="buffered"):
        """Raise Violation unless ``data`` (None: ENOENT) is a legitimate read of ``name``
        by a reader of ``kind`` ("buffered", "O_DIRECT" or "mmap")."""
        with self.lock:
            held = [s.value for s in self._name_segs(name) if s.overlaps(t0, t_open)]
            states = {obj: [s.value for s in self.objects[obj] if s.overlaps(t0, t1)]
                      for obj in held if obj is not None}
        if data is None:
            if None in held:
                return
            raise Violation(f"{name}: ENOENT, but it held objects {sorted(states)} throughout the "
                            f"open ({t0:.4f}..{t_open:.4f})")
        if not states:
            raise Violation(f"{name}: read {len(data)} bytes, but it held nothing during the open")
        problems = []
        for obj, values in states.items():
            specs = list(dict.fromkeys(spec for _, spec in values))
            if any(content(*spec) == data for spec in specs):
                return
            rewritten = any(kind == "rewrite" for kind, _ in values)
            if rewritten:
                targets = {spec for k, spec in values if k == "rewrite"}
                # Where an O_DIRECT read's direct part may have stopped (see the module doc).
                direct_ends = {_prefix_length(data, content(*t)) for t in targets} if kind == "O_DIRECT" else ()
                problem = _piecewise(data, specs, PAGE, prefix_states=targets if kind == "mmap" else None,
                                     extra_cuts=direct_ends, torn_pages=kind in ("mmap", "buffered"))
                if problem is None:
                    return
            else:
                problem = _first_difference(data, specs)
            problems.append(f"object {obj} (states {values}): {problem}")
        raise Violation(f"{name}: read {len(data)} bytes during {t0:.4f}..{t1:.4f} that no legitimate "
                        f"state explains:\n    " + "\n    ".join(problems))


def _first_difference(data, specs):
    """Where ``data`` parts from the closest complete content: offset, expected, got."""
    best = None
    for spec in specs:
        want = content(*spec)
        first = _common(data, want)
        if best is None or first > best[0]:
            best = (first, spec, want)
    first, spec, want = best
    return (f"differs from {spec} (length {len(want)}) at offset {first}: expected "
            f"{describe(want, first)}, got {describe(data, first)}")


def _piecewise(data, specs, granule, *, prefix_states=None, extra_cuts=(), torn_pages=False):
    """None if every piece of ``data`` between split points is one content's bytes
    there, else why not. Split points: every ``granule`` boundary, and the end of
    each content (where a read that met a state's EOF went on after the file grew),
    and ``extra_cuts``.
    ``prefix_states`` (a mapping; the contents whose every prefix was a state): a
    piece may also be zeros past the end of a state: the bytes there of one
    content up to its end (or anywhere, for those in ``prefix_states``), or
    none (the empty file), then only zeros.
    ``torn_pages``: a piece may also switch once from one content's bytes to another's."""
    longest = max(len(content(*s)) for s in specs)
    if len(data) > longest:
        return f"{len(data)} bytes, longer than every state ({longest})"
    ends = {len(content(*s)) for s in specs}
    cuts = sorted(set(range(0, len(data), granule)) | {n for n in (*ends, *extra_cuts) if 0 < n < len(data)})
    for off, stop in zip(cuts, cuts[1:] + [len(data)]):
        piece = data[off:stop]
        if any(content(*s)[off:off + len(piece)] == piece for s in specs):
            continue
        if prefix_states is not None and any(_past_the_end(piece, off, s, s in prefix_states) for s in specs):
            continue
        if torn_pages and _one_switch(piece, off, specs):
            continue
        candidates = "; ".join(f"{s}: {describe(content(*s), off)}, the read matches it for "
                               f"{_common(content(*s)[off:], piece)} bytes, then has "
                               f"{describe(data, off + _common(content(*s)[off:], piece))}"
                               for s in specs)
        return (f"the piece [{off}, {stop}) is from no state: got "
                f"{describe(data, off)}; expected one of {candidates}")
    return None


def _one_switch(piece, off, specs):
    """``piece`` at ``off`` is one state's bytes up to some point and another's from
    there: a reader's copy of a page that the writer's copy overtook, or the other way."""
    for first in specs:
        n = _common(piece, content(*first)[off:off + len(piece)])
        if n == 0:
            continue
        rest = piece[n:]
        for second in specs:
            if second == first:
                continue
            if content(*second)[off + n:off + len(piece)] == rest:
                return True
    return False


def _prefix_length(a, b):
    """The length of the common prefix of ``a`` and ``b``, by bisection (whole-slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common(a, b):
    """The length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _past_the_end(piece, off, spec, any_prefix):
    """``piece`` at ``off`` is, in a mapping, zeros past the end of a state: the bytes
    of ``spec`` there up to its end (or up to anywhere if ``any_prefix``), then zeros."""
    want = content(*spec)[off:off + len(piece)]
    n = _common(piece, want)
    if any(piece[n:]):
        return False
    # The common prefix may run into zero bytes of the content (every word's high
    # half starts with zeros); it is a state's end if some cut of it is one.
    return any_prefix or n >= len(want) or not any(piece[:n]) or off + n >= len(content(*spec))
