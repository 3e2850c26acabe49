"""The AF_XDP ABI: socket options, ring layout, UMEM registration and bind.

Raw syscalls, no libxdp/libbpf: ``socket(AF_XDP)``, ``setsockopt``/``getsockopt``
through the socket module, ``mmap`` through the mmap module, and ``bind`` through
ctypes (Python's ``socket.bind`` rejects family 44).  The constants are those of
``linux/if_xdp.h``.

A :class:`Ring` is one of the four single-producer single-consumer rings the
kernel shares with the socket (rx, tx, fill, completion): a producer and a
consumer index (free-running uint32 counters, compared modulo 2^32), a flags
word and ``n`` descriptors (a power of two; slot = index & (n - 1)).

Ring indices are read and written as plain numpy uint32 loads and stores.
That is correct on x86-64 (TSO: stores are not reordered with stores, loads
not with loads; every crossing of the interpreter is a compiler barrier);
another architecture would need explicit barriers.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import socket
import struct
import time

import numpy as np

from pydblp import wire
from pydblp._libc import libc
from pydblp.transport.base import TransportError

AF_XDP = 44
SOL_XDP = 283
XDP_MMAP_OFFSETS = 1
XDP_RX_RING = 2
XDP_TX_RING = 3
XDP_UMEM_REG = 4
XDP_UMEM_FILL_RING = 5
XDP_UMEM_COMPLETION_RING = 6
XDP_STATISTICS = 7
XDP_OPTIONS = 8
XDP_MAX_TX_SKB_BUDGET = 9  # 6.17+; older kernels refuse it (harmless)
XDP_SHARED_UMEM = 1
XDP_COPY = 2
XDP_ZEROCOPY = 4
XDP_USE_NEED_WAKEUP = 8
XDP_USE_SG = 16            # multi-buffer: a frame may span several descriptors (6.6+)
XDP_PKT_CONTD = 1          # descriptor option: the frame continues in the next descriptor
SG_MAX_SEGMENTS = 17       # descriptors per frame the kernel's copy-mode transmit accepts (MAX_SKB_FRAGS)
XDP_RING_NEED_WAKEUP = 1
XDP_OPTIONS_ZEROCOPY = 1
XDP_PGOFF_RX_RING = 0
XDP_PGOFF_TX_RING = 0x80000000
XDP_UMEM_PGOFF_FILL_RING = 0x100000000
XDP_UMEM_PGOFF_COMPLETION_RING = 0x180000000
XDP_PACKET_HEADROOM = 256  # copy-mode receive writes a frame this far into its UMEM frame
FRAME_HEADERS = 14 + wire.DATAGRAM_OVERHEAD  # Ethernet, then IPv6 (the longer IP header), UDP, DBLP

DESC_DTYPE = np.dtype([("addr", "<u8"), ("len", "<u4"), ("options", "<u4")])  # struct xdp_desc
ADDR_DTYPE = np.dtype("<u8")  # fill and completion ring entries: UMEM addresses
STAT_FIELDS = ("rx_dropped", "rx_invalid_descs", "tx_invalid_descs", "rx_ring_full",
               "rx_fill_ring_empty_descs", "tx_ring_empty_descs")
MASK32 = 0xFFFFFFFF

libc.bind.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32)


def frame_size_for(payload: int) -> int:
    """The UMEM frame size (2048 or 4096) whose receive frames hold a DBLP datagram whole.

    Args:
        payload: DBLP payload bytes of the largest datagram.

    2048 up to 1698 bytes (1408, the collective's default chunk, fits), else
    4096 (past ~3800 bytes a datagram spans several frames, with ``XDP_USE_SG``).
    """
    return 2048 if FRAME_HEADERS + payload + XDP_PACKET_HEADROOM <= 2048 else 4096


def pow2(n: int, what: str) -> int:
    """``n`` if it is a positive power of two, else ValueError naming ``what``."""
    if n <= 0 or n & (n - 1):
        raise ValueError(f"{what} must be a power of two, got {n}")
    return n


class Ring:
    """One ring: producer, consumer and flags (uint32 views) and ``n`` descriptors.

    Built over the socket's mapping by :meth:`map`, or over any writable
    buffer (tests).  The index arithmetic is modulo 2^32, as the kernel's.
    """

    def __init__(self, buf, offs: tuple, n: int, dtype: np.dtype, mm: mmap.mmap | None = None):
        """Args:
            buf: the ring's memory (a writable buffer).
            offs: byte offsets of (producer, consumer, descriptors, flags) in ``buf``.
            n: descriptors (a power of two).
            dtype: one descriptor (:data:`DESC_DTYPE` or :data:`ADDR_DTYPE`).
            mm: the mapping to unmap on :meth:`close`, if any.
        """
        prod, cons, desc, flags = offs
        b = np.frombuffer(buf, np.uint8)
        self.mm = mm
        self.prod = b[prod: prod + 4].view(np.uint32)
        self.cons = b[cons: cons + 4].view(np.uint32)
        self.flags = b[flags: flags + 4].view(np.uint32)
        self.desc = b[desc: desc + n * dtype.itemsize].view(dtype)
        self.n = pow2(n, "ring size")
        self.mask = n - 1

    @classmethod
    def map(cls, fd: int, pgoff: int, offs: tuple, n: int, dtype: np.dtype) -> "Ring":
        """Map the ring at page offset ``pgoff`` of AF_XDP socket ``fd`` (``offs`` from XDP_MMAP_OFFSETS)."""
        size = offs[2] + n * dtype.itemsize
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE,
                       mmap.PROT_READ | mmap.PROT_WRITE, offset=pgoff)
        return cls(mm, offs, n, dtype, mm)

    def used(self) -> int:
        """Entries produced and not yet consumed."""
        return (int(self.prod[0]) - int(self.cons[0])) & MASK32

    def free(self) -> int:
        """Entries the producer may still write."""
        return self.n - self.used()

    def at(self, start: int, count: int) -> np.ndarray:
        """The ``count`` descriptors from ring index ``start``: a view, or a copy where they wrap."""
        i0 = start & self.mask
        if i0 + count <= self.n:
            return self.desc[i0: i0 + count]
        return self.desc[(start + np.arange(count)) & self.mask]

    def produce(self, entries: np.ndarray) -> int:
        """Write as many of ``entries`` as fit at the producer index and publish them; how many."""
        prod = int(self.prod[0])
        m = min(self.n - ((prod - int(self.cons[0])) & MASK32), len(entries))
        if m:
            i0 = prod & self.mask
            if i0 + m <= self.n:
                self.desc[i0: i0 + m] = entries[:m]
            else:
                self.desc[(prod + np.arange(m)) & self.mask] = entries[:m]
            self.prod[0] = (prod + m) & MASK32
        return m

    def consume(self, cons: int, count: int) -> None:
        """Hand back ``count`` entries read from consumer index ``cons``."""
        self.cons[0] = (cons + count) & MASK32

    def close(self) -> bool:
        """Drop the views and unmap; False when a view escaped (the mapping goes when it does)."""
        self.prod = self.cons = self.flags = self.desc = None
        if self.mm is None:
            return True
        try:
            self.mm.close()
            return True
        except BufferError:
            return False


def register_umem(sock: socket.socket, umem: np.ndarray, frame_size: int) -> None:
    """Register ``umem`` (page-aligned, ``frame_size`` chunks, aligned mode) with AF_XDP socket ``sock``."""
    sock.setsockopt(SOL_XDP, XDP_UMEM_REG, struct.pack("=QQIIII", umem.ctypes.data, umem.nbytes,
                                                       frame_size, 0, 0, 0))


def map_rings(sock: socket.socket, rx: int, tx: int, fill: int, comp: int, opened: list) -> tuple:
    """Size and map the four rings of ``sock``; returns (rx, tx, fill, completion).

    Args:
        sock: an AF_XDP socket with its UMEM registered.
        rx, tx, fill, comp: ring sizes (powers of two).
        opened: each ring is appended as soon as it is mapped, so that a
            caller can close the ones mapped before a failure.
    """
    so = sock.setsockopt
    so(SOL_XDP, XDP_UMEM_FILL_RING, fill)
    so(SOL_XDP, XDP_UMEM_COMPLETION_RING, comp)
    so(SOL_XDP, XDP_RX_RING, rx)
    so(SOL_XDP, XDP_TX_RING, tx)
    o = struct.unpack("=16Q", sock.getsockopt(SOL_XDP, XDP_MMAP_OFFSETS, 128))
    fd = sock.fileno()
    # rx, tx, fill, completion: (producer, consumer, desc, flags) each
    for pgoff, offs, n, dt in ((XDP_PGOFF_RX_RING, o[0:4], rx, DESC_DTYPE),
                               (XDP_PGOFF_TX_RING, o[4:8], tx, DESC_DTYPE),
                               (XDP_UMEM_PGOFF_FILL_RING, o[8:12], fill, ADDR_DTYPE),
                               (XDP_UMEM_PGOFF_COMPLETION_RING, o[12:16], comp, ADDR_DTYPE)):
        opened.append(Ring.map(fd, pgoff, offs, n, dt))
    return tuple(opened[-4:])


def bind(fd: int, ifname: str, ifindex: int, queue: int, flags: int, timeout: float) -> int:
    """Bind AF_XDP socket ``fd`` to (``ifindex``, ``queue``); returns the EBUSY retries it took.

    EBUSY (the previous socket on the queue still being torn down, deferred
    work) is retried with backoff for up to ``timeout`` seconds; any other
    failure raises :class:`TransportError` with the errno and a hint.
    """
    sxdp = ctypes.create_string_buffer(struct.pack("=HHIII", AF_XDP, flags, ifindex, queue, 0), 16)
    deadline = time.monotonic() + timeout
    delay = 0.002
    retries = 0
    while True:
        if libc.bind(fd, sxdp, 16) == 0:
            return retries
        e = ctypes.get_errno()
        if e == errno.EBUSY and time.monotonic() < deadline:
            retries += 1
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
            continue
        hint = {errno.EBUSY: "another AF_XDP socket is bound to this queue",
                errno.EINVAL: f"queue {queue} does not exist on {ifname}, or bad flags",
                errno.EOPNOTSUPP: "the driver has no zero-copy support; use mode='copy'",
                errno.ENOPROTOOPT: "kernel without AF_XDP"}.get(e, "")
        raise TransportError(e, f"bind AF_XDP to {ifname} queue {queue}: {os.strerror(e)}"
                             + (f" ({hint})" if hint else ""))


def statistics(sock: socket.socket) -> dict:
    """XDP_STATISTICS of ``sock`` as a dict over :data:`STAT_FIELDS`."""
    raw = sock.getsockopt(SOL_XDP, XDP_STATISTICS, 48)
    return dict(zip(STAT_FIELDS, struct.unpack("=6Q", raw.ljust(48, b"\0"))))


# Busy polling (asm-generic/socket.h): the socket's poll(2) and sendto() run the device's NAPI
# loop themselves instead of waiting for its interrupt; for a core dedicated to the socket.
SO_BUSY_POLL = 46          # microseconds to busy-poll in a blocking call
SO_PREFER_BUSY_POLL = 69   # 5.11+: keep the interrupt off while the application polls
SO_BUSY_POLL_BUDGET = 70   # 5.11+: packets one busy-poll pass may take
BUSY_POLL_BUDGET = 64      # NAPI's default weight


def busy_poll(sock: socket.socket, usecs: int, budget: int = BUSY_POLL_BUDGET) -> None:
    """Turn busy polling on for ``sock``: ``SO_PREFER_BUSY_POLL``, ``SO_BUSY_POLL`` = ``usecs``
    and ``SO_BUSY_POLL_BUDGET`` = ``budget``.

    Raises:
        TransportError: the kernel refused one of them (the message names it, why, and the fix).
    """
    for opt, name, val in ((SO_PREFER_BUSY_POLL, "SO_PREFER_BUSY_POLL", 1), (SO_BUSY_POLL, "SO_BUSY_POLL", usecs),
                           (SO_BUSY_POLL_BUDGET, "SO_BUSY_POLL_BUDGET", budget)):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, val)
        except OSError as e:
            fix = {errno.EPERM: "it needs CAP_NET_ADMIN: run as root",
                   errno.ENOPROTOOPT: "a kernel without CONFIG_NET_RX_BUSY_POLL, or older than 5.11",
                   errno.EINVAL: "out of range: busy_poll in microseconds, busy_poll_budget 1..65535"}.get(e.errno, "")
            raise TransportError(e.errno, f"busy_poll: the kernel refused {name}={val} ({os.strerror(e.errno)})"
                                 + (f": {fix}" if fix else "") + "; or leave busy_poll=0") from None
