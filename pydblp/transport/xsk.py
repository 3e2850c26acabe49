"""AF_XDP transport: raw syscalls, UMEM and the four rings as numpy views.

No libxdp/libbpf: ``socket(AF_XDP)``, ``setsockopt``/``getsockopt`` through
the socket module, ``mmap`` through the mmap module, and ``bind`` through
ctypes (Python's ``socket.bind`` rejects family 44).  DESIGN.md section 5
lists the facts and traps this follows.

UMEM layout: ``rx_frames`` receive frames, then ``tx_frames`` transmit
frames, ``frame_size`` bytes each (aligned mode); by default 16384 + 4096
frames of 2 KiB, 40 MiB per socket, populated at open: enough for the
collective's senders to have ~1000 packets each in flight without pacing.  Receive frames circulate
fill ring → kernel → rx ring → :meth:`XskTransport.recv` → fill ring;
transmit frames circulate free list → tx ring → kernel → completion ring →
free list.  The fill ring is twice the number of receive frames, so a frame
always fits back (the kernel publishes its consumer index lazily); a pending
list covers the rest.

Ring indices are read and written as plain numpy uint32 loads and stores.
That is correct on x86-64 (TSO: stores are not reordered with stores,
loads not with loads; every crossing of the interpreter is a compiler
barrier); another architecture would need explicit barriers.

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
import ipaddress
import mmap
import os
import select
import socket
import struct
import threading
import time

import numpy as np

from pydblp import net, wire
from pydblp._libc import libc
from pydblp.transport import frames
from pydblp.transport.base import Batch, Transport, TransportError, check_port, parse_ip

AF_XDP = 44
SOL_XDP = 283
_U64 = struct.Struct("=Q")  # the host program's control-packet count (HostMaps.control_seen)
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
SIOCGIFHWADDR = 0x8927
XDP_PACKET_HEADROOM = 256  # copy-mode receive writes a frame this far into its UMEM frame
FRAME_HEADERS = 14 + wire.DATAGRAM_OVERHEAD  # Ethernet, then IPv6 (the longer IP header), UDP, DBLP


def frame_size_for(payload: int) -> int:
    """The UMEM frame size (2048 or 4096) whose receive frames hold a DBLP datagram of ``payload``
    bytes whole: 2048 up to 1698 bytes (1408, the collective's default chunk, fits), else 4096
    (past ~3800 bytes a datagram spans several frames, with ``XDP_USE_SG``)."""
    return 2048 if FRAME_HEADERS + payload + XDP_PACKET_HEADROOM <= 2048 else 4096


DESC_DTYPE = np.dtype([("addr", "<u8"), ("len", "<u4"), ("options", "<u4")])
STAT_FIELDS = ("rx_dropped", "rx_invalid_descs", "tx_invalid_descs", "rx_ring_full",
               "rx_fill_ring_empty_descs", "tx_ring_empty_descs")
PRESSURE_MAX = 1000
PRESSURE_STEP = 50  # write the level when it moved this much (or reached 0)

libc.bind.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32)


class _Ring:
    """One mmap'ed ring: producer, consumer, flags (uint32 views) and descriptors."""

    def __init__(self, fd: int, pgoff: int, offs: tuple, n: int, dtype: np.dtype):
        prod, cons, desc, flags = offs
        size = desc + n * dtype.itemsize
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE,
                            mmap.PROT_READ | mmap.PROT_WRITE, offset=pgoff)
        buf = np.frombuffer(self.mm, np.uint8)
        self.prod = buf[prod: prod + 4].view(np.uint32)
        self.cons = buf[cons: cons + 4].view(np.uint32)
        self.flags = buf[flags: flags + 4].view(np.uint32)
        self.desc = buf[desc: desc + n * dtype.itemsize].view(dtype)
        self.n = n
        self.mask = n - 1

    def close(self) -> bool:
        self.prod = self.cons = self.flags = self.desc = None
        try:
            self.mm.close()
            return True
        except BufferError:  # a view escaped; the mapping goes when it does
            return False


def _pow2(n: int, what: str) -> int:
    if n <= 0 or n & (n - 1):
        raise ValueError(f"{what} must be a power of two, got {n}")
    return n


class XskTransport(Transport):
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
    ``sg``: multi-buffer (``XDP_USE_SG``; None: where the kernel has it,
    6.6+): a frame longer than a UMEM frame (jumbo MTUs) spans several
    descriptors, chained with ``XDP_PKT_CONTD``, on receive and transmit;
    ``self.sg`` says whether it is on.  Without it such frames cannot be
    sent (``ValueError``) and the kernel drops them on receive
    (``rx_dropped``).  The XDP program must then be multi-buffer too
    (:func:`pydblp.bpf.compile_xdp` loads pydblp's that way).
    """

    kind = "xsk"

    def __init__(self, ifname: str, netns: str | None = None, queue: int = 0, port: int = wire.DEFAULT_PORT,
                 *, host=None, xskmap=None, pressure=None, mode: str = "auto", frame_size: int = 2048,
                 rx_frames: int = 16384, tx_frames: int = 4096, rx_ring: int | None = None,
                 tx_ring: int | None = None, need_wakeup: bool = True, sg: bool | None = None,
                 bind_timeout: float = 3.0,
                 spin: float = 200e-6, rate: float = 0, rate_burst: int | None = None, tx: str = "xsk"):
        self.ifname, self.netns, self.queue, self.port = ifname, netns, queue, check_port(port)
        self.spin = spin
        if tx not in ("xsk", "kernel"):
            raise ValueError(f"tx={tx!r}: 'xsk' (the AF_XDP tx ring) or 'kernel' (a UDP socket on the device)")
        if tx == "kernel" and rate:
            raise ValueError("rate paces the AF_XDP tx ring; with tx='kernel' the device's qdisc paces (drop rate)")
        self.tx = tx
        self._ktx = self._ctrl = None
        if tx == "kernel":  # the tx ring stays idle: a token UMEM share, not 8 MiB populated for nothing
            tx_frames = min(tx_frames, 64)
        if rate < 0 or (rate_burst is not None and rate_burst < 4 * frame_size):
            raise ValueError(f"rate must be >= 0 bits/s and rate_burst at least 4 frames ({4 * frame_size} bytes)")
        self.rate = float(rate)
        self._Bps = self.rate / 8  # bytes per second; 0: unpaced
        self.rate_burst = rate_burst or max(4 * frame_size, int(self._Bps / 1000))
        self._tokens, self._t_tok = float(self.rate_burst), time.monotonic()
        self._tx_lock = threading.Lock()  # send vs. a recv that releases paced frames
        self._fd = -1
        self._sock = None
        self._rings: list[_Ring] = []
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
        self.rx_frames, self.tx_frames = _pow2(rx_frames, "rx_frames"), _pow2(tx_frames, "tx_frames")
        rx_ring = _pow2(rx_ring or rx_frames, "rx_ring")
        tx_ring = _pow2(tx_ring or tx_frames, "tx_ring")
        fill_ring, comp_ring = 2 * rx_frames, 2 * tx_frames
        self._sources = frames.Sources()
        self._tmpl = frames.Templates()
        self._c = dict.fromkeys(("rx_packets", "rx_bytes", "tx_packets", "tx_bytes", "rx_invalid",
                                 "rx_truncated", "tx_busy_drops", "tx_kicks", "rx_polls", "tx_held"), 0)
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
            nframes = rx_frames + tx_frames
            size = nframes * frame_size
            self._umem_mm = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
            self._umem = np.frombuffer(self._umem_mm, np.uint8)
            self._umem2d = self._umem.reshape(nframes, frame_size)
            so = self._sock.setsockopt
            so(SOL_XDP, XDP_UMEM_REG, struct.pack("=QQIIII", self._umem.ctypes.data, size, frame_size, 0, 0, 0))
            so(SOL_XDP, XDP_UMEM_FILL_RING, fill_ring)
            so(SOL_XDP, XDP_UMEM_COMPLETION_RING, comp_ring)
            so(SOL_XDP, XDP_RX_RING, rx_ring)
            so(SOL_XDP, XDP_TX_RING, tx_ring)
            o = struct.unpack("=16Q", self._sock.getsockopt(SOL_XDP, XDP_MMAP_OFFSETS, 128))
            # rx, tx, fill, completion: (producer, consumer, desc, flags) each
            self._rx = _Ring(self._fd, XDP_PGOFF_RX_RING, o[0:4], rx_ring, DESC_DTYPE)
            self._rings.append(self._rx)
            self._tx = _Ring(self._fd, XDP_PGOFF_TX_RING, o[4:8], tx_ring, DESC_DTYPE)
            self._rings.append(self._tx)
            self._fill = _Ring(self._fd, XDP_UMEM_PGOFF_FILL_RING, o[8:12], fill_ring, np.dtype("<u8"))
            self._rings.append(self._fill)
            self._comp = _Ring(self._fd, XDP_UMEM_PGOFF_COMPLETION_RING, o[12:16], comp_ring, np.dtype("<u8"))
            self._rings.append(self._comp)
            try:  # let one sendto() push a whole tx ring instead of 32 descriptors
                so(SOL_XDP, XDP_MAX_TX_SKB_BUDGET, tx_ring)
                self.tx_budget = tx_ring
            except OSError:
                self.tx_budget = 32
            # frames: receive ones go to the fill ring now, transmit ones to the free list
            self._fill_pending = np.zeros(0, np.uint64)
            self._lent = None  # frames whose payload the last recv(copy=False) lent out
            self._fill_push(np.arange(rx_frames, dtype=np.uint64) * np.uint64(frame_size))
            # transmit frames: a FIFO, so frames leave and complete in UMEM order and a
            # batch usually gets consecutive frames it can be built in place into
            self._tx_free = (np.arange(rx_frames, nframes, dtype=np.uint64) * np.uint64(frame_size))
            self._tx_head = 0
            self._tx_nfree = tx_frames
            self._tx_outstanding = 0
            self._wprod = int(self._tx.prod[0])  # descriptors written up to here; tx.prod: handed to the kernel
            self._tx_words = self._tx.desc.view(np.uint64).reshape(-1, 2)
            self._bytes_written = self._bytes_released = 0  # frame bytes in the tx ring, for tx_backlog()
            self._tx_cum = np.zeros(self._tx.n, np.int64)  # per ring slot: _bytes_written once its frame was written
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
            opts = struct.unpack("=I", self._sock.getsockopt(SOL_XDP, XDP_OPTIONS, 4))[0]
            self.zerocopy = bool(opts & XDP_OPTIONS_ZEROCOPY)
            self._insert()
            self._poll = select.poll()
            self._poll.register(self._fd, select.POLLIN)
            if tx == "kernel":  # its own ephemeral port: it must not take this port's traffic
                from pydblp.transport.udp import UdpTransport

                self._ktx = UdpTransport(ifname, netns=netns, port=0, gro=False, rcvbuf=4096)
        except BaseException:
            self.close()
            raise

    # ---- setup ---------------------------------------------------------

    def _bind(self, flags: int, timeout: float) -> None:
        sxdp = ctypes.create_string_buffer(struct.pack("=HHIII", AF_XDP, flags, self.ifindex, self.queue, 0), 16)
        deadline = time.monotonic() + timeout
        delay = 0.002
        self.bind_retries = 0
        while True:
            if libc.bind(self._fd, sxdp, 16) == 0:
                return
            e = ctypes.get_errno()
            # EBUSY: the previous socket on this queue is still being torn down (deferred work)
            if e == errno.EBUSY and time.monotonic() < deadline:
                self.bind_retries += 1
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
                continue
            hint = {errno.EBUSY: "another AF_XDP socket is bound to this queue",
                    errno.EINVAL: f"queue {self.queue} does not exist on {self.ifname}, or bad flags",
                    errno.EOPNOTSUPP: "the driver has no zero-copy support; use mode='copy'",
                    errno.ENOPROTOOPT: "kernel without AF_XDP"}.get(e, "")
            raise TransportError(e, f"bind AF_XDP to {self.ifname} queue {self.queue}: {os.strerror(e)}"
                                 + (f" ({hint})" if hint else ""))

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

    # ---- peers ---------------------------------------------------------

    def _local_addr(self, dst) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
        with net.ipr(self.netns) as ip:
            rows = ip.get_addr(index=self.ifindex, family=socket.AF_INET if dst.version == 4 else socket.AF_INET6)
        cands = [(ipaddress.ip_interface(f"{r.get_attr('IFA_ADDRESS')}/{r['prefixlen']}")) for r in rows]
        if not cands:
            raise TransportError(errno.EADDRNOTAVAIL, f"{self.ifname} has no IPv{dst.version} address")
        for c in cands:
            if dst in c.network and (dst.version == 4 or c.ip.is_link_local == dst.is_link_local):
                return c.ip
        for c in cands:
            if dst.version == 4 or not c.ip.is_link_local:
                return c.ip
        return cands[0].ip

    def _neighbour(self, dst) -> bytes | None:
        with net.ipr(self.netns) as ip:
            for r in ip.get_neighbours(ifindex=self.ifindex, dst=str(dst)):
                mac = r.get_attr("NDA_LLADDR")
                if mac and r["state"] not in (0x20, 0x01):  # NUD_FAILED, NUD_INCOMPLETE
                    return frames.mac_bytes(mac)
        return None

    def _resolve(self, dst, timeout: float = 2.0) -> bytes:
        mac = self._neighbour(dst)
        if mac:
            return mac
        fam = socket.AF_INET if dst.version == 4 else socket.AF_INET6
        with net.in_netns(self.netns), socket.socket(fam, socket.SOCK_DGRAM) as s:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:  # any datagram makes the kernel resolve the neighbour (discard port)
                    s.sendto(b"", (str(dst), 9))
                except OSError:
                    pass
                time.sleep(0.05)
                mac = self._neighbour(dst)
                if mac:
                    return mac
        raise TransportError(errno.EHOSTUNREACH, f"cannot resolve the MAC of {dst} on {self.ifname}; pass mac=")

    def add_peer(self, addr, port: int = wire.DEFAULT_PORT, mac=None, src=None) -> int:
        """Register ``addr`` (IPv4 or IPv6); the MAC comes from the neighbour table
        (resolved on demand) unless given; ``src`` overrides the local address."""
        dst = parse_ip(addr)
        port = check_port(port, "peer port")
        src = parse_ip(src) if src is not None else self._local_addr(dst)
        dmac = frames.mac_bytes(mac) if mac is not None else self._resolve(dst)
        t, partial = frames.template(self.mac, dmac, src, dst, self.port, port)
        pid = self._tmpl.add(t, partial)
        self._sources.add(dst)
        if self._ktx is not None:
            self._ktx.add_peer(dst, port)
        return pid

    # ---- receive -------------------------------------------------------

    def _fill_push(self, addrs: np.ndarray) -> None:
        if len(self._fill_pending):
            addrs = np.concatenate([self._fill_pending, addrs])
        f = self._fill
        prod = int(f.prod[0])
        space = f.n - ((prod - int(f.cons[0])) & 0xFFFFFFFF)
        m = min(space, len(addrs))
        if m:
            i0 = prod & f.mask
            if i0 + m <= f.n:
                f.desc[i0: i0 + m] = addrs[:m]
            else:
                f.desc[(prod + np.arange(m)) & f.mask] = addrs[:m]
            f.prod[0] = (prod + m) & 0xFFFFFFFF
        self._fill_pending = addrs[m:]

    def _set_pressure(self, level: int) -> None:
        if self._pressure_fn is None:
            return
        if abs(level - self._pressure) >= PRESSURE_STEP or (level == 0 and self._pressure != 0):
            self._pressure_fn(level)
            self._pressure = level

    def recv(self, into: Batch | None = None, timeout: float | None = 0.0, max: int | None = None,
             *, want: int = 1, linger: float = 0.0, copy: bool = True) -> Batch:
        self._check_open()
        if into is None:
            into = Batch.empty(1024)
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
                end = None if timeout is None else time.monotonic() + timeout
                while True:  # paced frames waiting: wake up to release them, as a qdisc would
                    wait = timeout if pace is None else pace if end is None else \
                        builtins.max(0.0, builtins.min(pace, end - time.monotonic()))
                    self._poll.poll(None if wait is None else int(wait * 1000))
                    avail = (int(rx.prod[0]) - cons) & 0xFFFFFFFF
                    if avail or pace is None or (end is not None and time.monotonic() >= end):
                        break
                    pace = self._pump()
        seen = self._ctrl_count()
        if 0 < avail < want and linger > 0 and seen == self._ctrl_last:
            # coalesce: let more arrive, still releasing paced frames, until a control packet comes
            end = time.monotonic() + linger
            while avail < want:
                left = end - time.monotonic()
                if left <= 0:
                    break
                pace = self._pump()
                time.sleep(builtins.min(left, 0.0005 if pace is None else builtins.min(pace, 0.0005)))
                avail = (int(rx.prod[0]) - cons) & 0xFFFFFFFF
                seen = self._ctrl_count()
                if seen != self._ctrl_last:
                    break
        self._ctrl_last = seen
        self._set_pressure(avail * PRESSURE_MAX // rx.n)
        n = min(avail, cap)
        if n == 0:
            into.n = 0
            return into.view(0, 0)
        i0 = cons & rx.mask
        d = rx.desc[i0: i0 + n] if i0 + n <= rx.n else rx.desc[(cons + np.arange(n)) & rx.mask]
        if self.sg and d["options"].any():  # frames spanning descriptors (multi-buffer)
            return self._recv_sg(into, cons, avail, cap)
        fs = self.frame_size
        addr = d["addr"].astype(np.int64)
        flen = d["len"].astype(np.int64)
        rx.cons[0] = (cons + n) & 0xFFFFFFFF  # descriptors copied; frames stay ours until refilled
        run = self._recv_run(into, addr, flen, n, copy) if (addr[1:] - addr[:-1] == fs).all() else None
        if run is not None:
            return run
        frame = addr // fs
        foff = addr - frame * fs
        pw = frames.PARSE_WIDTH
        # the kernel takes fill-ring frames in order and we refill in order, so
        # frames arrive in consecutive runs: copy runs as slices (one copy, no
        # fancy-index temporary), a loop over runs (1-2 a call), not packets
        uniform = bool(np.all(foff == foff[0])) and foff[0] + pw <= fs
        runs = np.flatnonzero(np.diff(frame) != 1) + 1
        if uniform:
            f0 = int(foff[0])
            if len(runs) <= 8:
                block = np.empty((n, pw), np.uint8)
                for lo, hi in zip((0, *runs), (*runs, n)):
                    block[lo:hi] = self._umem2d[frame[lo]: frame[lo] + hi - lo, f0: f0 + pw]
            else:
                block = self._umem2d[frame, f0: f0 + pw]
        else:
            idx = np.minimum(addr[:, None] + np.arange(pw), (frame[:, None] + 1) * fs - 1)
            block = self._umem[idx]
        ok, off, plen, fam = frames.parse(block, flen, self.port)
        hdrs = wire.decode_batch(block, off)
        if not self._validated:
            ok &= wire.validate_batch(hdrs, plen) == 0
        allok = bool(ok.all())
        sel = np.arange(n) if allok else np.flatnonzero(ok)
        k = len(sel)
        self._c["rx_invalid"] += n - k
        if k:
            lens = self._headers_in(into, hdrs if allok else wire.take(hdrs, sel), plen[sel])
            w = int(lens.max())
            start = foff[sel] + off[sel] + wire.HEADER_LEN
            if w:
                s0 = int(start[0])
                fsel = frame[sel]
                if np.all(start == s0) and s0 + w <= fs:
                    sruns = runs if allok else np.flatnonzero(np.diff(fsel) != 1) + 1
                    if len(sruns) <= 8:
                        for lo, hi in zip((0, *sruns), (*sruns, k)):
                            into.payload[lo:hi, :w] = self._umem2d[fsel[lo]: fsel[lo] + hi - lo, s0: s0 + w]
                    else:
                        into.payload[:k, :w] = self._umem2d[fsel, s0: s0 + w]
                else:
                    for s in np.unique(start):  # a loop over distinct offsets (IPv4 vs IPv6), not packets
                        rows = np.flatnonzero(start == s)
                        ww = min(w, fs - int(s))
                        into.payload[rows, :ww] = self._umem2d[fsel[rows], int(s): int(s) + ww]
            into.peer[:k] = self._sources.match(block if allok else block[sel], fam[sel])
            self._c["rx_packets"] += k
            self._c["rx_bytes"] += int(lens.sum()) + k * wire.HEADER_LEN
        self._fill_push((frame * fs).astype(np.uint64))
        into.n = k
        return into.view(0, k)

    def _headers_in(self, into: Batch, hdrs: np.ndarray, plen: np.ndarray) -> np.ndarray:
        """Put valid packets' headers and payload lengths (cut to ``into``'s width, counted) in ``into``."""
        k = len(hdrs)
        wire.put(into.headers[:k], hdrs)
        lens = plen - wire.HEADER_LEN
        trunc = lens > into.maxlen
        if trunc.any():
            self._c["rx_truncated"] += int(trunc.sum())
            lens = np.minimum(lens, into.maxlen)
        into.lengths[:k] = lens
        return lens

    def _recv_sg(self, into: Batch, cons: int, avail: int, cap: int) -> Batch:
        """``recv`` for a batch with frames spanning descriptors (``XDP_PKT_CONTD``).

        Takes up to ``cap`` whole frames.  Headers come from each frame's
        first descriptor (it holds at least the first ~3.8 KB); the payload
        is gathered segment by segment: one numpy copy per segment index
        (a handful), not per packet.  The payload is always copied.
        """
        rx, fs = self._rx, self.frame_size
        dd = rx.desc[(cons + np.arange(avail)) & rx.mask]
        ends = np.flatnonzero((dd["options"] & XDP_PKT_CONTD) == 0)  # last descriptor of each frame
        npk = min(len(ends), cap)
        if npk == 0:  # the kernel publishes whole frames; nothing complete yet
            into.n = 0
            return into.view(0, 0)
        ndesc = int(ends[npk - 1]) + 1
        rx.cons[0] = (cons + ndesc) & 0xFFFFFFFF
        addr = dd["addr"][:ndesc].astype(np.int64)
        dlen = dd["len"][:ndesc].astype(np.int64)
        first = np.concatenate(([0], ends[: npk - 1] + 1))
        nseg = ends[:npk] - first + 1
        flen = np.add.reduceat(dlen, first)
        frame = addr // fs
        fast = self._recv_sg_uniform(into, addr, dlen, frame, nseg, flen)
        if fast is not None:
            return fast
        a0 = addr[first]
        pw = frames.PARSE_WIDTH
        block = self._umem[np.minimum(a0[:, None] + np.arange(pw), (frame[first][:, None] + 1) * fs - 1)]
        ok, off, plen, fam = frames.parse(block, flen, self.port)
        hdrs = wire.decode_batch(block, off)
        if not self._validated:
            ok &= wire.validate_batch(hdrs, plen) == 0
        ok &= dlen[first] >= off + wire.HEADER_LEN  # the DBLP header lies in the first descriptor
        sel = np.flatnonzero(ok)
        k = len(sel)
        self._c["rx_invalid"] += npk - k
        if k:
            lens = self._headers_in(into, wire.take(hdrs, sel), plen[sel])
            maxlen = into.maxlen
            col = np.zeros(k, np.int64)  # payload bytes of each packet placed so far
            skip = off[sel] + wire.HEADER_LEN  # headers before the payload, first segment only
            for j in range(int(nseg[sel].max())):
                rows = np.flatnonzero((nseg[sel] > j) & (col < lens))
                if not len(rows):
                    break
                di = first[sel[rows]] + j
                src = addr[di] + (skip[rows] if j == 0 else 0)
                seg = np.minimum(dlen[di] - (skip[rows] if j == 0 else 0), lens[rows] - col[rows])
                fr, so = src // fs, src % fs
                # one copy per distinct (offset in frame, offset in payload): one or two per segment
                key = so * (maxlen + 1) + col[rows]
                for kv in np.unique(key):
                    g = np.flatnonzero(key == kv)
                    o, c = int(so[g[0]]), int(col[rows[g[0]]])
                    w = int(seg[g].max())
                    into.payload[rows[g], c: c + w] = self._umem2d[fr[g], o: o + w]
                col[rows] += seg
            into.peer[:k] = self._sources.match(block[sel], fam[sel])
            self._c["rx_packets"] += k
            self._c["rx_bytes"] += int(lens.sum()) + k * wire.HEADER_LEN
        self._fill_push((frame * fs).astype(np.uint64))
        into.n = k
        return into.view(0, k)

    def _recv_sg_uniform(self, into: Batch, addr, dlen, frame, nseg, flen) -> Batch | None:
        """``_recv_sg`` for the usual batch: every frame in the same number of descriptors, in
        consecutive UMEM frames at one offset, one layout, all valid.  Each segment index is one
        strided copy; None (nothing consumed from ``into``'s view) lets the general path run."""
        fs = self.frame_size
        k, npk, ndesc = int(nseg[0]), len(nseg), len(addr)
        f0, o = int(frame[0]), int(addr[0]) - int(frame[0]) * fs
        full = fs - o  # every descriptor but a frame's last is filled to its frame's end
        pw = frames.PARSE_WIDTH
        if not ((nseg == k).all() and int(frame[-1]) - f0 == ndesc - 1 and (np.diff(frame) == 1).all()
                and (addr - frame * fs == o).all() and o + pw <= fs and npk <= into.cap
                and into.headers.flags.c_contiguous):
            return None
        seg = self._umem2d[f0: f0 + ndesc].reshape(npk, k, fs)  # [packet, segment, byte]: a view
        dl = dlen.reshape(npk, k)
        if not (dl[:, :-1] == full).all():
            return None
        block = seg[:, 0, o: o + pw]
        parsed = frames.parse_uniform(block, flen, self.port)
        if parsed is None:
            return None
        ok, hoff, plen, fam = parsed
        hdrs = into.headers[:npk]
        hdrs.view(np.uint8).reshape(npk, wire.HEADER_LEN)[:] = block[:, hoff: hoff + wire.HEADER_LEN]
        if not self._validated:
            ok &= wire.validate_batch(hdrs, plen) == 0
        lens = plen - wire.HEADER_LEN
        skip = hoff + wire.HEADER_LEN
        c = full - skip  # payload bytes in a first segment
        if not ok.all() or c < 0 or k < 2 or int(lens.max()) > into.maxlen or c > into.maxlen:
            return None
        pay = into.payload
        pay[:npk, :c] = seg[:, 0, o + skip: fs]
        for j in range(1, k):
            w = full if j < k - 1 else builtins.min(int(dl[:, j].max()), into.maxlen - c)
            if w > 0:
                pay[:npk, c: c + w] = seg[:, j, o: o + w]
            c += w
        into.lengths[:npk] = lens
        into.peer[:npk] = self._sources.match(block, fam)
        self._c["rx_packets"] += npk
        self._c["rx_bytes"] += int(lens.sum()) + npk * wire.HEADER_LEN
        self._fill_push((frame * fs).astype(np.uint64))
        into.n = npk
        return into.view(0, npk)

    def _recv_run(self, into: Batch, addr: np.ndarray, flen: np.ndarray, n: int, copy: bool) -> Batch | None:
        """``recv`` for the usual case, in few numpy calls: consecutive frames, one layout, all valid.

        Returns the received batch (with ``copy=False`` its payload rows are
        the UMEM frames themselves, refilled at the next ``recv``), or None
        (frames not refilled; ``into`` may hold scratch the general path
        overwrites) to let that path handle the batch.
        """
        fs = self.frame_size
        a0 = int(addr[0])
        f0, o0 = a0 // fs, a0 % fs
        pw = frames.PARSE_WIDTH
        if o0 + pw > fs or n > into.cap or not into.headers.flags.c_contiguous:
            return None
        block = self._umem2d[f0: f0 + n, o0: o0 + pw]
        parsed = frames.parse_uniform(block, flen, self.port)
        if parsed is None:
            return None
        ok, hoff, plen, fam = parsed
        hdrs = into.headers[:n]  # header bytes straight into the caller's records
        hdrs.view(np.uint8).reshape(n, wire.HEADER_LEN)[:] = block[:, hoff: hoff + wire.HEADER_LEN]
        if not self._validated:
            ok &= wire.validate_batch(hdrs, plen) == 0
        if not ok.all():
            return None
        lens = plen - wire.HEADER_LEN
        w = int(lens.max())
        s0 = o0 + hoff + wire.HEADER_LEN
        if w > into.maxlen or s0 + w > fs:
            return None
        into.lengths[:n] = lens
        into.peer[:n] = self._sources.match(block, fam)
        self._c["rx_packets"] += n
        self._c["rx_bytes"] += int(lens.sum()) + n * wire.HEADER_LEN
        into.n = n
        lent = (addr - o0).astype(np.uint64)
        if not copy:  # lend the frames: no payload copy; they go back to the fill ring next call
            self._lent = lent
            return Batch(into.headers[:n], self._umem2d[f0: f0 + n, s0: s0 + w], into.lengths[:n],
                         into.peer[:n], n)
        into.payload[:n, :w] = self._umem2d[f0: f0 + n, s0: s0 + w]
        self._fill_push(lent)
        return into.view(0, n)

    # ---- transmit ------------------------------------------------------

    def _reclaim(self) -> int:
        c = self._comp
        cons = int(c.cons[0])
        n = (int(c.prod[0]) - cons) & 0xFFFFFFFF
        if n:
            i0 = cons & c.mask
            addrs = c.desc[i0: i0 + n] if i0 + n <= c.n else c.desc[(cons + np.arange(n)) & c.mask]
            T = self.tx_frames
            tail = (self._tx_head + self._tx_nfree) % T
            if tail + n <= T:  # completions return the frame addresses we queued
                self._tx_free[tail: tail + n] = addrs
            else:
                self._tx_free[(tail + np.arange(n)) % T] = addrs
            c.cons[0] = (cons + n) & 0xFFFFFFFF
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
        if not self._Bps:
            tx.prod[0] = self._wprod
            return waiting
        now = time.monotonic()
        self._tokens = min(self.rate_burst, self._tokens + (now - self._t_tok) * self._Bps)
        self._t_tok = now
        # frames whose cumulative byte count fits the tokens: a binary search, no per-call sums
        limit = self._bytes_released + int(self._tokens)
        i0 = prod & tx.mask
        head = min(waiting, tx.n - i0)
        cum = self._tx_cum
        k = int(np.searchsorted(cum[i0: i0 + head], limit, side="right"))
        if k == head < waiting:  # the waiting frames wrap around the ring's end
            k += int(np.searchsorted(cum[: waiting - head], limit, side="right"))
        if k:
            done = int(cum[(prod + k - 1) & tx.mask])
            self._tokens -= done - self._bytes_released
            self._bytes_released = done
            tx.prod[0] = (prod + k) & 0xFFFFFFFF
        if self._wprod != int(tx.prod[0]):
            self._c["tx_held"] += 1  # release calls that left frames waiting for tokens
        return k

    def tx_queued(self) -> int:
        """With ``tx="kernel"``, its UDP socket's send queue; AF_XDP transmit: 0 (paced here, and
        the copy-mode driver path holds no queue of its own)."""
        return self._ktx.tx_queued() if self._ktx is not None else 0

    def tx_backlog(self) -> float:
        if not self._Bps or self._wprod == int(self._tx.prod[0]):
            return 0.0
        return (self._bytes_written - self._bytes_released - self._tokens) / self._Bps

    def _pace_wait(self) -> float:
        """Seconds until the token bucket lets the next waiting frame go (0: none waits)."""
        tx = self._tx
        prod = int(tx.prod[0])
        if self._wprod == prod or not self._Bps:
            return 0.0
        need = int(tx.desc["len"][prod & tx.mask]) - self._tokens
        return max(0.0, need / self._Bps)

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
                                           part.lengths, out=span)
            else:
                lens = np.empty(m, np.int64)
                for rows, st, flen in frames.build(self._tmpl, part.peer, part.headers, part.payload,
                                                   part.lengths):  # rows: an index array (lengths differ)
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
                                           part.lengths, out=self._umem2d[f0: f0 + m])
            else:
                lens = np.empty(m, np.int64)
                for rows, st, flen in frames.build(self._tmpl, part.peer, part.headers, part.payload,
                                                   part.lengths):
                    self._umem2d[fr[rows], : st.shape[1]] = st
                    lens[rows] = flen
            dd = self._tx_words[i0: i0 + m]  # descriptors as (addr, len | options << 32) words
            dd[:, 0] = addrs
            dd[:, 1] = lens
            self._queued(slice(i0, i0 + m), lens, 1, part)
            sent += m
        self._push_out(deadline)
        return sent

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
        if self._Bps:  # per descriptor, its frame's cumulative end: a frame's descriptors go together
            c = np.cumsum(lens)
            c += self._bytes_written
            self._tx_cum[slots] = np.repeat(c, k) if np.ndim(k) or k > 1 else c
            self._bytes_written = int(c[-1])
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
        raw = self._sock.getsockopt(SOL_XDP, XDP_STATISTICS, 48)
        vals = struct.unpack("=6Q", raw.ljust(48, b"\0"))
        return dict(zip(STAT_FIELDS, vals))

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
