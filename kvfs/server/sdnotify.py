"""systemd's notify protocol, spoken directly (no libsystemd, no extra package).

Under ``Type=notify`` systemd passes ``$NOTIFY_SOCKET``: the path of a unix
datagram socket, or an abstract name written with a leading ``@``. Each message
is one datagram of ``NAME=value`` lines (see sd_notify(3)):

- ``READY=1`` once the mount is live (units ordered after kvfs then see it);
- ``STOPPING=1`` when the daemon begins to flush and unmount;
- ``WATCHDOG=1`` every half of ``$WATCHDOG_USEC``, sent from the trio event loop
  itself, so a hung loop stops the pings and systemd restarts the service;
- ``STATUS=...`` a free-text line that ``systemctl status`` shows.

Sending never blocks: the socket is non-blocking and a datagram the receiver
has no room for is dropped (systemd reads its socket promptly; the next ping
follows soon). Without ``$NOTIFY_SOCKET`` every call is a no-op.
"""
import logging
import os
import socket

import trio

log = logging.getLogger(__name__)


class Notifier:
    """Sends sd_notify messages to one socket; a Notifier without an address does nothing."""

    def __init__(self, address=None, watchdog_usec=0):
        self.address = address
        self.watchdog_interval = watchdog_usec / 2e6 if watchdog_usec > 0 else None
        self._sock = None
        self._said = set()

    @classmethod
    def from_environ(cls, environ=os.environ):
        path = environ.get("NOTIFY_SOCKET", "")
        if not path:
            return cls()
        if path.startswith("@"):
            path = "\0" + path[1:]                  # an abstract socket name
        elif not path.startswith("/"):
            log.warning("ignoring NOTIFY_SOCKET=%r: neither a path nor an abstract name", path)
            return cls()
        usec = 0
        pid = environ.get("WATCHDOG_PID")
        if not pid or pid == str(os.getpid()):      # the watchdog is meant for us
            try:
                usec = int(environ.get("WATCHDOG_USEC", "0"))
            except ValueError:
                log.warning("ignoring WATCHDOG_USEC=%r: not a number", environ["WATCHDOG_USEC"])
        return cls(path, usec)

    @property
    def enabled(self):
        return self.address is not None

    def send(self, *lines):
        """Send one datagram of ``lines``; return whether it went out."""
        if self.address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._sock.setblocking(False)
            self._sock.sendto("\n".join(lines).encode(), self.address)
            return True
        except OSError as exc:
            log.warning("sd_notify %s failed: %s", lines[0].split("=")[0], exc.strerror or exc)
            return False

    def once(self, *lines):
        """Send ``lines`` unless this same first line was already sent (READY, STOPPING)."""
        if lines[0] in self._said:
            return False
        self._said.add(lines[0])
        return self.send(*lines)

    async def watchdog(self):
        """Ping the watchdog from the event loop until cancelled (returns at once if none is set)."""
        if self.address is None or self.watchdog_interval is None:
            return
        while True:
            self.send("WATCHDOG=1")
            await trio.sleep(self.watchdog_interval)

    def close(self):
        if self._sock is not None:
            self._sock.close()
            self._sock = None
