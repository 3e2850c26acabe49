"""AF_XDP transport: UMEM and the four rings as numpy views, no libxdp/libbpf.

:mod:`pydblp.transport.xsk_ring` holds the ABI (socket options, ring layout,
bind), :mod:`pydblp.transport.pacer` the token bucket that paces transmit,
:mod:`pydblp.transport.addresses` the source address and MAC lookups, and
:mod:`pydblp.transport.xsk_rx` the receive copy paths; this module holds the
socket's lifetime, the frame bookkeeping, receive waiting and transmit.

UMEM layout: ``rx_frames`` receive frames, then ``tx_frames`` transmit
frames, ``frame_size`` bytes each (aligned mode); by default 16384 + 4096
frames of 2 KiB, 40 MiB per socket, populated at open: enough for the
collective's senders to have ~1000 packets each in flight without pacing.  Receive frames circulate
fill ring → kernel → rx ring → :meth:`XskTransport.recv` → fill ring;
transmit frames circulate free list → tx ring → kernel → completion ring →
free list.  The fill ring is twice the number of receive frames, so a frame
always fits back (the kernel publishes its consumer index lazily); a pending
list covers the rest.

Transmit bypasses the qdisc: copy mode hands each frame straight to the
driver (``__dev_direct_xmit``), so a TBF or any other qdisc on the device
never sees AF_XDP traffic.  A real NIC still sends at its line rate; a veth
sends as fast as the CPU goes.  ``rate`` (bits/s) emulates the line rate:
a token bucket of ``rate_burst`` bytes (default 1 ms of ``rate``, at least
four frames: the testbed's TBF) decides how many queued frames the kernel
may take; the rest wait in the tx ring, released by later ``send``,
``recv`` and ``flush`` calls (as a qdisc queue drains while the application
goes on), and ``send`` blocks only when the ring is full.  Frames count
with their Ethernet header, as the TBF counts them.  Frames still waiting at
``close`` are dropped.

``tx="kernel"`` transmits through a UDP socket on the same device instead
(:class:`pydblp.transport.udp.UdpTransport` on an ephemeral port, with UDP
GSO): the stack builds the frames, the device's qdisc sees and paces them,
and only receive is AF_XDP.  Meant for devices where AF_XDP transmit is copy
mode and cannot be paced by the qdisc (veth, the testbed): there copy-mode
transmit builds one skb per frame, while a GSO send hands the stack ~45
datagrams at a time.  ``rate`` does not apply then, and the UMEM keeps
only 64 transmit frames (the tx ring is never used).

The XDP program decides what reaches the socket: it redirects packets with
``bpf_redirect_map(&xskmap, ctx->rx_queue_index, ...)``.  This transport
inserts its socket at its queue after bind and fill, and removes it on close,
through ``host`` (an object with ``xsk_insert(queue, fd)`` and
``xsk_remove(queue)``, e.g. :class:`pydblp.host.HostProgram`) or ``xskmap``
(a :class:`pydblp.bpf.Map`).
"""

from __future__ import annotations

import builtins
import ctypes
import errno
import fcntl
import mmap
import select
import socket
import struct
import threading
import time

import numpy as np

from pydblp import dscp as dscp_mod
from pydblp import native as native_mod
from pydblp import net, wire
from pydblp.transport import addresses, frames, xsk_native
from pydblp.transport import xsk_ring as ring
from pydblp.host import PRESSURE_MAX
from pydblp.transport.base import Batch, Transport, TransportError, check_port, parse_ip
from pydblp.transport.pacer import Pacer
from pydblp.transport.xsk_ring import (AF_XDP, SG_MAX_SEGMENTS, SOL_XDP, XDP_COPY, XDP_MAX_TX_SKB_BUDGET,
                                       XDP_OPTIONS, XDP_OPTIONS_ZEROCOPY, XDP_PKT_CONTD,
                                       XDP_RING_NEED_WAKEUP, XDP_USE_NEED_WAKEUP, XDP_USE_SG,
                                       XDP_ZEROCOPY, Ring, pow2)
from pydblp.transport.xsk_rx import XskReceive

def _gathered(batch: Batch, n: int) -> Batch:
    """``batch``'s first ``n`` packets with their payloads copied from ``batch.addr`` into rows (for a
    path that reads rows: multi-buffer transmit; a loop over packets on that rare path)."""
    lens = batch.lengths[:n]
    pay = np.zeros((n, max(int(lens.max()), 1)), np.uint8)
    for i, (a, k) in enumerate(zip(batch.addr[:n].tolist(), lens.tolist())):
        ctypes.memmove(pay[i].ctypes.data, a, k)
    return Batch(batch.headers[:n], pay, lens, batch.peer[:n], n)


_U64 = struct.Struct("=Q")  # the host program's control-packet count (HostMaps.control_seen)
SIOCGIFHWADDR = 0x8927
PRESSURE_STEP = 50  # write the level when it moved this much (or reached 0)


def wait_paced(poll, timeout: float | None, pace: float | None, avail, pump) -> int:
    """Sleep in ``poll`` until ``avail()`` (received frames waiting) is non-zero or ``timeout``
    passes; while paced frames wait to go (``pace``: seconds until the next may, None: none), wake
    to release them (``pump()``, which returns the next ``pace``), as a qdisc's timer would.
    Returns the last ``avail()``."""
    end = None if timeout is None else time.monotonic() + timeout
    while True:
        wait = timeout if pace is None else pace if end is None else \
            builtins.max(0.0, builtins.min(pace, end - time.monotonic()))
        poll.poll(None if wait is None else int(wait * 1000))
        n = avail()
        if n or pace is None or (end is not None and time.monotonic() >= end):
            return n
        pace = pump()


def linger_paced(avail: int, want: int, linger: float, count, pump, ctrl, ctrl_last) -> tuple[int, int | None]:
    """Coalesce a receive: while fewer than ``want`` frames are in (``count()``, ``avail`` now),
    wait up to ``linger`` seconds, still releasing paced frames (``pump()``), until a control packet
    comes (the host program's count ``ctrl()`` moves past ``ctrl_last``).  Returns (frames in,
    the control count seen)."""
    seen = ctrl()
    if 0 < avail < want and linger > 0 and seen == ctrl_last:
        end = time.monotonic() + linger
        while avail < want:
            left = end - time.monotonic()
            if left <= 0:
                break
            pace = pump()
            time.sleep(builtins.min(left, 0.0005 if pace is None else builtins.min(pace, 0.0005)))
            avail = count()
            seen = ctrl()
            if seen != ctrl_last:
                break
    return avail, seen


class XskTransport(XskReceive, Transport):
    """An AF_XDP socket bound to (``netns``, ``ifname``, ``queue``).

    ``mode``: ``'auto'`` (zero-copy if the driver has it, else copy),
    ``'copy'`` or ``'zerocopy'``; veth is copy mode only.  ``recv`` with a
    timeout spins up to ``spin`` seconds on the ring before sleeping in poll(2).  ``pressure`` is
    called with the rx ring occupancy 0..1000 when it changes (default:
    ``host.set_pressure`` when ``host`` is given).  ``port`` is the UDP port
    packets are sent from and to (unless a peer says otherwise) and the one
    accepted on receive.  With ``host`` (pydblp's host program) the kernel has
    validated every DBLP header before redirecting the frame here, so
    ``recv`` only parses; with a foreign ``xskmap`` it validates each header
    again (``wire.validate_batch``) and counts failures in ``rx_invalid``.
    ``rate`` (bits/s, 0: none) and ``rate_burst`` (bytes) pace transmission
    like a line-rate link (module docstring: qdiscs never see AF_XDP frames).
    ``dscp`` (as ``Config.dscp``, :mod:`pydblp.dscp`): the DSCP written into
    each frame's IP header from its DBLP priority.
    ECN: :meth:`set_ect` (True) sends every frame ECN-capable, ECT(0) in the
    IP header's ECN field beside the DSCP (data and control packets alike;
    ``self.ect`` says whether it is on; with ``tx="kernel"`` the UDP socket
    does it, and ``ect`` is what that socket reports); receive reports each
    returned packet's ECN field (0 Not-ECT, 1 ECT(1), 2 ECT(0), 3 CE: a
    switch's congestion mark) in ``Batch.ecn`` when the ``into`` batch has
    that array (``Batch.empty`` makes one; None: not reported), on every
    receive path, lent batches included.
    ``sg``: multi-buffer (``XDP_USE_SG``; None: where the kernel has it,
    6.6+): a frame longer than a UMEM frame (jumbo MTUs) spans several
    descriptors, chained with ``XDP_PKT_CONTD``, on receive and transmit;
    ``self.sg`` says whether it is on.  Without it such frames cannot be
    sent (``ValueError``) and the kernel drops them on receive
    (``rx_dropped``).  The XDP program must then be multi-buffer too
    (:func:`pydblp.bpf.compile_xdp` loads pydblp's that way).
    ``busy_poll`` (microseconds, 0: off, the default: it burns the CPU it
    polls on, which a shared machine cannot spare) turns busy polling on
    (``SO_PREFER_BUSY_POLL``, ``SO_BUSY_POLL``, ``SO_BUSY_POLL_BUDGET`` =
    ``busy_poll_budget``): ``recv``'s poll(2) then runs the device's NAPI
    loop itself; ``self.busy_poll`` says what was set.  A kernel that refuses
    them raises :class:`TransportError` naming the option and the fix.
    ``native``: the per-packet loops in C (``pydblp/csrc/xsk.c``: receive,
    frame building, the fill and completion rings) when True (raise
    :class:`~pydblp.native.NativeUnavailable` if the library is unavailable),
    the pure-Python reference when False, C where available when None
    (``DBLP_NATIVE`` decides as :mod:`pydblp.native` says); ``self.native``
    says which.  Both give the same frames, batches and counters
    (docs/architecture.md, "AF_XDP rings").
    """

    kind = "xsk"

    def __init__(self, ifname: str, netns: str | None = None, queue: int = 0, port: int = wire.DEFAULT_PORT,
                 *, host=None, xskmap=None, pressure=None, mode: str = "auto", frame_size: int = 2048,
                 rx_frames: int = 16384, tx_frames: int = 4096, rx_ring: int | None = None,
                 tx_ring: int | None = None, need_wakeup: bool = True, sg: bool | None = None,
                 bind_timeout: float = 3.0,
                 spin: float = 200e-6, rate: float = 0, rate_burst: int | None = None, tx: str = "xsk",
                 dscp="off", busy_poll: int = 0, busy_poll_budget: int = ring.BUSY_POLL_BUDGET,
                 native: bool | None = None):
        self.ifname, self.netns, self.queue, self.port = ifname, netns, queue, check_port(port)
        self.spin = spin
        if isinstance(busy_poll, bool) or not isinstance(busy_poll, int) or busy_poll < 0:
            raise ValueError(f"busy_poll={busy_poll!r}: microseconds to busy-poll, an integer >= 0 (0: off)")
        self.busy_poll = busy_poll
        if tx not in ("xsk", "kernel"):
            raise ValueError(f"tx={tx!r}: 'xsk' (the AF_XDP tx ring) or 'kernel' (a UDP socket on the device)")
        if tx == "kernel" and rate:
            raise ValueError("rate paces the AF_XDP tx ring; with tx='kernel' the device's qdisc paces (drop rate)")
        self.tx = tx
        self._ktx = self._ctrl = None
        if tx == "kernel":  # the tx ring stays idle: a token UMEM share, not 8 MiB populated for nothing
            tx_frames = min(tx_frames, 64)
        self._tx_lock = threading.Lock()  # send vs. a recv that releases paced frames
        self._fd = -1
        self._sock = None
        self._xlib = None  # the compiled loops (_native_setup), None: the Python path
        self.native = False
        self._rings: list[Ring] = []
        self._umem_mm = None
        self._host, self._xskmap = host, xskmap
        # pydblp's host program redirects a frame here only after wire.validate's checks
        # (the agreement tests hold the two equal), so receive need not repeat them
        self._validated = host is not None
        if pressure is None and host is not None and hasattr(host, "set_pressure"):
            pressure = host.set_pressure
        self._pressure_fn = pressure
        self._pressure = -1
        # pydblp's host program counts the control packets it redirects (HostMaps.control_seen):
        # a lingering receive stops once one came since the last receive
        self._ctrl = host.control_seen() if host is not None and hasattr(host, "control_seen") else None
        self._ctrl_last = self._ctrl_count()
        self._inserted = False
        if frame_size not in (2048, 4096):
            raise ValueError("frame_size must be 2048 or 4096 (aligned UMEM chunks)")
        self.frame_size = frame_size
        self.rx_frames, self.tx_frames = pow2(rx_frames, "rx_frames"), pow2(tx_frames, "tx_frames")
        rx_ring = pow2(rx_ring or rx_frames, "rx_ring")
        tx_ring = pow2(tx_ring or tx_frames, "tx_ring")
        fill_ring, comp_ring = 2 * rx_frames, 2 * tx_frames
        self._pacer = Pacer(rate, rate_burst, tx_ring, 4 * frame_size)
        self.rate, self.rate_burst = self._pacer.rate, self._pacer.burst
        self._sources = frames.Sources()
        self._tmpl = frames.Templates()
        self._dscp = dscp
        self._tos = dscp_mod.tos_table(dscp)  # header prio -> TOS / traffic class byte; None: 0
        self._c = dict.fromkeys(("rx_packets", "rx_bytes", "tx_packets", "tx_bytes", "rx_invalid",
                                 "rx_truncated", "rx_errors", "tx_busy_drops", "tx_kicks", "rx_polls", "tx_held"), 0)
        try:
            with net.in_netns(netns):
                self._sock = socket.socket(AF_XDP, socket.SOCK_RAW, 0)
                self._fd = self._sock.fileno()
                try:
                    self.ifindex = socket.if_nametoindex(ifname)
                except OSError:
                    raise TransportError(errno.ENODEV, f"no interface {ifname!r}"
                                         + (f" in netns {netns}" if netns else "")) from None
                with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # AF_XDP has no ioctls
                    ifr = fcntl.ioctl(s.fileno(), SIOCGIFHWADDR, struct.pack("256s", ifname.encode()))
                self.mac = ifr[18:24]
            if busy_poll:
                ring.busy_poll(self._sock, busy_poll, busy_poll_budget)
            nframes = rx_frames + tx_frames
            size = nframes * frame_size
            self._umem_mm = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
            self._umem = np.frombuffer(self._umem_mm, np.uint8)
            self._umem2d = self._umem.reshape(nframes, frame_size)
            ring.register_umem(self._sock, self._umem, frame_size)
            self._rx, self._tx, self._fill, self._comp = ring.map_rings(self._sock, rx_ring, tx_ring, fill_ring,
                                                                        comp_ring, self._rings)
            try:  # let one sendto() push a whole tx ring instead of 32 descriptors
                self._sock.setsockopt(SOL_XDP, XDP_MAX_TX_SKB_BUDGET, tx_ring)
                self.tx_budget = tx_ring
            except OSError:
                self.tx_budget = 32
            # frames: receive ones go to the fill ring now, transmit ones to the free list
            self._fill_pending = np.zeros(0, np.uint64)
            self._lent = None  # frames whose payload the last recv(copy=False) lent out
            self._taking = None  # (rx ring index, descriptors available) while a batch is received
            self._taken = None   # addresses of the frames it took off the rx ring (given back on an error)
            self._fill_push(np.arange(rx_frames, dtype=np.uint64) * np.uint64(frame_size))
            # transmit frames: a FIFO, so frames leave and complete in UMEM order and a
            # batch usually gets consecutive frames it can be built in place into
            self._tx_free = (np.arange(rx_frames, nframes, dtype=np.uint64) * np.uint64(frame_size))
            self._tx_head = 0
            self._tx_nfree = tx_frames
            self._tx_outstanding = 0
            self._wprod = int(self._tx.prod[0])  # descriptors written up to here; tx.prod: handed to the kernel
            self._tx_words = self._tx.desc.view(np.uint64).reshape(-1, 2)
            flags = {"auto": 0, "copy": XDP_COPY, "zerocopy": XDP_ZEROCOPY}[mode]
            if need_wakeup:
                flags |= XDP_USE_NEED_WAKEUP
            self.need_wakeup = need_wakeup
            self.sg = False
            if sg is not False:  # multi-buffer where the kernel has it: frames larger than a UMEM frame
                try:
                    self._bind(flags | XDP_USE_SG, bind_timeout)
                    self.sg = True
                except TransportError as e:
                    if sg or e.errno != errno.EINVAL:
                        raise
            if not self.sg:
                self._bind(flags, bind_timeout)
            self._native_setup(native)
            opts = struct.unpack("=I", self._sock.getsockopt(SOL_XDP, XDP_OPTIONS, 4))[0]
            self.zerocopy = bool(opts & XDP_OPTIONS_ZEROCOPY)
            self._insert()
            self._poll = select.poll()
            self._poll.register(self._fd, select.POLLIN)
            if tx == "kernel":  # its own ephemeral port: it must not take this port's traffic
                from pydblp.transport.udp import UdpTransport

                self._ktx = UdpTransport(ifname, netns=netns, port=0, gro=False, rcvbuf=4096, dscp=dscp)
                self.reads_addresses = self._ktx.reads_addresses  # (send is the UDP socket's)
        except BaseException:
            self.close()
            raise

    # ---- setup ---------------------------------------------------------

    def _native_setup(self, native: bool | None, lib=None) -> None:
        """Choose the path (``native`` as in the class docstring; ``lib``: a library to use instead
        of loading one) and, for C, build the structures it reads the rings and UMEM through.

        Raises:
            pydblp.native.NativeUnavailable: ``native=True`` (or ``DBLP_NATIVE=1``) without the library.
        """
        if lib is None and native is not False:
            lib = xsk_native.load_lib()
        self._xlib = native_mod.choose(native, lib, "xsk")
        self.native = self.reads_addresses = self._xlib is not None  # (tx="kernel": the UDP socket's, below)
        if not self.native:
            return
        x = self._xrx = xsk_native.RxCtx()
        x.rx, x.fill = xsk_native.ring_c(self._rx), xsk_native.ring_c(self._fill)
        x.umem, x.umem_len, x.fs, x.port = self._umem.ctypes.data, self._umem.nbytes, self.frame_size, self.port
        x.validated, x.sg = int(self._validated), int(self.sg)
        self._xtaken = np.empty(self._rx.n, np.uint64)  # frames a receive took (C writes them)
        self._xsrc = np.empty(self._rx.n, np.int64)     # C's scratch: payload offsets
        x.taken, x.src = self._xtaken.ctypes.data, self._xsrc.ctypes.data
        self._xres = np.zeros(9, np.int64)              # dblp_xsk_rx's results
        self._xflens = np.empty(self._tx.n, np.int64)   # dblp_xsk_tx's frame lengths
        self._xrings = {name: xsk_native.ring_c(r) for name, r in (("fill", self._fill), ("tx", self._tx),
                                                                   ("comp", self._comp))}
        self._xaddr = {name: ctypes.addressof(r) for name, r in self._xrings.items()}
        self._xaddr["rx"] = ctypes.addressof(x)
        self._xaddr["txprod"] = self._tx.prod.ctypes.data
        self._xaddr["res"] = self._xres.ctypes.data
        self._xaddr["flens"] = self._xflens.ctypes.data
        self._xchk = np.zeros(4, np.int64)  # dblp_xsk_tx_check's results
        self._xaddr["chk"] = self._xchk.ctypes.data
        self._xinto = None  # (arrays, addresses) of the batch the last receive wrote
        # dblp_xsk_tx's arguments that stay: UMEM, frame size, free list, its size; the templates'
        # addresses (_native_sources renews them); TOS table
        self._xtx_fixed = (self._umem.ctypes.data, self.frame_size, self._tx_free.ctypes.data, self.tx_frames)
        self._xtos = None if self._tos is None else self._tos.ctypes.data
        self._xkeep: tuple = ()  # the source arrays the C receive is pointed at, and the ones before
        self._native_sources()

    def _native_sources(self) -> None:
        """Point the C receive at the current registered sources (after each ``add_peer``).  The
        arrays it pointed at just before stay alive too (a batch being read as they change may
        still hold them: microseconds, against the milliseconds an ``add_peer`` takes); older
        ones are freed (keeping them all grew with the square of the peers)."""
        if self._xlib is not None:
            self._xkeep = (self._xkeep[-1:] if self._xkeep else ()) + (
                xsk_native.set_sources(self._xrx, self._sources),)
            tp = self._tmpl
            self._xtmpl = (tp.table.ctypes.data, tp.table.shape[1], tp.hlen.ctypes.data, tp.partial.ctypes.data)

    def _bind(self, flags: int, timeout: float) -> None:
        self.bind_retries = ring.bind(self._fd, self.ifname, self.ifindex, self.queue, flags, timeout)

    def _insert(self) -> None:
        if self._host is not None:
            self._host.xsk_insert(self.queue, self._fd)
        elif self._xskmap is not None:
            self._xskmap.update(struct.pack("=I", self.queue), struct.pack("=I", self._fd))
        else:
            return
        self._inserted = True

    def _remove(self) -> None:
        if not self._inserted:
            return
        self._inserted = False
        if self._host is not None:
            self._host.xsk_remove(self.queue)
        else:
            self._xskmap.delete(struct.pack("=I", self.queue))

    # ---- ECN -----------------------------------------------------------

    def set_ect(self, on: bool) -> None:
        """Send ECT(0) in every frame's IP header (RFC 3168) from now on, or stop (``on`` False).

        AF_XDP transmit writes the TOS table (:func:`pydblp.dscp.tos_table` with ``ect``) into
        each frame, on the Python and the compiled path alike; with ``tx="kernel"`` the UDP
        socket that transmits sets it, and ``self.ect`` is what that socket reports.
        Taken under the transmit lock: a ``send`` in another thread builds each batch with
        one table.
        """
        on = bool(on)
        tos = dscp_mod.tos_table(self._dscp, ect=on)
        with self._tx_lock:
            self._tos = tos
            if self._xlib is not None:
                self._xtos = None if tos is None else tos.ctypes.data
        if self._ktx is not None:
            self._ktx.set_ect(on)
            self.ect = bool(self._ktx.ect)
        else:
            self.ect = on

    # ---- peers ---------------------------------------------------------

    def add_peer(self, addr, port: int = wire.DEFAULT_PORT, mac=None, src=None) -> int:
        """Register ``addr`` (IPv4 or IPv6).  Frames to it carry ``mac``, or else the MAC of the
        next hop (``addr`` on the link, else the gateway of the kernel's route to it, which must
        leave by this interface) from the kernel's ARP/ND table, resolved on demand; ``src``
        overrides the local address (default: one in ``addr``'s subnet, else the route's source).
        Safe beside a ``send`` in another thread (the templates change under the transmit
        lock); not beside a ``recv`` (one thread receives, as the collective's poll owner).

        Raises:
            TransportError: ENETUNREACH: no route to ``addr``, one out of another interface, or
                ``addr`` is this host's and no ``mac`` given; EHOSTUNREACH: the next hop's MAC
                did not resolve; EADDRNOTAVAIL: ``addr`` is this host's and transmit is the
                kernel's (``tx="kernel"``), which would deliver inside the host."""
        dst = parse_ip(addr)
        port = check_port(port, "peer port")
        if self._ktx is not None and addresses.is_local(dst, self.netns):
            raise TransportError(errno.EADDRNOTAVAIL, f"{dst} is an address of this host: kernel transmit "
                                 f"delivers to it inside the host, where its AF_XDP socket never sees it; "
                                 f"use transport xsk (or udp) for ranks that share a host")
        src = parse_ip(src) if src is not None else addresses.local_addr(self.ifindex, self.ifname, dst, self.netns)
        dmac = (frames.mac_bytes(mac) if mac is not None
                else addresses.resolve_mac(self.ifindex, self.ifname, dst, self.netns))
        t, partial = frames.template(self.mac, dmac, src, dst, self.port, port)
        with self._tx_lock:  # (a send in C reads the templates' addresses)
            pid = self._tmpl.add(t, partial)
            self._sources.add(dst)
            self._native_sources()
        if self._ktx is not None:
            self._ktx.add_peer(dst, port)
        return pid

    # ---- receive -------------------------------------------------------

    def _fill_push(self, addrs: np.ndarray) -> None:
        if len(self._fill_pending):
            addrs = np.concatenate([self._fill_pending, addrs])
        if self._xlib is not None:
            addrs = np.ascontiguousarray(addrs, np.uint64)
            k = self._xlib.dblp_xsk_produce(self._xaddr["fill"], addrs.ctypes.data, len(addrs))
        else:
            k = self._fill.produce(addrs)
        self._fill_pending = addrs[k:].copy() if k < len(addrs) else addrs[:0]

    def _set_pressure(self, level: int) -> None:
        if self._pressure_fn is None:
            return
        if abs(level - self._pressure) >= PRESSURE_STEP or (level == 0 and self._pressure != 0):
            self._pressure_fn(level)
            self._pressure = level

    def _recv(self, into: Batch, timeout: float | None, max: int | None, want: int, linger: float,
              copy: bool) -> Batch:
        cap = into.cap if max is None else min(max, into.cap)
        rx = self._rx
        if self._lent is not None:  # the caller is done with the payload the last call lent
            self._fill_push(self._lent)
            self._lent = None
        pace = self._pump()
        cons = int(rx.cons[0])
        avail = (int(rx.prod[0]) - cons) & 0xFFFFFFFF
        if avail == 0:
            def ready():
                nonlocal avail
                avail = (int(rx.prod[0]) - cons) & 0xFFFFFFFF
                return avail > 0

            self._spin(ready, timeout)
            if avail == 0 and (self.need_wakeup and int(self._fill.flags[0]) & XDP_RING_NEED_WAKEUP or timeout != 0):
                self._c["rx_polls"] += 1
                avail = wait_paced(self._poll, timeout, pace, lambda: (int(rx.prod[0]) - cons) & 0xFFFFFFFF,
                                   self._pump)
        avail, self._ctrl_last = linger_paced(avail, want, linger, lambda: (int(rx.prod[0]) - cons) & 0xFFFFFFFF,
                                              self._pump, self._ctrl_count, self._ctrl_last)
        self._set_pressure(avail * PRESSURE_MAX // rx.n)
        self._taking, self._taken = (cons, avail), None
        got = self._receive(into, cons, avail, cap, copy)
        self._taking = self._taken = None
        return got

    def _recv_failed(self, e: Exception) -> None:
        """Give the failed batch's frames back to the fill ring (taking its descriptors off the rx
        ring first if the error came before they were: a batch that raises is never met twice)."""
        if self._taking is not None and self._taken is None:  # (the paths set _taken as they consume)
            cons, avail = self._taking
            self._taken = self._rx.at(cons, avail)["addr"].astype(np.int64)
            self._rx.consume(cons, avail)
        if self._taken is not None:
            fs = self.frame_size
            self._fill_push((self._taken // fs * fs).astype(np.uint64))
        self._taking = self._taken = None
        super()._recv_failed(e)

    # ---- transmit ------------------------------------------------------

    def _reclaim(self) -> int:
        if self._xlib is not None:
            n = self._xlib.dblp_xsk_reclaim(self._xaddr["comp"], self._tx_free.ctypes.data, self.tx_frames,
                                            (self._tx_head + self._tx_nfree) % self.tx_frames)
            self._tx_nfree += n
            self._tx_outstanding -= n
            return n
        c = self._comp
        cons = int(c.cons[0])
        n = (int(c.prod[0]) - cons) & 0xFFFFFFFF
        if n:
            addrs = c.at(cons, n)
            T = self.tx_frames
            tail = (self._tx_head + self._tx_nfree) % T
            if tail + n <= T:  # completions return the frame addresses we queued
                self._tx_free[tail: tail + n] = addrs
            else:
                self._tx_free[(tail + np.arange(n)) % T] = addrs
            c.consume(cons, n)
            self._tx_nfree += n
            self._tx_outstanding -= n
        return n

    def _pump(self) -> float | None:
        """From recv: release paced frames that may go; seconds until the next may (None: none waits).

        Skipped (None) while a send in another thread holds the transmit side.
        """
        if self._wprod == int(self._tx.prod[0]) or not self._tx_lock.acquire(blocking=False):
            return None
        try:
            self._release()
            self._kick()
            if self._wprod == int(self._tx.prod[0]):
                return None
            return builtins.max(0.001, self._pace_wait())  # poll(2) counts milliseconds
        finally:
            self._tx_lock.release()

    def _release(self) -> int:
        """Hand the kernel the written descriptors the token bucket allows (all when unpaced)."""
        tx = self._tx
        prod = int(tx.prod[0])
        waiting = (self._wprod - prod) & 0xFFFFFFFF
        if waiting == 0:
            return 0
        k = self._pacer.take(prod, waiting)
        if k:
            if self._xlib is not None:  # a release store: the descriptors before the index
                self._xlib.dblp_xsk_publish(self._xaddr["txprod"], (prod + k) & 0xFFFFFFFF)
            else:
                tx.prod[0] = (prod + k) & 0xFFFFFFFF
        if self._wprod != int(tx.prod[0]):
            self._c["tx_held"] += 1  # release calls that left frames waiting for tokens
        return k

    @property
    def reports_tx_queue(self) -> bool:
        """Only with ``tx="kernel"``: AF_XDP transmit cannot tell what the driver still holds."""
        return self._ktx is not None

    def tx_queued(self) -> int:
        """With ``tx="kernel"``, its UDP socket's send queue; AF_XDP transmit: 0 (paced here, and
        the copy-mode driver path holds no queue of its own)."""
        return self._ktx.tx_queued() if self._ktx is not None else 0

    def tx_backlog(self) -> float:
        return self._pacer.backlog()

    def _pace_wait(self) -> float:
        """Seconds until the token bucket lets the next waiting frame go (0: none waits)."""
        tx = self._tx
        prod = int(tx.prod[0])
        if self._wprod == prod:
            return 0.0
        return self._pacer.wait(int(tx.desc["len"][prod & tx.mask]))

    def _kick(self) -> bool:
        """Let the kernel consume the tx ring; False when it pushed back (busy)."""
        tx = self._tx
        for _ in range(2 + tx.n // 32):
            if int(tx.cons[0]) == int(tx.prod[0]):
                return True
            if self.zerocopy and self.need_wakeup and not int(tx.flags[0]) & XDP_RING_NEED_WAKEUP:
                return True
            self._c["tx_kicks"] += 1
            try:
                self._sock.send(b"", socket.MSG_DONTWAIT)
            except BlockingIOError:  # EAGAIN: device queue busy, descriptors kept
                return False
            except OSError as e:
                if e.errno == errno.EBUSY:  # the kernel dropped one frame (NET_XMIT_DROP)
                    self._c["tx_busy_drops"] += 1
                    continue
                if e.errno == errno.ENOBUFS:
                    return False
                raise
        return int(tx.cons[0]) == int(tx.prod[0])

    def send(self, batch: Batch, timeout: float | None = 1.0) -> int:
        self._check_open()
        if self._ktx is not None:
            return self._ktx.send(batch, timeout)
        n = len(batch)
        if n == 0:
            return 0
        if self._xlib is not None:
            prep = self._native_prepare(batch, n)
            if prep is not None:
                deadline = None if timeout is None else time.monotonic() + timeout
                with self._tx_lock:
                    return self._send_native(prep, n, deadline)
            if batch.addr is not None:  # multi-buffer frames: the Python path reads payload rows
                batch = _gathered(batch, n)
        peer = batch.peer[:n]
        if peer.min() < 0 or peer.max() >= len(self._tmpl):
            raise ValueError(f"peer ids must be in [0, {len(self._tmpl)}); add_peer() first")
        hl = self._tmpl.hlen[peer]
        hl_max = int(hl.max())
        one_hl = hl_max == int(hl.min())  # one header length: frames built in one pass
        fs = self.frame_size
        longest = int(batch.lengths[:n].max()) + wire.HEADER_LEN + hl_max
        longest += longest & 1  # frames are built to an even width
        if longest > fs and not self.sg:
            raise ValueError(f"a {longest}-byte frame does not fit a {fs}-byte UMEM frame "
                             "(frames spanning UMEM frames need multi-buffer AF_XDP: kernel 6.6+)")
        if -(-longest // fs) > SG_MAX_SEGMENTS:
            raise ValueError(f"a {longest}-byte frame needs more than {SG_MAX_SEGMENTS} {fs}-byte UMEM frames")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._tx_lock:
            if longest <= fs:
                return self._send_locked(batch, n, hl_max, one_hl, deadline)
            flen = hl + wire.HEADER_LEN + batch.lengths[:n]
            return self._send_sg(batch, n, (flen + (flen & 1) + fs - 1) // fs, deadline)

    def _send_sg(self, batch: Batch, n: int, segs: np.ndarray, deadline: float | None) -> int:
        """``_send_locked`` for a batch with frames spanning UMEM frames (multi-buffer).

        Packet i takes ``segs[i]`` UMEM frames and as many descriptors, all
        but its last with ``XDP_PKT_CONTD``; pacing releases a frame's
        descriptors together.  When every packet of a pass spans the same
        number of frames and the free list hands out a consecutive run (the
        collective's batches: same-size chunks), frames are built in place
        across them; otherwise built in scratch and scattered, segment by
        segment in one numpy gather (no loop over packets).
        """
        tx, fs, T = self._tx, self.frame_size, self.tx_frames
        csum = np.concatenate(([0], np.cumsum(segs)))  # frames used by packets before i
        sent = 0
        while sent < n:
            self._reclaim()
            prod = self._wprod
            room = min(self._tx_nfree, tx.n - ((prod - int(tx.cons[0])) & 0xFFFFFFFF))
            m = int(np.searchsorted(csum[sent:], csum[sent] + room, side="right")) - 1  # whole packets that fit
            m = min(m, n - sent)
            if m == 0:
                if not self._wait_room(deadline):
                    break
                continue
            k = segs[sent: sent + m]
            q = int(csum[sent + m] - csum[sent])
            kmax = int(k.max())
            addrs = self._tx_free[(self._tx_head + np.arange(q)) % T]
            self._tx_head = (self._tx_head + q) % T
            self._tx_nfree -= q
            fr = (addrs // np.uint64(fs)).astype(np.int64)
            part = batch.view(sent, sent + m)
            f0 = int(fr[0])
            hl = self._tmpl.hlen[part.peer]
            one_hl = bool((hl == hl[0]).all())
            inplace = one_hl and int(k.min()) == kmax and int(fr[-1]) - f0 == q - 1 and bool((np.diff(fr) == 1).all())
            span = self._umem[f0 * fs: (f0 + q) * fs].reshape(m, kmax * fs) if inplace else \
                np.empty((m, kmax * fs), np.uint8)
            if one_hl:
                _, lens = frames.build_one(self._tmpl, int(hl[0]), part.peer, part.headers, part.payload,
                                           part.lengths, out=span, tos=self._tos_of(part))
            else:
                lens = np.empty(m, np.int64)
                for rows, st, flen in frames.build(self._tmpl, part.peer, part.headers, part.payload,
                                                   part.lengths, self._tos_of(part)):  # rows: index arrays
                    span[rows, : st.shape[1]] = st
                    lens[rows] = flen
            pk = np.repeat(np.arange(m), k)  # packet of each descriptor
            j = np.arange(q) - np.repeat(csum[sent: sent + m] - csum[sent], k)  # its segment in the packet
            if not inplace:
                self._umem2d[fr] = span.reshape(m, kmax, fs)[pk, j]
            last = j == k[pk] - 1
            dlen = np.where(last, lens[pk] - j * fs, fs)
            words = np.empty((q, 2), np.uint64)
            words[:, 0] = addrs
            words[:, 1] = dlen.astype(np.uint64) | (np.where(last, 0, XDP_PKT_CONTD).astype(np.uint64) << 32)
            slots = (prod + np.arange(q)) & tx.mask
            self._tx_words[slots] = words
            self._queued(slots, lens, k, part)
            sent += m
        self._push_out(deadline)
        return sent

    def _native_prepare(self, batch: Batch, n: int) -> tuple | None:
        """``send``'s checks in one C call, and the batch's arrays as C reads them; None for a batch
        with a frame longer than a UMEM frame (the Python paths send it, or refuse it).

        Raises:
            ValueError: a peer id not from ``add_peer``, or a length outside the payload rows.
        """
        h = batch.headers[:n]
        if not (h.flags.c_contiguous and h.dtype == wire.HEADER_DTYPE):
            h = np.ascontiguousarray(h, wire.HEADER_DTYPE)
        pay = batch.payload[:n]
        if pay.ndim != 2 or pay.strides[1] != 1 or pay.strides[0] < pay.shape[1]:
            pay = np.ascontiguousarray(pay, np.uint8)
        ln = np.ascontiguousarray(batch.lengths[:n], np.int32)
        peer = np.ascontiguousarray(batch.peer[:n], np.int32)
        addr = None if batch.addr is None else np.ascontiguousarray(batch.addr[:n], np.uint64)
        if self._xlib.dblp_xsk_tx_check(n, peer.ctypes.data, ln.ctypes.data, len(self._tmpl), self._xtmpl[2],
                                        self._xaddr["chk"]):
            raise ValueError(f"peer ids must be in [0, {len(self._tmpl)}); add_peer() first")
        longest, shortest, hl_max, total = self._xchk.tolist()
        if shortest < 0 or (addr is None and longest > pay.shape[1]):  # (the caller vouches for addr's bytes)
            raise ValueError(f"lengths {shortest}..{longest} outside the payload width 0..{pay.shape[1]}")
        longest += wire.HEADER_LEN + hl_max  # as send reckons it for the Python paths
        if longest + (longest & 1) > self.frame_size:
            return None
        return h, pay, ln, peer, total, addr

    def _send_native(self, prep: tuple, n: int, deadline: float | None) -> int:
        """``_send_locked`` in C: each pass builds as many frames as the free list and the ring
        hold in one call (any peers, any free frames) and, unpaced, hands them to the kernel."""
        tx, T, lib = self._tx, self.tx_frames, self._xlib
        h, pay, ln, peer, total, addr = prep
        paced = bool(self._pacer.Bps)
        ps = pay.strides[0]
        hp, pp, lp, rp = h.ctypes.data, pay.ctypes.data, ln.ctypes.data, peer.ctypes.data
        ap = None if addr is None else addr.ctypes.data
        tx_addr, fixed, tmpl, tos, flens = self._xaddr["tx"], self._xtx_fixed, self._xtmpl, self._xtos, self._xflens
        sent = 0
        while sent < n:
            self._reclaim()
            prod = self._wprod
            m = min(n - sent, self._tx_nfree)
            if m:  # C takes what the ring has room for; unpaced, it also releases them
                m = lib.dblp_xsk_tx(tx_addr, *fixed, self._tx_head, prod, *tmpl, tos, hp + wire.HEADER_LEN * sent,
                                    pp + ps * sent, ps, None if ap is None else ap + 8 * sent, lp + 4 * sent,
                                    rp + 4 * sent, m, self._xaddr["flens"],
                                    not paced)
            if m == 0:
                if not self._wait_room(deadline):
                    break
                continue
            self._tx_head = (self._tx_head + m) % T
            self._tx_nfree -= m
            if paced:
                self._pacer.queued((prod + np.arange(m)) & tx.mask, flens[:m], 1)
            self._wprod = (prod + m) & 0xFFFFFFFF
            self._tx_outstanding += m
            self._c["tx_packets"] += m
            self._c["tx_bytes"] += (total if m == n else int(ln[sent: sent + m].sum())) + m * wire.HEADER_LEN
            self._release()
            self._kick()
            sent += m
        self._push_out(deadline)
        return sent

    def _send_locked(self, batch: Batch, n: int, hl_max: int, one_hl: bool, deadline: float | None) -> int:
        tx = self._tx
        sent = 0
        while sent < n:
            self._reclaim()
            prod = self._wprod
            space = tx.n - ((prod - int(tx.cons[0])) & 0xFFFFFFFF)
            m = min(n - sent, self._tx_nfree, space)
            if m == 0:
                if not self._wait_room(deadline):
                    break
                continue
            fs = self.frame_size
            T = self.tx_frames
            i0 = prod & tx.mask
            m = min(m, T - self._tx_head, tx.n - i0)  # no wrap of the free list or the ring this pass
            addrs = self._tx_free[self._tx_head: self._tx_head + m]
            fr = (addrs // np.uint64(fs)).astype(np.int64)
            if int(fr[-1]) - int(fr[0]) != m - 1 or not (np.diff(fr) == 1).all():
                m = int(np.flatnonzero(np.diff(fr) != 1)[0]) + 1  # the consecutive run; the rest next pass
                addrs, fr = addrs[:m], fr[:m]
            self._tx_head = (self._tx_head + m) % T
            self._tx_nfree -= m
            part = batch.view(sent, sent + m)
            f0 = int(fr[0])
            if one_hl:  # built in place: every frame fits a UMEM frame (checked above)
                _, lens = frames.build_one(self._tmpl, hl_max, part.peer, part.headers, part.payload,
                                           part.lengths, out=self._umem2d[f0: f0 + m], tos=self._tos_of(part))
            else:
                lens = np.empty(m, np.int64)
                for rows, st, flen in frames.build(self._tmpl, part.peer, part.headers, part.payload,
                                                   part.lengths, self._tos_of(part)):
                    self._umem2d[fr[rows], : st.shape[1]] = st
                    lens[rows] = flen
            dd = self._tx_words[i0: i0 + m]  # descriptors as (addr, len | options << 32) words
            dd[:, 0] = addrs
            dd[:, 1] = lens
            self._queued(slice(i0, i0 + m), lens, 1, part)
            sent += m
        self._push_out(deadline)
        return sent

    def _tos_of(self, part: Batch) -> np.ndarray | None:
        """The TOS byte of each packet of ``part`` from its priority, or None (none set)."""
        return None if self._tos is None else self._tos[part.headers["prio"]]

    def _wait_room(self, deadline: float | None) -> bool:
        """The ring or the frames are all taken: push, wait for completions (and tokens, when paced).

        False once ``deadline`` has passed.
        """
        self._release()
        self._kick()
        if self._reclaim() == 0:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(min(0.001, max(0.0002, self._pace_wait())))
        return True

    def _queued(self, slots, lens: np.ndarray, k, part: Batch) -> None:
        """Account ``len(lens)`` frames of ``k`` descriptors each (an int, or one count per frame),
        just written at tx ring ``slots`` (from ``_wprod`` on); hand the kernel what the tokens allow."""
        m = len(lens)
        q = int(np.sum(k)) if np.ndim(k) else m * k
        self._pacer.queued(slots, lens, k)
        self._wprod = (self._wprod + q) & 0xFFFFFFFF
        self._tx_outstanding += q
        self._c["tx_packets"] += m
        self._c["tx_bytes"] += int(part.lengths.sum()) + m * wire.HEADER_LEN
        self._release()
        self._kick()

    def _push_out(self, deadline: float | None) -> None:
        """Leave nothing released queued behind a busy device while there is time."""
        tx = self._tx
        while int(tx.cons[0]) != int(tx.prod[0]) and not self._kick():
            if deadline is not None and time.monotonic() >= deadline:
                break
            time.sleep(0.0002)
        self._reclaim()

    def flush(self, timeout: float = 1.0) -> bool:
        """Wait until every queued frame has completed (paced ones sent first); True if they all did."""
        deadline = time.monotonic() + timeout
        while True:
            with self._tx_lock:
                self._release()
                self._kick()
                self._reclaim()
                wait = self._pace_wait()
            if self._tx_outstanding == 0:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.001, max(0.0002, wait)))

    # ---- the rest -----------------------------------------------------

    def xdp_statistics(self) -> dict:
        return ring.statistics(self._sock)

    def stats(self) -> dict:
        s = dict(self._c)
        if self._fd >= 0:
            s.update(self.xdp_statistics())
            s["rx_ring_used"] = (int(self._rx.prod[0]) - int(self._rx.cons[0])) & 0xFFFFFFFF
            s["tx_outstanding"] = self._tx_outstanding
            s["tx_waiting"] = (self._wprod - int(self._tx.prod[0])) & 0xFFFFFFFF  # paced, not yet handed over
            s["pressure"] = max(self._pressure, 0)
            s["zerocopy"] = self.zerocopy
        if self._ktx is not None:
            s.update((k, v) for k, v in self._ktx.stats().items() if k.startswith("tx_"))
        return s

    def _ctrl_count(self) -> int | None:
        """The host program's count of control packets redirected (None: no such count)."""
        return None if self._ctrl is None else _U64.unpack_from(self._ctrl)[0]

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._ktx is not None:
            self._ktx.close()
            self._ktx = None
        if self._ctrl is not None:
            self._ctrl.close()
            self._ctrl = None
        if self._sock is None:
            return
        try:
            self._remove()
        except OSError:
            pass
        finally:
            if self._pressure_fn is not None and self._pressure > 0:
                try:
                    self._pressure_fn(0)
                except Exception:
                    pass
            self._pressure = -1
            self._tx_words = None  # a view of the tx ring: it must go before the ring's mapping
            leaked = [r for r in self._rings if not r.close()]
            self._rings = []
            self._rx = self._tx = self._fill = self._comp = None
            self._sock.close()
            self._sock = None
            self._fd = -1
            self._umem = self._umem2d = None
            if self._umem_mm is not None:
                try:
                    self._umem_mm.close()
                except BufferError:
                    leaked.append(self._umem_mm)
                self._umem_mm = None
            self._leaked = len(leaked)
