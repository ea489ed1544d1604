"""Helper threads whose failures reach the test.

An exception in a plain ``threading.Thread`` only prints a warning: the test
goes on and can pass on what the other threads did. ``Workers`` runs the
functions a test needs in the background, and when its ``with`` block ends it
sets ``stop``, joins every thread against one deadline, and re-raises the first
exception a worker raised (a worker still running at the deadline is a failure
too). ``run_in_threads`` is the same for workers that just run to completion.
"""
import threading
import time


class Workers:
    """Start workers with ``start(fn, *args)``; leaving the ``with`` block joins them.

    ``stop`` is an Event set when the block ends (also when it raises), before
    the join: loop workers poll it. If the block itself raised, that exception
    wins and the workers' failures are attached to it as notes.
    """

    def __init__(self, timeout=60.0):
        self.timeout = timeout
        self.stop = threading.Event()
        self.threads = []
        self.errors = []                # (thread name, exception), in the order they happened
        self._lock = threading.Lock()

    def start(self, fn, *args, name=None):
        def run():
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread in join()
                with self._lock:
                    self.errors.append((threading.current_thread().name, exc))

        t = threading.Thread(target=run, name=name or f"{getattr(fn, '__name__', 'worker')}-{len(self.threads)}",
                             daemon=True)     # a hung worker must not keep the test process alive
        self.threads.append(t)
        t.start()
        return t

    @property
    def failed(self):
        """True once any worker has raised (the test may stop feeding work early)."""
        return bool(self.errors)

    def join(self):
        """Set ``stop``, wait for every worker, raise the first failure."""
        self.stop.set()
        deadline = time.monotonic() + self.timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [t.name for t in self.threads if t.is_alive()]
        with self._lock:
            errors = list(self.errors)
        if errors:
            name, exc = errors[0]
            exc.add_note(f"(raised in helper thread {name}"
                         + (f"; {len(errors) - 1} more worker(s) failed too: "
                            + "; ".join(f"{n}: {e!r}" for n, e in errors[1:]) if len(errors) > 1 else "")
                         + (f"; still running at the deadline: {', '.join(hung)}" if hung else "") + ")")
            raise exc
        if hung:
            raise AssertionError(f"helper thread(s) still running {self.timeout} s after the test "
                                 f"asked them to stop: {', '.join(hung)}")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None:
            self.join()
            return False
        try:
            self.join()
        except BaseException as worker_exc:  # noqa: BLE001 - the test's own exception is the story
            exc.add_note(f"a helper thread failed too: {worker_exc!r}")
        return False


def run_in_threads(fn, items, *, timeout=300.0):
    """Call ``fn(item)`` for each item, one thread each, concurrently; return the results in order.

    The first exception raised by any call is re-raised here.
    """
    items = list(items)
    results = [None] * len(items)

    def call(i):
        results[i] = fn(items[i])

    with Workers(timeout=timeout) as workers:
        for i in range(len(items)):
            workers.start(call, i, name=f"{getattr(fn, '__name__', 'worker')}-{i}")
    return results
