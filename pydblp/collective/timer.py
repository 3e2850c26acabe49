"""A one-shot timer a thread sleeps on (a Linux timerfd), for the idle responder."""

from __future__ import annotations

import ctypes
import os

from pydblp._libc import checked, libc

libc.timerfd_create.argtypes = (ctypes.c_int, ctypes.c_int)
libc.timerfd_settime.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
CLOCK_MONOTONIC, TFD_CLOEXEC = 1, 0o2000000


class Alarm:
    """A one-shot timer a thread sleeps on: setting or clearing it wakes no one.

    Raises OSError (from ``timerfd_create``/``timerfd_settime``) if the kernel refuses.
    """

    def __init__(self):
        self.fd = checked(libc.timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC), "timerfd_create")
        self._spec = (ctypes.c_int64 * 4)()  # struct itimerspec: interval (s, ns) 0, expiry (s, ns)

    def set(self, after: float) -> None:
        """Fire ``after`` seconds from now; 0 clears it (an expiry not yet waited for is dropped).

        Args:
            after: seconds from now; 0 disarms the timer.
        """
        self._spec[2], self._spec[3] = divmod(round(after * 1e9), 10**9)
        checked(libc.timerfd_settime(self.fd, 0, self._spec, None), "timerfd_settime")

    def wait(self) -> None:
        """Sleep until it fires."""
        os.read(self.fd, 8)

    def close(self) -> None:
        """Release the timerfd (idempotent)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
