"""The AF_XDP transport's compiled loops (``pydblp/csrc/xsk.c``): ctypes declarations and loading.

:class:`~pydblp.transport.xsk.XskTransport` calls the library once per batch
(receive: parse, check, match, copy, refill; transmit: build frames and write
descriptors; the completion and fill rings) and keeps every decision in
Python: when to wait, pacing, the multi-buffer paths, errors.  The ring
structures handed to C are built once per socket from the
:class:`~pydblp.transport.xsk_ring.Ring` views (:func:`ring_c`, :class:`RxCtx`).

The library is checked once per process (:func:`_selftest`) against the
pure-Python path over plain memory (:mod:`pydblp.transport.xsk_memory`) before
any socket uses it.  docs/architecture.md ("AF_XDP rings") says what moved and why.
"""

from __future__ import annotations

import ctypes

import numpy as np

from pydblp.native import load

_p, _z, _u32, _i32, _i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_int32, ctypes.c_int64


class RingC(ctypes.Structure):
    """``struct ring``: a mapped ring's producer, consumer, entries and index mask."""

    _fields_ = [("prod", _p), ("cons", _p), ("desc", _p), ("mask", _u32)]


class RxCtx(ctypes.Structure):
    """``struct rx_ctx``: the receive side's fixed state (rings, UMEM, port, sources, scratch)."""

    _fields_ = [("rx", RingC), ("fill", RingC), ("umem", _p), ("umem_len", ctypes.c_uint64),
                ("fs", _u32), ("port", _u32), ("validated", _i32), ("sg", _i32),
                ("v4", _p), ("v4_pid", _p), ("v6", _p), ("v6_pid", _p), ("n4", _u32), ("n6", _u32),
                ("taken", _p), ("src", _p)]


def ring_c(r) -> RingC:
    """The C view of :class:`~pydblp.transport.xsk_ring.Ring` ``r`` (valid while ``r`` is mapped)."""
    return RingC(r.prod.ctypes.data, r.cons.ctypes.data, r.desc.ctypes.data, r.mask)


def set_sources(ctx: RxCtx, sources) -> tuple:
    """Point ``ctx`` at :class:`~pydblp.transport.frames.Sources` ``sources``' arrays; returns the
    arrays (contiguous copies where needed) for the caller to keep alive while ``ctx`` is used."""
    v4 = np.ascontiguousarray(sources.v4, np.uint32)
    v4p = np.ascontiguousarray(sources.v4_pid, np.int32)
    v6 = np.ascontiguousarray(sources.v6, np.uint8)
    v6p = np.ascontiguousarray(sources.v6_pid, np.int32)
    ctx.v4, ctx.v4_pid, ctx.n4 = v4.ctypes.data, v4p.ctypes.data, len(v4)
    ctx.v6, ctx.v6_pid, ctx.n6 = v6.ctypes.data, v6p.ctypes.data, len(v6p)
    return v4, v4p, v6, v6p


def _declare(lib: ctypes.CDLL) -> None:
    lib.dblp_xsk_publish.argtypes = [_p, _u32]
    lib.dblp_xsk_publish.restype = None
    lib.dblp_xsk_produce.argtypes = [_p, _p, _z]
    lib.dblp_xsk_produce.restype = _z
    lib.dblp_xsk_reclaim.argtypes = [_p, _p, _u32, _u32]
    lib.dblp_xsk_reclaim.restype = _z
    # ctx, n, hdrs, pay, pstride, maxlen, lengths, peer, ecn (NULL: none), lend, refill, res
    lib.dblp_xsk_rx.argtypes = [_p, _z, _p, _p, _z, _z, _p, _p, _p, ctypes.c_int, ctypes.c_int, _p]
    lib.dblp_xsk_rx.restype = _i64
    lib.dblp_xsk_tx.argtypes = [_p, _p, _u32, _p, _u32, _u32, _u32, _p, _z, _p, _p, _p, _p, _p, _z, _p, _p, _p,
                                _z, _p, ctypes.c_int]
    lib.dblp_xsk_tx.restype = _z
    lib.dblp_xsk_tx_check.argtypes = [_z, _p, _p, _z, _p, _p]
    lib.dblp_xsk_tx_check.restype = ctypes.c_int


def _selftest(lib) -> bool:
    """Whether ``lib`` sends and receives a seeded exchange byte for byte as the Python path does."""
    from pydblp.transport import xsk_memory

    return xsk_memory.agree(lib)


def load_lib() -> ctypes.CDLL | None:
    """The library, built and checked once per process; None (and one warning) if unavailable.

    Raises:
        pydblp.native.NativeUnavailable: ``DBLP_NATIVE=1`` and it is unavailable.
    """
    return load("xsk", _declare, _selftest, what="several numpy calls per batch instead of one C call")
