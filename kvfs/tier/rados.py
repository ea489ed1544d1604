"""The RADOS backend of the shared tier, over librados through Debian's python3-rados.

python3-rados is Ceph's own binding (Cython, built for CPython 3.11 like our
interpreter), and it drops the GIL around every librados call. It lives in the
system's dist-packages, which a virtualenv does not see: :func:`load_rados` loads
that one extension module by its path, without putting the whole dist-packages
directory on ``sys.path``. A ctypes layer over librados2 would need its own
completion handling and error mapping for the same four calls.

Every call runs in a worker thread behind a ``trio.CapacityLimiter`` and under a
deadline: a cluster that does not answer costs a caller the deadline, never a hang.
librados's own op timeouts (set from the deadline) end the abandoned thread later,
and it holds its limiter token until then, so stuck calls never pile up.
"""
from __future__ import annotations

import errno
import glob
import importlib.util
import logging
import sys
import threading
import time
from typing import Any, Callable

import trio

from .backend import TierDenied, TierError, TierTimeout, TierUnavailable

log = logging.getLogger(__name__)

DIST_PACKAGES = ("/usr/lib/python3/dist-packages",)
MADE_XATTR = "kvfs.made"         # creation time (ns) of objects put_if_absent made
# Seconds one connection try may take (cephx with the mon, then the osdmap). Not the
# lookup deadline: no lookup waits for a connection (they miss at once until there is
# one), so nothing gains from a short try, and a mon that answers in 1.5 s should not
# leave a host without the tier for the next retry_s.
CONNECT_TIMEOUT = 5.0


def load_rados():
    """The ``rados`` module (python3-rados): from ``sys.path`` if there, else from dist-packages."""
    if "rados" in sys.modules:
        return sys.modules["rados"]
    try:
        import rados            # noqa: F401  (installed into the interpreter itself)
        return rados
    except ImportError:
        pass
    tag = sys.implementation.cache_tag           # cpython-311
    for folder in DIST_PACKAGES:
        for path in sorted(glob.glob(f"{folder}/rados.{tag}-*.so")):
            spec = importlib.util.spec_from_file_location("rados", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules["rados"] = module
            try:
                spec.loader.exec_module(module)
            except Exception:
                del sys.modules["rados"]
                raise
            return module
    raise TierUnavailable("python3-rados is not installed (apt-get install python3-rados), "
                          f"or not built for this Python ({tag})")


def _map_error(rados, exc: Exception, what: str) -> TierError:
    if isinstance(exc, TierError):
        return exc
    if isinstance(exc, getattr(rados, "PermissionError", ())) or getattr(exc, "errno", None) in (errno.EACCES, errno.EPERM):
        return TierDenied(f"{what}: permission denied by the cluster")
    if isinstance(exc, getattr(rados, "TimedOut", ())) or getattr(exc, "errno", None) == errno.ETIMEDOUT:
        return TierTimeout(f"{what}: the cluster did not answer")
    return TierError(f"{what}: {exc}")


class RadosBackend:
    """One pool, one RADOS namespace (the tenant's), one cephx user.

    ``connect()`` tries once, within ``connect_timeout`` (the mount goes on without the
    tier when it fails, and :meth:`ensure_connected` tries again later, at most every
    ``retry_s``). Calls on a backend that is not connected fail at once with
    :class:`TierUnavailable`.
    """

    def __init__(self, *, conf: str, ceph_id: str, pool: str, namespace: str, deadline: float = 2.0,
                 concurrency: int = 8, retry_s: float = 5.0, connect_timeout: float = CONNECT_TIMEOUT,
                 limiter: trio.CapacityLimiter | None = None):
        self.conf, self.ceph_id, self.pool, self.namespace = conf, ceph_id, pool, namespace
        self.deadline = deadline
        self.connect_timeout = max(1.0, connect_timeout)
        self.limiter = limiter or trio.CapacityLimiter(concurrency)
        self.retry_s = retry_s
        self._rados = load_rados()
        self._cluster = None
        self._ioctx = None
        self._connecting = False
        self._last_try = -1e9
        self.last_error: str | None = None
        self._running = 0               # librados calls in worker threads, abandoned ones too
        self._running_lock = threading.Lock()

    # -- connection -----------------------------------------------------------------------
    def _op_timeout(self) -> str:
        return str(max(10, int(self.deadline * 2 + 0.999)))

    def _connect_sync(self):
        rados = self._rados
        cluster = rados.Rados(conffile=self.conf, rados_id=self.ceph_id,
                              conf={"rados_osd_op_timeout": self._op_timeout(),
                                    "rados_mon_op_timeout": self._op_timeout(),
                                    "log_to_stderr": "false", "err_to_stderr": "false"})
        try:
            cluster.connect(timeout=int(self.connect_timeout + 0.999))
            ioctx = cluster.open_ioctx(self.pool)
            ioctx.set_namespace(self.namespace)
        except BaseException:
            try:
                cluster.shutdown()
            except Exception:
                pass
            raise
        return cluster, ioctx

    @property
    def connected(self) -> bool:
        return self._ioctx is not None

    async def connect(self) -> None:
        """Connect now; raise :class:`TierUnavailable` (with the reason) after ``connect_timeout``."""
        if self._ioctx is not None:
            return
        if self._connecting:
            raise TierUnavailable("connecting to the cluster")
        self._connecting = True
        self._last_try = time.monotonic()
        try:
            # connect() is bounded by client_mount_timeout; the trio deadline is a backstop.
            with trio.move_on_after(self.connect_timeout + 3) as scope:
                try:
                    self._cluster, self._ioctx = await trio.to_thread.run_sync(
                        self._connect_sync, abandon_on_cancel=True)
                except Exception as exc:
                    self.last_error = f"cannot reach the Ceph cluster ({self.conf}, client.{self.ceph_id}, " \
                                      f"pool {self.pool}): {exc}"
                    raise TierUnavailable(self.last_error) from None
            if scope.cancelled_caught:
                self.last_error = f"cannot reach the Ceph cluster ({self.conf}): no answer in {self.connect_timeout + 3:.0f}s"
                raise TierUnavailable(self.last_error)
            self.last_error = None
        finally:
            self._connecting = False

    async def ensure_connected(self) -> bool:
        """Connect if not connected and the last try is ``retry_s`` old; whether connected."""
        if self._ioctx is None and not self._connecting and time.monotonic() - self._last_try >= self.retry_s:
            try:
                await self.connect()
            except TierUnavailable as exc:
                log.warning("shared tier: %s", exc)
        return self._ioctx is not None

    def close(self) -> None:
        """Close the connection once no call runs on it (an abandoned call ends by librados's op
        timeout): closing under a running call would crash librados. Left open after that."""
        ioctx, cluster, self._ioctx, self._cluster = self._ioctx, self._cluster, None, None
        deadline = time.monotonic() + float(self._op_timeout()) + 2
        while self._running and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._running:
            log.warning("shared tier: %d librados calls still running; the connection is left open", self._running)
            return
        if ioctx is not None:
            try:
                ioctx.close()
            except Exception:
                pass
        if cluster is not None:
            try:
                cluster.shutdown()
            except Exception:
                pass

    # -- the four calls ---------------------------------------------------------------------
    async def _call(self, what: str, fn: Callable[..., Any], *args, timeout: float | None = None):
        ioctx = self._ioctx
        if ioctx is None:
            raise TierUnavailable(self.last_error or "not connected to the Ceph cluster")
        timeout = timeout or self.deadline
        with trio.move_on_after(timeout) as scope:
            try:
                return await trio.to_thread.run_sync(self._counted, fn, ioctx, *args, limiter=self.limiter,
                                                     abandon_on_cancel=True)
            except Exception as exc:
                raise _map_error(self._rados, exc, what) from None
        raise TierTimeout(f"{what}: no answer from the cluster within {timeout}s")

    def _counted(self, fn, *args):
        with self._running_lock:
            self._running += 1
        try:
            return fn(*args)
        finally:
            with self._running_lock:
                self._running -= 1

    def _get_sync(self, ioctx, name, max_size):
        try:
            data = ioctx.read(name, max_size + 1)
        except self._rados.ObjectNotFound:
            return None
        return bytes(data)

    def _put_sync(self, ioctx, name, data):
        op = ioctx.create_write_op()
        try:
            op.new(self._rados.LIBRADOS_CREATE_EXCLUSIVE)
            op.write_full(data)
            # When it was made, for the janitor (stat's mtime came back 0 on memstore).
            op.set_xattr(MADE_XATTR, str(time.time_ns()).encode())
            try:
                ioctx.operate_write_op(op, name)
            except self._rados.ObjectExists:
                return False
            return True
        finally:
            ioctx.release_write_op(op)

    def _exists_sync(self, ioctx, name):
        try:
            ioctx.stat(name)
            return True
        except self._rados.ObjectNotFound:
            return False

    def _delete_sync(self, ioctx, name):
        try:
            ioctx.remove_object(name)
            return True
        except self._rados.ObjectNotFound:
            return False

    def _list_sync(self, ioctx, limit):
        out = []
        for obj in ioctx.list_objects():
            if obj.nspace != self.namespace:
                continue
            size, mtime = ioctx.stat(obj.key)
            try:
                made = int(ioctx.get_xattr(obj.key, MADE_XATTR)) / 1e9
            except (self._rados.Error, ValueError):
                made = time.mktime(mtime)
            out.append((obj.key, size, made))
            if len(out) >= limit:
                break
        return out

    async def get(self, name: str, max_size: int) -> bytes | None:
        """The object's bytes (up to ``max_size`` + 1: a longer object shows as too long), or None."""
        return await self._call(f"get {name}", self._get_sync, name, max_size)

    async def put_if_absent(self, name: str, data: bytes, *, timeout: float | None = None) -> bool:
        """Create the object with ``data`` unless it exists (one exclusive-create op); False: it did.
        ``timeout``: a longer bound than the deadline, for publishing in the background."""
        return await self._call(f"put {name}", self._put_sync, name, data, timeout=timeout)

    async def exists(self, name: str) -> bool:
        return await self._call(f"stat {name}", self._exists_sync, name)

    async def delete(self, name: str) -> bool:
        return await self._call(f"delete {name}", self._delete_sync, name)

    async def listing(self, limit: int = 100_000) -> list[tuple[str, int, float]]:
        """(name, size, made) of up to ``limit`` objects of our namespace, ``made`` in seconds
        since the epoch (our creation stamp, else RADOS's mtime): for the janitor."""
        with trio.move_on_after(max(self.deadline, 30)):
            ioctx = self._ioctx
            if ioctx is None:
                raise TierUnavailable(self.last_error or "not connected")
            return await trio.to_thread.run_sync(self._counted, self._list_sync, ioctx, limit, limiter=self.limiter,
                                                 abandon_on_cancel=True)
        raise TierTimeout("listing the tier timed out")
