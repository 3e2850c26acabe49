"""The job key and the run epoch: what an authenticated data plane needs at start.

The key is a secret every rank of a job holds: 16 to 64 random bytes in a
file (``head -c 32 /dev/urandom > job.key``) or, for tests and short runs, in
an environment variable.  It never travels through the torch.distributed
store (plain TCP) or on the wire; a user copies the same file to every host.

The epoch names one run of the job.  It needs no secrecy, only to differ from
every earlier run's: one rank draws it (:func:`new_epoch`) and publishes it to
the others at rendezvous (the store is fine for it).  Tags bind it, so a
packet recorded in an earlier run never verifies in this one.

Sources, first found wins (:func:`load_key`):

* ``path`` (a CLI's ``--key-file``);
* ``DBLP_KEY_FILE``: a path to a key file;
* ``DBLP_KEY``: the key as hex (32 to 128 hex digits).

Setting both variables is refused: which one is meant is unclear.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat

from pydblp.wire import EPOCH_LEN, KEY_MAX, KEY_MIN

log = logging.getLogger(__name__)

ENV_FILE, ENV_HEX = "DBLP_KEY_FILE", "DBLP_KEY"
_MAKE = "head -c 32 /dev/urandom > job.key"


class KeyLoadError(ValueError):
    """A job key could not be loaded; the message says what is wrong and the fix (one line)."""


def load_key(path: str | os.PathLike | None = None, env: dict | None = None) -> bytes | None:
    """The job key, or None when no source is given (a keyless run).

    Args:
        path: a key file (raw bytes); wins over the environment.
        env: the environment to read ``DBLP_KEY_FILE`` / ``DBLP_KEY`` from (default ``os.environ``).

    Raises:
        KeyLoadError: a missing or unreadable file, a key of the wrong length or format, or both
            variables set; the message says the fix.  A file that others may read is loaded
            with a warning logged.
    """
    env = os.environ if env is None else env
    if path is None:
        fpath, hexkey = env.get(ENV_FILE) or None, env.get(ENV_HEX) or None
        if fpath and hexkey:
            raise KeyLoadError(f"both {ENV_FILE} and {ENV_HEX} are set: unset one")
        if hexkey:
            return _from_hex(hexkey)
        if not fpath:
            return None
        path, where = fpath, f" ({ENV_FILE})"
    else:
        where = ""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            key = f.read(KEY_MAX + 1)
    except FileNotFoundError:
        raise KeyLoadError(f"key file {path}{where}: no such file; make one with `{_MAKE}` and give "
                           f"every rank a copy") from None
    except IsADirectoryError:
        raise KeyLoadError(f"key file {path}{where} is a directory: give the key file itself") from None
    except OSError as e:
        raise KeyLoadError(f"key file {path}{where}: {e.strerror or e}") from None
    if not KEY_MIN <= len(key) <= KEY_MAX:
        size = f"more than {KEY_MAX}" if len(key) > KEY_MAX else str(len(key))
        raise KeyLoadError(f"key file {path}{where} holds {size} bytes: a key is {KEY_MIN}..{KEY_MAX} raw bytes; "
                           f"make one with `{_MAKE}`")
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("key file %s can be read by other users: chmod 600 it", path)
    return key


def _from_hex(text: str) -> bytes:
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise KeyLoadError(f"{ENV_HEX} is not hex: give {2 * KEY_MIN}..{2 * KEY_MAX} hex digits "
                           f"(e.g. from `head -c 32 /dev/urandom | xxd -p -c 64`)") from None
    if not KEY_MIN <= len(key) <= KEY_MAX:
        raise KeyLoadError(f"{ENV_HEX} holds {len(key)} bytes: give {2 * KEY_MIN}..{2 * KEY_MAX} hex digits "
                           f"(e.g. from `head -c 32 /dev/urandom | xxd -p -c 64`)")
    return key


def new_epoch() -> int:
    """A fresh run epoch (random, 0..2**32-1): one rank draws it and gives it to the others."""
    return int.from_bytes(secrets.token_bytes(EPOCH_LEN), "big")
