"""The transport interface shared by the AF_XDP and UDP transports.

A transport moves DBLP packets (header + payload) between hosts in
*batches*: numpy arrays, never Python objects per packet.

Batch layout (:class:`Batch`)
-----------------------------
``headers``  (cap,) :data:`pydblp.wire.HEADER_DTYPE` records (network order fields)
``payload``  (cap, maxlen) uint8: row i holds the bytes that follow packet i's
             32-byte header (the DBLP payload, plus the 16-byte tag when
             ``flags & TAG``); bytes past ``lengths[i]`` are undefined
``lengths``  (cap,) int32: how many bytes of ``payload[i]`` are used
``peer``     (cap,) int32: on send, the destination peer id returned by
             :meth:`Transport.add_peer`; on receive, the sender's peer id when
             its address was registered with :meth:`Transport.add_peer`, else -1
``n``        rows in use (``len(batch)``)
``ecn``      optional, receive: (cap,) uint8, the IP header's ECN field of each packet as it
             arrived (0 Not-ECT, 1 ECT(1), 2 ECT(0), 3 CE: a switch's congestion mark); None
             where a transport does not report it
``addr``     optional, send only: (cap,) uint64, the address of each packet's payload
             bytes, read there instead of ``payload``'s row by a transport whose
             :attr:`Transport.reads_addresses` is True (no staging copy of the
             tensor's rows: the collective sets it only for such a transport and
             keeps the memory alive through the call); None: ``payload``

:meth:`Batch.view` gives a batch over the first rows without copying.  On
send, ``headers["len"]`` is what goes on the wire: :func:`Batch.fill` sets it
from ``lengths`` (tag excluded), so a batch built by hand must agree.

Threading model
---------------
A transport is used from at most two threads at a time: **one** thread
calling :meth:`Transport.recv` and **one** (possibly other) thread calling
:meth:`Transport.send`.  Receive and transmit state are disjoint (AF_XDP: the
rx + fill rings and rx frames versus the tx + completion rings and tx frames,
each a single-producer/single-consumer ring), so the two need no lock
(a paced ``XskTransport(rate=...)`` is the exception: ``recv`` also hands
waiting transmit frames to the kernel, under a lock ``send`` holds).
:meth:`stats` may be called from any thread.  :meth:`close` must not race
with a ``send``/``recv`` in progress.  Blocking in ``recv(timeout=...)`` and
``send`` waits in ``poll(2)`` or ctypes calls, which release the GIL.

When the receiver falls behind
------------------------------
Nothing blocks the kernel and nothing crashes.  AF_XDP: the rx ring fills;
each ``recv`` publishes the ring occupancy as a pressure level 0..1000 to the
XDP program (``pressure=``), which then sheds low-priority packets within each
message's loss bound; beyond that the kernel drops at the full ring and
counts it (``stats()["rx_ring_full"]``, ``["rx_dropped"]``).  UDP: the socket
receive buffer fills and the kernel drops, counted in
``stats()["rx_dropped"]`` (SO_MEMINFO).  The collective layer above repairs
loss beyond the bound (PROBE/BITMAP).
"""

from __future__ import annotations

import abc
import ctypes
import errno
import ipaddress
import logging
import operator
import time
from dataclasses import dataclass

import numpy as np

from pydblp import wire

DEFAULT_MAXLEN = 2048 - 42 - wire.HEADER_LEN  # anything that fits a 2 KiB frame
RECV_ERROR_LOG_EVERY = 10.0  # s: at most one warning this often for batches a receive dropped on an error

log = logging.getLogger(__name__)


@dataclass
class Batch:
    headers: np.ndarray
    payload: np.ndarray
    lengths: np.ndarray
    peer: np.ndarray
    n: int = 0
    addr: np.ndarray | None = None
    ecn: np.ndarray | None = None

    @classmethod
    def empty(cls, cap: int, maxlen: int = 1500) -> "Batch":
        """A batch with room for ``cap`` packets of up to ``maxlen`` payload bytes (n = 0)."""
        return cls(wire.empty_batch(cap), np.zeros((cap, maxlen), np.uint8),
                   np.zeros(cap, np.int32), np.full(cap, -1, np.int32), 0, None, np.zeros(cap, np.uint8))

    @classmethod
    def fill(cls, headers: np.ndarray, payload: np.ndarray, lengths=None, peer=0) -> "Batch":
        """A send batch from headers and a payload array; sets ``headers["len"]``.

        ``lengths`` defaults to the full payload width; ``peer`` is a peer id
        or an array of them.
        """
        n = len(headers)
        payload = np.asarray(payload, np.uint8)
        if payload.ndim != 2:
            payload = payload.reshape(n, -1)
        lengths = np.full(n, payload.shape[1], np.int32) if lengths is None else np.asarray(lengths, np.int32)
        hdr = np.array(headers, dtype=wire.HEADER_DTYPE, copy=True)
        tag = np.where(hdr["flags"] & wire.Flag.TAG, wire.TAG_LEN, 0)
        hdr["len"] = lengths - tag
        return cls(hdr, payload, lengths, np.broadcast_to(np.asarray(peer, np.int32), (n,)).copy(), n)

    @property
    def cap(self) -> int:
        return len(self.headers)

    @property
    def maxlen(self) -> int:
        return self.payload.shape[1]

    def __len__(self) -> int:
        return self.n

    def view(self, start: int, stop: int | None = None) -> "Batch":
        """Rows ``start:stop`` of the used rows, without copying."""
        stop = self.n if stop is None else min(stop, self.n)
        s = slice(start, stop)
        return Batch(self.headers[s], self.payload[s], self.lengths[s], self.peer[s], max(0, stop - start),
                     None if self.addr is None else self.addr[s], None if self.ecn is None else self.ecn[s])

    def payloads(self) -> list[bytes]:
        """Per-packet payload bytes, from ``addr`` where set (a Python loop: for tests and inspection only)."""
        if self.addr is not None:
            return [ctypes.string_at(int(a), int(k)) for a, k in zip(self.addr[: self.n], self.lengths[: self.n])]
        return [self.payload[i, : self.lengths[i]].tobytes() for i in range(self.n)]


class DropLog:
    """Logs a received batch dropped because handling it raised: the first with its traceback,
    then at most one every ``RECV_ERROR_LOG_EVERY`` seconds (a stream of them must not flood the
    log).  Used by :meth:`Transport.recv` and the collective's receive."""

    def __init__(self, logger: logging.Logger, who: str):
        self.log, self.who, self.last = logger, who, float("-inf")

    def __call__(self, e: Exception, count: int) -> None:
        now = time.monotonic()
        if now - self.last >= RECV_ERROR_LOG_EVERY:
            self.last = now
            self.log.warning("%s: a received batch raised %s: %s; dropped it (rx_errors %d), receiving on",
                             self.who, type(e).__name__, e, count, exc_info=e)


class TransportError(OSError):
    """A transport could not be opened or used; the message says what to do."""


def parse_ip(addr) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return addr if isinstance(addr, (ipaddress.IPv4Address, ipaddress.IPv6Address)) else ipaddress.ip_address(addr)


def check_port(port, what: str = "port", zero_ok: bool = False) -> int:
    """``port`` if it is a UDP port number (1..65535, or 0 with ``zero_ok``); else a ValueError naming ``what``."""
    lo = 0 if zero_ok else 1
    try:
        p = operator.index(port)  # ints, numpy integers; not floats or strings
    except TypeError:
        p = None
    if p is None or isinstance(port, bool) or not lo <= p <= 65535:
        raise ValueError(f"{what} {port!r}: want an integer in {lo}..65535")
    return p


class Transport(abc.ABC):
    """Open on (netns, ifname, queue, port); send and receive :class:`Batch` es.

    Subclasses: :class:`pydblp.transport.xsk.XskTransport` (AF_XDP, root) and
    :class:`pydblp.transport.udp.UdpTransport` (plain UDP sockets, no root).
    """

    kind: str = "?"

    netns: str | None
    ifname: str | None
    queue: int
    port: int

    spin: float = 0.0
    reads_addresses: bool = False  # send() reads Batch.addr (a compiled path); else only payload rows
    reports_tx_queue: bool = True  # tx_queued() measures what waits to leave (False: it cannot tell, says 0)
    timeout_unit: float = 0.001    # s: recv sleeps in poll(2), which counts whole ms and truncates; a
                                   # timeout under it returns at once, so a caller that must sleep rounds up
    _c: dict          # counters (stats()); subclasses make it in __init__
    _drop_log: "DropLog | None" = None  # made at the first batch dropped on an error

    def _spin(self, ready, timeout: float | None) -> bool:
        """Busy-poll ``ready()`` for up to ``spin`` seconds (never past ``timeout``), before sleeping in poll(2).

        A sleeping reader costs the kernel a wakeup per NAPI flush, charged to
        whoever runs the receive softirq; a dedicated core spins instead.
        """
        if timeout == 0 or self.spin <= 0:
            return False
        end = time.perf_counter() + (self.spin if timeout is None else min(self.spin, timeout))
        while time.perf_counter() < end:
            if ready():
                return True
        return False

    @abc.abstractmethod
    def add_peer(self, addr, port: int = wire.DEFAULT_PORT, mac: str | bytes | None = None) -> int:
        """Register a destination; returns its peer id (the value for ``Batch.peer``)."""

    @abc.abstractmethod
    def send(self, batch: Batch, timeout: float | None = 1.0) -> int:
        """Queue every packet of ``batch`` for transmission; returns how many were queued.

        Waits up to ``timeout`` seconds (None: no limit) for ring or buffer
        space; returns fewer than ``len(batch)`` only when that runs out.
        """

    def recv(self, into: Batch | None = None, timeout: float | None = 0.0, max: int | None = None,
             *, want: int = 1, linger: float = 0.0, copy: bool = True) -> Batch:
        """Receive up to ``max`` (default: ``into.cap``) packets into ``into``.

        Returns ``into.view(0, k)`` (``into.n`` is set to k).  Waits up to
        ``timeout`` seconds for the first packet (0: never, None: forever);
        then, if fewer than ``want`` have arrived, up to ``linger`` seconds
        more for them (interrupt coalescing: fewer, larger batches while a
        stream trickles in at line rate), then takes whatever has arrived;
        the linger ends as soon as a control packet (any kind but DATA) has
        come, since it wants an answer (``UdpTransport`` sees it in what it
        reads; ``XskTransport`` with pydblp's host program in the program's
        count of control packets redirected, ``HostMaps.control_seen``; with
        another program it lingers on).  Only packets that pass
        :func:`pydblp.wire.validate_batch` are returned; the rest are counted
        in ``stats()["rx_invalid"]``.  Payloads longer than ``into.maxlen``
        are truncated and counted in ``stats()["rx_truncated"]``.

        ``copy=False`` lets the transport lend its own receive buffers: the
        returned batch's ``payload`` may be a view of them (AF_XDP: the UMEM
        frames, so no payload copy), valid only until the next ``recv``;
        ``headers``, ``lengths`` and ``peer`` are still ``into``'s rows.

        Failure semantics: what arrives never ends a transport.  If handling a
        received batch raises anything but an ``OSError`` (a packet the checks
        let through and the code then chokes on: a bug), the batch is dropped
        whole, its buffers go back to the kernel, ``stats()["rx_errors"]``
        counts it, a warning with the traceback is logged (at most one every
        ``RECV_ERROR_LOG_EVERY`` seconds) and an empty batch is returned: the
        collective above repairs the packets as it repairs loss.

        Raises:
            TransportError: the transport is closed, or cannot go on (e.g.
                :class:`~pydblp.transport.auth.AuthTransport`: peers hold another key).
            OSError: the socket itself failed.
        """
        self._check_open()
        if into is None:
            into = Batch.empty(1024)
        try:
            return self._recv(into, timeout, max, want, linger, copy)
        except (OSError, MemoryError):
            raise
        except Exception as e:  # the batch, not the transport: drop it, count it, go on
            self._recv_failed(e)
            into.n = 0
            return into.view(0, 0)

    @abc.abstractmethod
    def _recv(self, into: Batch, timeout: float | None, max: int | None, want: int, linger: float,
              copy: bool) -> Batch:
        """:meth:`recv`'s work, on an open transport and a given ``into``; may raise on a bad batch
        (:meth:`recv` drops it and calls :meth:`_recv_failed`)."""

    def _recv_failed(self, e: Exception) -> None:
        """Count and log a batch :meth:`_recv` raised on; a subclass also gives back the buffers
        the batch held (and calls this)."""
        self._c["rx_errors"] += 1
        if self._drop_log is None:
            self._drop_log = DropLog(log, f"{self.kind} transport")
        self._drop_log(e, self._c["rx_errors"])

    ect: bool = False  # packets sent go out ECN-capable, ECT(0) (set_ect)

    def set_ect(self, on: bool) -> None:
        """Send every packet ECN-capable, ECT(0) in the IP header (RFC 3168), or not (the default):
        a switch that marks then sets CE on it instead of dropping it, and the receiving
        transport reports the mark in ``Batch.ecn``.  The collective turns it on with
        ``Config.cc`` (its congestion control reads the marks).  A transport that cannot write
        the IP header's ECN field leaves it 0 and reports ``ect`` False.
        """
        self.ect = False

    def tx_backlog(self) -> float:
        """Seconds until what ``send`` queued here has been handed to the network (0: nothing waits).

        Only a transport that paces itself (``XskTransport(rate=...)``) holds
        a backlog; a caller keeps it short (TCP small queues: a few ms), so a
        control packet it sends next does not wait behind a long data queue.
        """
        return 0.0

    def tx_queued(self) -> int:
        """Bytes ``send`` handed the kernel that have not left this host yet (the socket's send
        queue, the device's qdisc included; 0 where the transport cannot tell): what a packet sent
        now waits behind.  A caller that is repairing loss keeps it short (the collective's
        ``TXQ_REPAIR``)."""
        return 0

    @abc.abstractmethod
    def stats(self) -> dict:
        """Counters: rx_packets, rx_bytes, tx_packets, tx_bytes, rx_invalid,
        rx_truncated, rx_dropped, plus transport-specific ones."""

    @abc.abstractmethod
    def fileno(self) -> int:
        """The socket descriptor (poll it for POLLIN)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release everything; safe to call twice."""

    @property
    def closed(self) -> bool:
        return self.fileno() < 0

    def _check_open(self) -> None:
        if self.closed:
            raise TransportError(errno.EBADF, "transport is closed")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            if not self.closed:
                self.close()
        except Exception:
            pass
