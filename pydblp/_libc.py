"""The one handle on the C library that pydblp's modules call through ctypes, and small OS helpers.

Each module that calls into libc declares the ``argtypes`` of the calls it makes on
:data:`libc` and checks their return codes with :func:`checked`.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

libc = ctypes.CDLL(None, use_errno=True)


def checked(rc: int, call: str) -> int:
    """Return ``rc`` of a libc call, or raise its errno as an OSError naming ``call``.

    Args:
        rc: the call's return value; negative means it failed and set errno.
        call: the call's name, for the error message.
    """
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{call}: {os.strerror(e)}")
    return rc


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0; another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def unlink_pruned(path: Path, parents: int) -> None:
    """Remove file ``path`` (gone already is fine), then up to ``parents`` directories above it,
    nearest first, as long as each is left empty; never raises.

    The run-state trees under ``/run/dblp`` (job claims, AF_XDP status files) are one file per
    holder in per-namespace and per-interface directories: the last holder out removes them.
    """
    try:
        path.unlink(missing_ok=True)
    except OSError:
        return
    for d in list(path.parents)[:parents]:
        try:
            d.rmdir()
        except OSError:
            return  # (not empty: another holder's)
