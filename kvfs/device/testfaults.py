"""Injected device faults, for tests only: a wrapper around a real, open Device.

``FaultyDevice(device, plan)`` takes over an open :class:`kvfs.device.Device`
by interposing on its system calls (``Device._sys_preadv`` and ``_sys_preadv_many``, ``_sys_pwrite``,
``_sys_fdatasync``, ``_sys_discard``). Everything above them is the real Device
code: alignment, the retry loop, the short-transfer checks, the DeviceError
wrapping and the statistics all run unchanged over the injected faults. Every
other attribute and method (``pread_sync``, ``run``, ``statistics``, ``path``,
``limiter`` ...) is the wrapped device's own, so the wrapper goes wherever a
Device goes. Delays run in the calling thread; the stack calls the device from
worker threads (``Device.run``), so the trio loop never sleeps.

A plan is a list of rules, or ``{"seed": N, "rules": [...]}``. The seed (0 by
default) seeds the random draws, so a single-threaded test sees the same faults
every run. A rule is a JSON object::

    {"op": "read" | "write" | "sync" | "discard" | "any",   default "any"
     "range": [start, end],    device bytes [start, end): the call must overlap
                               them (a sync has no offset, so it matches only
                               rules without a range); default: everywhere
     "probability": p,         chance that a matching call fires, default 1
     "count": n,               fire at most n times; default: no limit
     "effect": one of
        "delay"  sleep "seconds" before the call (a slow device, a latency spike)
        "eio"    the call fails with EIO; Device raises its usual DeviceError.
                 With "seconds", only inside a window like a stall's: a path
                 loss whose errors come back at once (fast_io_fail_tmo), which
                 the device retries for its bounded reconnect time
        "short"  read or write: the call transfers half of what was asked, in
                 whole sectors, so nothing at all when one sector is asked: a
                 zero-byte transfer, which Device retries within its retry
                 window (io_retry) like a lost path's error, and which is an
                 error at once without a window. A short call that moved
                 something is absorbed by Device's transfer loop, which asks
                 for the rest; a rule that keeps firing ends in Device's
                 short-read / no-progress error (after the window, if any).
        "stall"  a path-loss window of "seconds", starting "after" seconds
                 (default 0) after the plan was loaded: a call that arrives in
                 the window waits until the window ends, then proceeds (an
                 NVMe-oF controller reconnect; one longer than io_timeout is
                 a hung path: the caller gets EIO, the call lands late)
        "flip"   read: one bit of the bytes read inside the range is flipped,
                 silently; the block index's checksum must catch it
     "seconds": s, "after": s}

Every rule that fires on a call applies: the sleeps first (delays add up, a
stall waits for its window's end), then "eio" fails the call, else the call
runs ("short" if such a rule fired) and then the bit flips. ``injected()``
counts what was injected, by effect.

Test hook for a mounted daemon: the environment variable ``KVFS_TEST_FAULTS``,
read by ``from_environment`` when the daemon opens its device. Its value is the
plan as JSON text, or ``@PATH`` of a JSON file. A file is checked again, at
most every ``RELOAD_INTERVAL`` seconds on the next device call, and reloaded
when its mtime, size or inode changes: a test changes the plan of a running
daemon by renaming a new plan file over it (tests/kvfsmount.py
``KvfsMount.set_faults``). A reload restarts the plan: its stall windows are
measured from the reload, and its counts and random draws start afresh. This
is not a mount option and not part of the user documentation.

What the old mount option ``write_delay_ms=N`` did is the plan
``[{"op": "write", "effect": "delay", "seconds": N / 1000}]``.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import random
import threading
import time
from typing import Any, Mapping

from ..base.aligned import SECTOR
from ..errors import InvalidArgument, KvfsError
from . import Device

log = logging.getLogger(__name__)

ENV = "KVFS_TEST_FAULTS"
RELOAD_INTERVAL = 0.1
OPS = ("read", "write", "sync", "discard", "any")
EFFECTS = ("delay", "eio", "short", "stall", "flip")
_EFFECT_OPS = {"short": ("read", "write", "any"), "flip": ("read", "any")}


@dataclasses.dataclass(frozen=True)
class Rule:
    effect: str
    op: str = "any"
    range: tuple[int, int] | None = None
    probability: float = 1.0
    count: int | None = None
    seconds: float = 0.0
    after: float = 0.0

    def matches(self, op: str, off: int | None, length: int) -> bool:
        if self.op not in ("any", op):
            return False
        if self.range is None:
            return True
        return off is not None and off < self.range[1] and off + max(length, 1) > self.range[0]


@dataclasses.dataclass(frozen=True)
class Plan:
    rules: tuple[Rule, ...] = ()
    seed: int = 0


def _bad(message):
    return InvalidArgument(f"bad fault plan: {message}")


def _rule(obj, i) -> Rule:
    if not isinstance(obj, dict):
        raise _bad(f"rule {i} is not an object")
    unknown = set(obj) - {f.name for f in dataclasses.fields(Rule)}
    if unknown:
        raise _bad(f"rule {i} has unknown keys {sorted(unknown)}")
    try:
        rule = Rule(**obj)
        if rule.range is not None:
            lo, hi = rule.range
            rule = dataclasses.replace(rule, range=(int(lo), int(hi)))
        probability, seconds, after = float(rule.probability), float(rule.seconds), float(rule.after)
    except (TypeError, ValueError) as exc:
        raise _bad(f"rule {i}: {exc}") from None
    if rule.effect not in EFFECTS:
        raise _bad(f"rule {i}: effect {rule.effect!r} is not one of {', '.join(EFFECTS)}")
    if rule.op not in _EFFECT_OPS.get(rule.effect, OPS):
        raise _bad(f"rule {i}: effect {rule.effect!r} cannot apply to op {rule.op!r}")
    if rule.range is not None and not 0 <= rule.range[0] < rule.range[1]:
        raise _bad(f"rule {i}: range {list(rule.range)} is empty or negative")
    if not 0.0 <= probability <= 1.0:
        raise _bad(f"rule {i}: probability {rule.probability} is not in [0, 1]")
    if rule.count is not None and (not isinstance(rule.count, int) or rule.count < 1):
        raise _bad(f"rule {i}: count {rule.count!r} is not a positive integer")
    if rule.effect in ("delay", "stall") and not seconds > 0:
        raise _bad(f"rule {i}: effect {rule.effect!r} needs \"seconds\" > 0")
    if after < 0:
        raise _bad(f"rule {i}: \"after\" is negative")
    return dataclasses.replace(rule, probability=probability, seconds=seconds, after=after)


def parse_plan(plan: Plan | str | bytes | list | dict) -> Plan:
    """A Plan from JSON text, a list of rules or ``{"seed", "rules"}``; KvfsError (EINVAL) if bad."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, bytes)):
        try:
            plan = json.loads(plan)
        except ValueError as exc:
            raise _bad(f"not JSON ({exc})") from None
    seed = 0
    if isinstance(plan, dict):
        if set(plan) - {"seed", "rules"}:
            raise _bad(f"unknown keys {sorted(set(plan) - {'seed', 'rules'})}")
        seed, plan = plan.get("seed", 0), plan.get("rules", [])
        if not isinstance(seed, int):
            raise _bad(f"seed {seed!r} is not an integer")
    if not isinstance(plan, list):
        raise _bad("expected a list of rules or {\"seed\": N, \"rules\": [...]}")
    return Plan(tuple(_rule(r, i) for i, r in enumerate(plan)), seed)


def _signature(path):
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size, st.st_ino


class FaultyDevice:
    """A Device whose system calls fail, stall or lie according to a plan."""

    def __init__(self, device: Device, plan: Plan | str | bytes | list | dict, *,
                 plan_file: str | None = None) -> None:
        self._lock = threading.Lock()
        self.wrapped = device
        self._plan_file = plan_file
        self._sig = None
        self._next_check = 0.0
        self._injected = dict.fromkeys(EFFECTS, 0)
        self._arm(parse_plan(plan))
        preadv, pwrite, fdatasync, discard = (device._sys_preadv, device._sys_pwrite,
                                              device._sys_fdatasync, device._sys_discard)
        # Instance attributes shadow Device's methods: the real code now calls these.
        device._sys_preadv = lambda view, off: self._transfer("read", preadv, view, off)
        # A run read goes block by block under the plan, so every rule sees the
        # same calls it would see for single-block reads.
        device._sys_preadv_many = lambda views, off: self._transfer_many(preadv, views, off)
        device._sys_pwrite = lambda view, off: self._transfer("write", pwrite, view, off)
        device._sys_fdatasync = lambda: self._plain("sync", None, 0, fdatasync)
        device._sys_discard = lambda off, n: self._plain("discard", off, n, discard, off, n)

    @classmethod
    def from_file(cls, device: Device, path: str) -> FaultyDevice:
        """Load the plan from the JSON file ``path``, and reload it whenever the file changes."""
        try:
            sig = _signature(path)
            with open(path, "rb") as f:
                text = f.read()
        except OSError as exc:
            raise _bad(f"cannot read {path}: {exc.strerror}") from None
        faulty = cls(device, text, plan_file=path)
        faulty._sig = sig
        return faulty

    # -- the device's own attributes and methods, read and written through --
    def __getattr__(self, name):
        if name == "wrapped":                   # not set yet (mid-__init__, copy): no recursion
            raise AttributeError(name)
        return getattr(self.wrapped, name)

    def __setattr__(self, name, value):
        if name.startswith("_") or name == "wrapped":
            object.__setattr__(self, name, value)
        else:
            setattr(self.wrapped, name, value)

    def injected(self) -> dict[str, int]:
        """How many faults were injected, by effect (over every plan loaded)."""
        with self._lock:
            return dict(self._injected)

    # -- the plan ---------------------------------------------------------
    def _arm(self, plan):
        self._plan = plan
        self._rng = random.Random(plan.seed)
        self._fired = [0] * len(plan.rules)
        self._armed = time.monotonic()

    def _maybe_reload(self, now):
        if self._plan_file is None or now < self._next_check:
            return
        with self._lock:
            if now < self._next_check:
                return
            self._next_check = now + RELOAD_INTERVAL
            try:
                sig = _signature(self._plan_file)
                if sig == self._sig:
                    return
                self._sig = sig
                with open(self._plan_file, "rb") as f:
                    plan = parse_plan(f.read())
            except (OSError, KvfsError) as exc:
                log.error("fault plan %s not reloaded, keeping the old one: %s", self._plan_file, exc)
                return
            self._arm(plan)
        log.warning("fault plan reloaded from %s: %d rules", self._plan_file, len(plan.rules))

    def _inject(self, op, off, length):
        """Decide which rules fire on this call, sleep for them, raise EIO; returns the rest."""
        self._maybe_reload(time.monotonic())
        fired, delay = [], 0.0
        with self._lock:
            # Read under the lock: a reload (by this call or another thread) starts its
            # windows then, and a call that waited for it must count as inside them.
            now = time.monotonic()
            stall_end = now
            for i, rule in enumerate(self._plan.rules):
                if not rule.matches(op, off, length):
                    continue
                if rule.count is not None and self._fired[i] >= rule.count:
                    continue
                start = self._armed + rule.after
                windowed = rule.effect == "stall" or (rule.effect == "eio" and rule.seconds)
                if windowed and not start <= now < start + rule.seconds:
                    continue
                if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                    continue
                self._fired[i] += 1
                if rule.effect != "flip":           # counted when a bit really flips
                    self._injected[rule.effect] += 1
                if rule.effect == "delay":
                    delay += rule.seconds
                elif rule.effect == "stall":
                    stall_end = max(stall_end, start + rule.seconds)
                fired.append(rule)
        if delay or stall_end > now:
            time.sleep(delay + stall_end - now)
        if any(rule.effect == "eio" for rule in fired):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return fired

    def _flip(self, view, off, n, rule):
        lo, hi = off, off + n
        if rule.range is not None:
            lo, hi = max(lo, rule.range[0]), min(hi, rule.range[1])
        if hi <= lo:
            return
        with self._lock:
            pos = self._rng.randrange(lo, hi) - off
            bit = self._rng.randrange(8)
            self._injected["flip"] += 1
        view[pos] ^= 1 << bit

    def _transfer(self, op, call, view, off):
        """One preadv or pwrite under the plan; "short" moves half, in whole sectors."""
        fired = self._inject(op, off, len(view))
        want = len(view) // 2 // SECTOR * SECTOR if any(r.effect == "short" for r in fired) else len(view)
        n = call(view[:want], off) if want else 0
        for rule in fired:
            if rule.effect == "flip":
                self._flip(view, off, n, rule)
        return n

    def _transfer_many(self, call, views, off):
        done = 0
        for view in views:
            n = self._transfer("read", call, view, off + done)
            done += n
            if n < len(view):
                break
        return done

    def _plain(self, op, off, length, call, *args):
        """A sync or discard under the plan: delays, stalls and EIO apply to it."""
        self._inject(op, off, length)
        return call(*args)


def from_environment(device: Device, environ: Mapping[str, str] = os.environ) -> Device | FaultyDevice:
    """The test hook: ``device`` wrapped by the plan in $KVFS_TEST_FAULTS, or ``device`` itself."""
    value = environ.get(ENV)
    if not value:
        return device
    if value.startswith("@"):
        faulty = FaultyDevice.from_file(device, value[1:])
    else:
        faulty = FaultyDevice(device, value)
    log.warning("%s is set: injecting faults into %s (%d rules); this is a test hook",
                ENV, device.path, len(faulty._plan.rules))
    return faulty
