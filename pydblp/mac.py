"""Tag MACs of whole packet batches: :func:`pydblp.wire.tag`'s keyed BLAKE2b-96, one call per batch.

:class:`Macs` computes the MAC part of the tag (not the epoch bytes) of many
packets at once, each packet given as its 32-byte header record and its
payload row, as a transport's :class:`~pydblp.transport.base.Batch` holds
them.  Two paths give the same bytes:

native   ``csrc/mac.c``, BLAKE2b (RFC 7693) over 4 or 8 packets side by side in
         SIMD lanes, built at install or first use and loaded with ctypes by
         :mod:`pydblp.native` (the call releases the GIL).  Checked against
         hashlib once per process before use.
python   hashlib's BLAKE2b, one ``copy()`` of the keyed state per packet: what
         every process falls back to, with one logged warning, when the
         library is unavailable (:mod:`pydblp.native` says when) or its check fails.

``bench/auth_cost.py`` measures both.  The C source ships inside the package
(``pydblp/csrc``, package data): unlike ``bpf/``, which C tools and readers
expect at the top of the repository, it is an implementation detail of this
module.
"""

from __future__ import annotations

import ctypes

import numpy as np

from pydblp import wire
from pydblp.native import load, why


def _declare(lib: ctypes.CDLL) -> None:
    p, z = ctypes.c_void_p, ctypes.c_size_t
    lib.dblp_mac_key.argtypes = [p, p, z, p, p, z]
    lib.dblp_mac_key.restype = ctypes.c_int
    lib.dblp_mac_batch.argtypes = [p, z, z, p, z, z, p, z, p, p, p]
    lib.dblp_mac_batch.restype = None


def _load() -> ctypes.CDLL | None:
    """The native library, built and checked once per process; None (and one warning) if unavailable."""
    return load("mac", _declare, _selftest, what="about 4x the CPU per packet", tuned=True)


def _selftest(lib) -> bool:
    """Whether ``lib`` agrees with hashlib over lengths that cross every block-boundary case."""
    rng = np.random.default_rng(7)
    key, epoch = rng.bytes(37), 0x01020304
    n, w = 11, 400
    hdr = wire.empty_batch(n)
    hdr.view(np.uint8).reshape(n, -1)[:] = rng.integers(0, 256, (n, wire.HEADER_LEN), dtype=np.uint8)
    pay = rng.integers(0, 256, (n, w), dtype=np.uint8)
    body = np.array([0, 1, 95, 96, 97, 223, 224, 225, 351, 352, 400], np.int64)
    return np.array_equal(Macs(key, epoch, native=False)(hdr, pay, body),
                          Macs(key, epoch, native=True, _lib=lib)(hdr, pay, body))


def native_available() -> bool:
    """Whether the C path can be used in this process (builds it on first call)."""
    return _load() is not None


class Macs:
    """MACs of :func:`pydblp.wire.tag` (keyed BLAKE2b-96, salt = the run epoch) for packet batches.

    Args:
        key: the job key, ``wire.KEY_MIN``..``wire.KEY_MAX`` bytes.
        epoch: the run epoch, 0..2**32-1.
        native: True: the C path (raise if unavailable); False: hashlib; None: C if it can be
            built and loaded, else hashlib with one logged warning per process.

    Raises:
        RuntimeError: ``native=True`` and the C path is unavailable (the reason in the message).

    Attributes:
        native: whether this instance uses the C path.
    """

    def __init__(self, key: bytes, epoch: int = 0, native: bool | None = None, *, _lib=None):
        key = bytes(key)
        lib = _lib if _lib is not None else (None if native is False else _load())
        if native and lib is None:
            raise RuntimeError(f"batched C MAC unavailable: {why('mac')}")
        self.native = lib is not None
        self._state = wire.mac_state(key, epoch)
        if lib is not None:
            self._lib = lib
            self._h0 = np.zeros(8, np.uint64)
            salt = epoch.to_bytes(wire.EPOCH_LEN, "big").ljust(16, b"\0")
            person = wire._PERSON.ljust(16, b"\0")
            if lib.dblp_mac_key(self._h0.ctypes.data, key, len(key), salt, person, wire.MAC_LEN):
                raise ValueError(f"job key of {len(key)} bytes: use {wire.KEY_MIN}..{wire.KEY_MAX}")

    def __call__(self, headers: np.ndarray, payload: np.ndarray, body: np.ndarray,
                 rows: np.ndarray | None = None) -> np.ndarray:
        """(m, ``wire.MAC_LEN``) uint8 MACs of packets ``rows`` (None: all, m = len(headers)).

        Args:
            headers: n header records (``wire.empty_batch`` dtype) as sent, flags and ``len`` included.
            payload: (n, width) uint8, payload row i of packet i (any row stride).
            body: n payload byte counts (the tag excluded), each 0..width.
            rows: int indices of the packets to MAC, or None.

        Raises:
            ValueError: a count outside 0..width (the MAC would read past the row).
        """
        n = len(headers)
        body = np.ascontiguousarray(body, np.int64)
        if len(body) != n or payload.shape[0] < n:
            raise ValueError(f"{n} headers, {len(body)} lengths, {payload.shape[0]} payload rows")
        if rows is not None:
            rows = np.ascontiguousarray(rows, np.int64)
            if len(rows) and (int(rows.min()) < 0 or int(rows.max()) >= n):
                raise ValueError(f"rows {int(rows.min())}..{int(rows.max())} outside 0..{n - 1}")
        m = n if rows is None else len(rows)
        b = body if rows is None else body[rows]
        if m and (int(b.min()) < 0 or int(b.max()) > payload.shape[1]):
            raise ValueError(f"payload lengths {int(b.min())}..{int(b.max())} outside 0..{payload.shape[1]}")
        h = np.ascontiguousarray(headers)
        if payload.ndim != 2 or payload.strides[1] != 1 or payload.strides[0] < payload.shape[1]:
            payload = np.ascontiguousarray(payload)
        if self.native:
            out = np.empty((m, wire.MAC_LEN), np.uint8)
            if m:
                self._lib.dblp_mac_batch(self._h0.ctypes.data, wire.MAC_LEN, m, h.ctypes.data,
                                         h.dtype.itemsize, h.dtype.itemsize, payload.ctypes.data,
                                         payload.strides[0], body.ctypes.data,
                                         None if rows is None else rows.ctypes.data, out.ctypes.data)
            return out
        return self._python(h, payload, body, rows)

    def _python(self, h, payload, body, rows) -> np.ndarray:
        hl = h.dtype.itemsize
        hv = memoryview(h.view(np.uint8).reshape(-1))
        n, w = payload.shape
        s = payload.strides[0]
        pv = memoryview(np.lib.stride_tricks.as_strided(payload, shape=((n - 1) * s + w if n else 0,),
                                                        strides=(1,), writeable=False))
        idx = range(len(h)) if rows is None else rows.tolist()
        cp = self._state.copy
        out = []
        for i, b in zip(idx, (body if rows is None else body[rows]).tolist()):
            m = cp()
            m.update(hv[hl * i: hl * i + hl])
            m.update(pv[s * i: s * i + b])
            out.append(m.digest())
        return np.frombuffer(b"".join(out), np.uint8).reshape(-1, wire.MAC_LEN)
