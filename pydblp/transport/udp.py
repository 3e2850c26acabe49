"""UDP transport: the :class:`Transport` interface over an ordinary UDP socket.

Needs no root (root only for ``netns``), so it runs anywhere and is the
comparator for the AF_XDP transport.  Batches cross the kernel boundary with
``recvmmsg(2)``/``sendmmsg(2)`` through ctypes: each message has two iovecs,
one on its row of ``batch.headers`` and one on its row of ``batch.payload``,
so the kernel scatters headers and payloads straight into the caller's numpy
arrays (no staging copy, no per-packet Python).  The ``mmsghdr``/``iovec``
arrays are numpy structured arrays whose pointers are filled vectorised.
(A socket with ``UDP_GRO`` receives differently: see below.)

Why one module of ~810 lines: the mmsghdr/iovec arrays, GRO receive, GSO
transmit and the broadcast peer's loopback filter all operate on the same
socket and the same preallocated arrays; split apart they would share most of
their state through attributes of one object anyway.

Transmit uses UDP generic segmentation offload where the kernel has it
(``UDP_SEGMENT``, 4.18+): consecutive packets to one peer with one size go
as one ``sendmmsg`` message of up to 64 datagrams (at most ~64 KB), which
the kernel's UDP and IP layers, routing and qdisc handle once and segments
into separate datagrams at the device: the same datagrams on the wire, a
fraction of the per-datagram send cost.  A kernel that refuses it turns it
off for the socket (counted in ``stats()["tx_gso_off"]``) and the packets go
one datagram per message.

Receive can take datagrams merged by GRO (``UDP_GRO``, 5.0+; on by default
when the socket is bound to a device with GRO on): a run of equal-sized
datagrams of one flow reaches the socket as one message, so the IP and UDP
receive path, the socket queue and the read handle each run once.  Messages
are read one at a time (``recvmsg_into``: one contiguous buffer, no iovec
scatter) into a frames buffer of the transport's own, whole datagrams in rows
of header + the batch's payload width, each message right after the last
one's datagrams (64 KiB past the last row: datagrams wider than a row still
arrive whole, then are cut to the row and counted in ``rx_truncated``):
datagrams of a row's size (the collective's data packets are) land row by
row, other sizes are re-cut in place, and no row ever moves.  The headers are
then copied into the caller's batch in one call, and the payload rows copied
too or, with ``copy=False``, lent (valid until the next ``recv``).  A batch
narrower than 64 rows reads through an internal spill batch and gets the rest
on the next calls.
Counters of their own: ``tx_gso_packets`` (sent inside multi-datagram
messages), ``tx_gso_off``, ``rx_gro_packets`` (received merged),
``tx_blocked`` (waits for send-buffer room).  ``tx_queued()`` reads the
socket's send queue (``TIOCOUTQ``: what has not left the host yet, the
device's qdisc included), so a caller can keep it short.

One dual-stack IPv6 socket (``IPV6_V6ONLY`` off) carries IPv4 and IPv6 peers
(IPv4 as ``::ffff:a.b.c.d``); where IPv6 is disabled it falls back to an
IPv4 socket.  Receive-buffer overflows are counted by the kernel and read
back through ``SO_MEMINFO`` (``stats()["rx_dropped"]``).  The default receive
buffer, 32 MiB (the kernel doubles it for its accounting), holds about what
the AF_XDP transport's 16384-frame ring does: a received datagram costs the
socket a whole 4 KiB page on veth, and a rank of a 32 MiB allreduce may have
three senders' 8 MiB each coming in at once (with 8 MiB, 32 MiB blocks in the
testbed counted 5-398 overflows each in four full runs; with 32 MiB none in
a clean and a lossy block).
"""

from __future__ import annotations

import array
import ctypes
import errno
import fcntl
import ipaddress
import os
import select
import socket
import sys
import termios
import time

import numpy as np

from pydblp import dscp as dscp_mod
from pydblp import native as native_mod
from pydblp import net, wire
from pydblp._libc import libc
from pydblp.transport.base import Batch, Transport, TransportError, check_port, parse_ip

SO_MEMINFO = 55
SK_MEMINFO_DROPS = 8
SO_RCVBUFFORCE = 33
SO_SNDBUFFORCE = 32
MSG_TRUNC = 0x20
MSG_DONTWAIT = 0x40
SOCKADDR_LEN = 28  # sockaddr_in6; sockaddr_in (16) fits

MMSG_DTYPE = np.dtype([("name", "<u8"), ("namelen", "<u4"), ("_p0", "<u4"), ("iov", "<u8"), ("iovlen", "<u8"),
                       ("control", "<u8"), ("controllen", "<u8"), ("flags", "<i4"), ("_p1", "<u4"),
                       ("len", "<u4"), ("_p2", "<u4")])
IOV_DTYPE = np.dtype([("base", "<u8"), ("len", "<u8")])
# a message's control data: a struct cmsghdr carrying UDP_SEGMENT's u16 segment size (CMSG_LEN(2) = 18,
# CMSG_SPACE(2) = 24), then one carrying the int TOS / traffic class (CMSG_LEN(4) = 20, CMSG_SPACE(4) = 24)
CMSG_DTYPE = np.dtype([("len", "<u8"), ("level", "<i4"), ("type", "<i4"), ("gso", "<u2"), ("_pad", "V6"),
                       ("tlen", "<u8"), ("tlevel", "<i4"), ("ttype", "<i4"), ("tos", "<i4"), ("_pad2", "V4")])
CMSG_SEG = 24  # bytes of the UDP_SEGMENT cmsg: a message without one points its control data past it
# a received message's control data (IP_RECVTOS, IPV6_RECVTCLASS): one cmsghdr carrying the TOS byte
# (IP_TOS, CMSG_LEN(1) = 17) or the traffic class as an int (IPV6_TCLASS, CMSG_LEN(4) = 20; its low
# byte first, as every field here is little-endian): either way the byte at 16; CMSG_SPACE 24, a row of 32
RX_CMSG_DTYPE = np.dtype([("len", "<u8"), ("level", "<i4"), ("type", "<i4"), ("tos", "u1"), ("_pad", "V15")])
ECN_MASK = np.uint8(3)  # the ECN field: the TOS / traffic class byte's low 2 bits (a numpy scalar: no conversion)
assert MMSG_DTYPE.itemsize == 64 and IOV_DTYPE.itemsize == 16 and CMSG_DTYPE.itemsize == 48
assert RX_CMSG_DTYPE.itemsize == 32
SOL_UDP = 17
UDP_SEGMENT = 103
GSO_MAX_SEGS = 64        # datagrams per message (UDP_MAX_SEGMENTS; 6.x kernels allow 128)
GSO_MAX_BYTES = 65000    # bytes per message: under the 64 KB IP datagram limit with headers
UDP_GRO = 104
GRO_SEGS = 64            # datagrams the kernel merges into one message at most (UDP_GRO_CNT_MAX)
SPILL_ROWS = 8 * GRO_SEGS  # a batch narrower than GRO_SEGS reads through a spill batch this tall
GRO_OVERFLOW = 65536     # bytes after a message's rows: datagrams wider than a row still arrive whole
FEW_SEND = 4             # packets per send up to which each goes by its own sendmsg
SMALL = 16               # messages per read up to which per-message work runs in Python, not numpy
KIND_AT = wire.HEADER_DTYPE.fields["kind"][1]  # the kind byte's offset in a header
DATA_KIND = int(wire.Kind.DATA)  # any other kind (a control packet) ends a linger: it wants an answer
LINGER_STEP = 0.0005     # s: a lingering receive reads what came this often and returns once it has `want`

SO_ATTACH_FILTER = 26
# classic BPF socket filter: drop what this host looped back to itself (a broadcast it sent:
# PACKET_LOOPBACK), take the rest whole.  ldb [SKF_AD_OFF + SKF_AD_PKTTYPE]; jeq #5, drop; ret -1; ret 0
_NO_LOOPBACK = (ctypes.c_uint64 * 4)(*(int.from_bytes(ins, "little") for ins in (
    (0x30).to_bytes(2, "little") + bytes([0, 0]) + (0xFFFFF004).to_bytes(4, "little"),
    (0x15).to_bytes(2, "little") + bytes([1, 0]) + (5).to_bytes(4, "little"),
    (0x06).to_bytes(2, "little") + bytes([0, 0]) + (0xFFFFFFFF).to_bytes(4, "little"),
    (0x06).to_bytes(2, "little") + bytes([0, 0]) + (0).to_bytes(4, "little"))))

libc.recvmmsg.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p)
libc.sendmmsg.argtypes = (ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int)


def _declare(lib: ctypes.CDLL) -> None:
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    # fd, frames, size, row, used, cap, names, npeer, stride, keyoff, keylen, plen, peer, ecn, res
    lib.dblp_udp_gro_read.argtypes = [i, p, i64, i64, i64, i64, p, i64, i64, i64, i64, p, p, p, p]
    lib.dblp_udp_gro_read.restype = i64
    lib.dblp_udp_send.argtypes = [i, p, p, i64, p, p, p, i64, p, p, i64, i64, p, p, i, i, p, p, p, i64, p]
    lib.dblp_udp_send.restype = i64


def native_lib() -> ctypes.CDLL | None:
    """csrc/udp.c's loops (:mod:`pydblp.native`), or None: the pure-Python path."""
    return native_mod.load("udp", _declare, what="about 1.2x the CPU per round (bench/cpu.py)")


def _sockaddr(family: int, ip, port: int) -> bytes:
    if family == socket.AF_INET6:
        if ip.version == 4:
            ip = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + ip.packed)
        return (socket.AF_INET6.to_bytes(2, "little") + port.to_bytes(2, "big") + bytes(4) + ip.packed
                + bytes(4))
    if ip.version != 4:
        raise TransportError(errno.EAFNOSUPPORT, f"{ip}: this UDP socket is IPv4 only (IPv6 disabled here)")
    return (socket.AF_INET.to_bytes(2, "little") + port.to_bytes(2, "big") + ip.packed).ljust(SOCKADDR_LEN, b"\0")


def _offload(sock: socket.socket, opt: int, value: int, required: bool | None, what: str) -> bool:
    """Turn on a UDP offload option; False where the kernel refuses it, unless ``required``."""
    try:
        sock.setsockopt(SOL_UDP, opt, value)
        return True
    except OSError as e:
        if required:
            raise TransportError(e.errno, f"{what}: {os.strerror(e.errno)}") from None
        return False


def _rows_ok(batch: Batch) -> bool:
    h, p = batch.headers, batch.payload
    return (h.dtype == wire.HEADER_DTYPE and h.strides[0] == wire.HEADER_LEN and p.dtype == np.uint8
            and p.ndim == 2 and p.strides[1] == 1 and p.flags.writeable and h.flags.writeable)


class UdpTransport(Transport):
    """A UDP socket on ``port`` (inside ``netns`` when given).

    ``ifname`` binds the socket to that device (SO_BINDTODEVICE) when
    allowed; ``bind`` picks a local IP address, IPv4 or IPv6 (default: all).  ``queue`` is
    accepted for interface symmetry and ignored.  ``recv`` with a timeout
    retries up to ``spin`` seconds before sleeping in poll(2).  ``gso``:
    segment in the kernel (see the module docstring); None uses it where the
    kernel takes ``UDP_SEGMENT``, True raises :class:`TransportError` where
    it does not, False never uses it.  ``gro``: let the kernel hand over runs
    of datagrams merged (``UDP_GRO``); None turns it on when ``ifname`` has
    GRO on (nothing merges otherwise), True raises where the kernel lacks it.
    A received datagram's peer id comes from its source address alone, not
    its port: the first peer registered at an address names everything
    from it.

    ``native``: the per-packet loops (GRO reads, ``sendmmsg`` messages) in compiled code
    (``csrc/udp.c``, :mod:`pydblp.native`): True requires it, False never uses it, None
    uses it where it loaded; ``self.native`` says which.  Both paths give the same batches,
    datagrams and counters.

    ``dscp`` (as ``Config.dscp``, :mod:`pydblp.dscp`): each datagram's DSCP
    from its DBLP priority, set per ``sendmmsg`` message in an ``IP_TOS`` (IPv4
    peer) or ``IPV6_TCLASS`` (IPv6 peer) cmsg; a GSO message then holds
    packets of one DSCP only.  (Measured on loopback, 1024 packets of 1408
    bytes a send: one cmsg per message costs nothing measurable with
    priorities in runs (position, layer: 2.9 vs 3.0 Mpps), but priorities that
    alternate packet by packet (magnitude) cut GSO runs short: 1.3 vs 3.7
    Mpps.  A socket per DSCP would break the same runs; reordering a send by
    DSCP would break the in-order sending the loss detection relies on.)

    ECN (RFC 3168): ``ect=True`` (or :meth:`set_ect`, as the collective's
    congestion control calls it) sends every datagram ECN-capable, ECT(0) in
    the low two bits of the same TOS / traffic-class byte (``dscp << 2 | 2``;
    control packets and broadcasts too), so a marking switch sets CE instead
    of dropping.  Every receive reports each datagram's ECN field as it
    arrived in ``Batch.ecn`` (0 Not-ECT, 2 ECT(0), 3 CE; the socket asks for
    ``IP_RECVTOS`` and ``IPV6_RECVTCLASS``: one cmsg a message, parsed per
    batch in numpy, or in C on the compiled GRO path); a merged GRO message
    has one IP header's for all its datagrams (the kernel's GRO merges none
    of another TOS).  A hand-made ``into`` without ``ecn`` (None) gets none.

    A peer may be an IPv4 broadcast address (the socket then gets SO_BROADCAST):
    one send reaches every host on the segment.  The kernel loops a copy of
    each such message back to this host; a socket filter (attached with the
    first such peer) drops it before any copy to user space,
    ``stats()["tx_looped"]`` counts those messages and ``rx_dropped`` leaves
    them out.
    """

    kind = "udp"

    def __init__(self, ifname: str | None = None, netns: str | None = None, queue: int = 0,
                 port: int = wire.DEFAULT_PORT, *, bind: str | None = None, rcvbuf: int = 32 << 20,
                 sndbuf: int = 2 << 20, max_batch: int = 4096, spin: float = 200e-6, gso: bool | None = None,
                 gro: bool | None = None, dscp="off", ect: bool = False, native: bool | None = None):
        self.ifname, self.netns, self.queue, self.port = ifname, netns, queue, check_port(port, zero_ok=True)
        self._lib = native_mod.choose(native, None if native is False else native_lib(), "udp")
        self.native = self.reads_addresses = self._lib is not None
        self._send_res = np.zeros(8, np.int64)  # the compiled send's results
        self._gro_res = np.zeros(8, np.int64)   # the compiled GRO read's
        self._gro_res_at = self._gro_res.ctypes.data
        self._gro_fixed = None  # (frames, names, the read's arguments made of them): _recv_gro_native
        self._ecn_at = None  # (into.ecn, rows, a copy source or None, the address the read writes to): _ecn_to
        self._send_fixed = None  # (names, v6peer, bcast, the arguments made of them): _send_addrs
        self.spin = spin
        self._sock = None
        self._fd = -1
        self._c = dict.fromkeys(("rx_packets", "rx_bytes", "tx_packets", "tx_bytes", "rx_invalid",
                                 "rx_truncated", "rx_errors", "tx_errors", "tx_blocked", "tx_gso_packets", "tx_gso_off",
                                 "rx_gro_packets", "tx_looped"), 0)
        self._peers: list = []
        self._peer_key: dict[bytes, int] = {}
        self._bcast = np.zeros(0, bool)  # per peer: a broadcast address (the kernel loops our copy back)
        self._nbcast = 0
        self._addrs: list[tuple] = []  # socket addresses of the peers, for sendmsg
        self._names = np.zeros((0, SOCKADDR_LEN), np.uint8)
        cap = max_batch
        self._rx_mmsg = np.zeros(cap, MMSG_DTYPE)
        self._rx_iov = np.zeros((cap, 2), IOV_DTYPE)
        self._rx_name = np.zeros((cap, SOCKADDR_LEN), np.uint8)
        self._rx_mmsg["name"] = self._rx_name.ctypes.data + np.arange(cap, dtype=np.uint64) * SOCKADDR_LEN
        self._rx_mmsg["iov"] = self._rx_iov.ctypes.data + np.arange(cap, dtype=np.uint64) * 2 * IOV_DTYPE.itemsize
        self._rx_mmsg["iovlen"] = 2
        self._rx_cmsg = np.zeros(cap, RX_CMSG_DTYPE)  # each message's TOS cmsg (its ECN field)
        self._rx_mmsg["control"] = self._rx_cmsg.ctypes.data + np.arange(cap, dtype=np.uint64) * RX_CMSG_DTYPE.itemsize
        self._rx_mmsg["namelen"] = SOCKADDR_LEN  # (the kernel overwrites these two in each message it returns:
        self._rx_mmsg["controllen"] = RX_CMSG_DTYPE.itemsize  # _read sets them again in those, _rx_dirty)
        self._rx_dirty = 0
        self._rx_clen, self._rx_tos = self._rx_mmsg["controllen"], self._rx_cmsg["tos"]  # (views, made once)
        self._rx_bound = None  # (headers, payload, rows): the arrays the iovecs point into
        self._frames = self._frames_mv = self._frames_h = None  # GRO receive: whole datagrams, one per row
        self._host_peer: dict[str, int] = {}  # a source address as recvmsg gives it -> peer id (-1: none)
        self._spill, self._spill_n, self._spill_at = None, 0, 0  # merged datagrams a narrow batch left
        self._outq = array.array("i", [0])  # tx_queued's ioctl result
        self.gro = False
        self._tx_mmsg = np.zeros(cap, MMSG_DTYPE)
        self._tx_iov = np.zeros((cap, 2), IOV_DTYPE)
        self._tx_mmsg["iov"] = self._tx_iov.ctypes.data + np.arange(cap, dtype=np.uint64) * 2 * IOV_DTYPE.itemsize
        self._tx_iov["len"][:, 0] = wire.HEADER_LEN
        self._tx_off = np.arange(cap, dtype=np.uint64)
        self._tx_iov_at = self._tx_iov.ctypes.data + self._tx_off * np.uint64(2 * IOV_DTYPE.itemsize)
        self._tx_bound = (None, 0)  # ((headers ptr, payload ptr, row stride), rows) the transmit iovecs point at
        self._tx_cmsg = np.zeros(cap, CMSG_DTYPE)
        self._tx_cmsg_at = self._tx_cmsg.ctypes.data + self._tx_off * np.uint64(CMSG_DTYPE.itemsize)
        self._tx_cmsg["len"] = 18
        self._tx_cmsg["level"] = SOL_UDP
        self._tx_cmsg["type"] = UDP_SEGMENT
        self._tx_cmsg["tlen"] = 20
        self._dscp_spec, self.ect = dscp, bool(ect)
        self._tos = dscp_mod.tos_table(dscp, ect=self.ect)  # header prio -> TOS byte; None: none set (0)
        self._v6peer = np.zeros(0, bool)  # per peer: sent to over IPv6 (traffic class), else IPv4 (TOS)
        self.max_batch = cap
        self.gso = False
        try:
            with net.in_netns(netns):
                try:
                    s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                    self.family = socket.AF_INET6
                except OSError:
                    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                    self.family = socket.AF_INET
                self._sock = s
                self._fd = s.fileno()
                # each received datagram's TOS (IPv4, also IPv4-mapped on the dual-stack socket: an
                # IP_TOS cmsg of one byte) or traffic class (IPv6: IPV6_TCLASS, an int): Batch.ecn
                s.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
                if self.family == socket.AF_INET6:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVTCLASS, 1)
                for opt, force, val in ((socket.SO_RCVBUF, SO_RCVBUFFORCE, rcvbuf),
                                        (socket.SO_SNDBUF, SO_SNDBUFFORCE, sndbuf)):
                    try:
                        s.setsockopt(socket.SOL_SOCKET, force, val)
                    except OSError:  # not root: capped by net.core.[rw]mem_max
                        s.setsockopt(socket.SOL_SOCKET, opt, val)
                if ifname:
                    try:
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, ifname.encode())
                    except PermissionError:
                        pass
                    except OSError as e:
                        raise TransportError(e.errno, f"no interface {ifname!r}"
                                             + (f" in netns {netns}" if netns else "")) from None
                host = "::" if self.family == socket.AF_INET6 else "0.0.0.0"
                if bind:
                    try:
                        ip = parse_ip(bind)
                    except ValueError:
                        raise TransportError(errno.EINVAL, f"bind {bind!r}: not an IP address; give one of "
                                             "this host's addresses (e.g. 198.18.0.1) or none for all") from None
                    # the dual-stack socket takes an IPv4 address in its mapped form
                    host = f"::ffff:{ip}" if ip.version == 4 and self.family == socket.AF_INET6 else str(ip)
                try:
                    s.bind((host, port))
                except OSError as e:
                    raise TransportError(e.errno, f"bind UDP {host} port {port}: {os.strerror(e.errno)}") from None
                self.port = s.getsockname()[1]
                self._tx_mmsg["namelen"] = SOCKADDR_LEN if self.family == socket.AF_INET6 else 16
                # 0: no segmentation unless a message asks for it; refused before 4.18
                self.gso = gso is not False and _offload(s, UDP_SEGMENT, 0, gso, "UDP_SEGMENT (UDP GSO, Linux 4.18+)")
                want_gro = gro
                if gro is None:  # merging happens only where the device does GRO
                    try:
                        want_gro = bool(ifname) and bool(net.ethtool_value(ifname, net.ETHTOOL_GGRO))
                    except OSError:
                        want_gro = False
                self.gro = bool(want_gro) and _offload(s, UDP_GRO, 1, gro, "UDP_GRO (UDP receive offload, Linux 5.0+)")
                # UDP_GRO's cmsg (the merged datagrams' size, an int), then the TOS's (IP_TOS: a byte;
                # IPV6_TCLASS: an int)
                self._anc = 2 * socket.CMSG_SPACE(4)
            self._poll = select.poll()
            self._poll.register(self._fd, select.POLLIN)
            self._wpoll = select.poll()
            self._wpoll.register(self._fd, select.POLLOUT)
        except BaseException:
            self.close()
            raise

    def set_ect(self, on: bool) -> None:
        """Send ECT(0) in every datagram's TOS / traffic class from the next ``send`` on (with the
        DSCP of ``dscp`` as before), or stop."""
        self.ect = bool(on)
        self._tos = dscp_mod.tos_table(self._dscp_spec, ect=self.ect)  # (one send reads it once)

    def add_peer(self, addr, port: int = wire.DEFAULT_PORT, mac=None) -> int:
        ip = parse_ip(addr)
        port = check_port(port, "peer port")
        bcast = self._is_broadcast(ip)
        if bcast and not self._nbcast:  # the first broadcast peer: allow sending to it, and drop the copy
            s = self._sock              # the kernel loops back to this host before any copy to user space
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
            s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, len(_NO_LOOPBACK).to_bytes(2, sys.byteorder)
                         + bytes(6) + ctypes.addressof(_NO_LOOPBACK).to_bytes(8, sys.byteorder))
        row = np.frombuffer(_sockaddr(self.family, ip, port), np.uint8)[None]
        self._names = np.concatenate([self._names, row])
        self._peers.append(ip)
        self._peer_key.setdefault(self._addr_key(row[0]), len(self._peers) - 1)  # first registration wins
        self._host_peer.clear()  # a source seen before it was registered is looked up again
        self._bcast = np.append(self._bcast, bcast)
        self._v6peer = np.append(self._v6peer, ip.version == 6)
        self._nbcast = int(self._bcast.sum())
        if self.family == socket.AF_INET6:
            mapped = ipaddress.IPv6Address(b"\0" * 10 + b"\xff\xff" + ip.packed) if ip.version == 4 else ip
            self._addrs.append((str(mapped), port, 0, 0))
        else:
            self._addrs.append((str(ip), port))
        return len(self._peers) - 1

    def _is_broadcast(self, ip) -> bool:
        """Whether this host routes ``ip`` as a broadcast (IPv4): connecting a socket without
        SO_BROADCAST to it is refused with EACCES, the kernel's own routing decision."""
        if ip.version != 4:
            return False
        with net.in_netns(self.netns), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((str(ip), 9))
            except PermissionError:
                return True
            except OSError:
                return False
        return False

    def _addr_key(self, name: np.ndarray) -> bytes:
        """The address bytes of a sockaddr row (what ``_match`` compares; ports are not)."""
        return name[8:24].tobytes() if self.family == socket.AF_INET6 else name[4:8].tobytes()

    # ---- receive -------------------------------------------------------

    def _point_rx(self, into: Batch) -> None:
        """Point the receive iovecs at ``into``'s rows (unless they point there already)."""
        n = min(into.cap, self.max_batch)
        h, p, b = into.headers, into.payload, self._rx_bound
        if b is not None and b[0] is h and b[1] is p and b[2] == n:  # the same arrays (held: no reuse of ids)
            return
        i = np.arange(n, dtype=np.uint64)
        self._rx_iov["base"][:n, 0] = np.uint64(h.ctypes.data) + i * np.uint64(wire.HEADER_LEN)
        self._rx_iov["len"][:n, 0] = wire.HEADER_LEN
        self._rx_iov["base"][:n, 1] = np.uint64(p.ctypes.data) + i * np.uint64(p.strides[0])
        self._rx_iov["len"][:n, 1] = into.maxlen
        self._rx_bound = (h, p, n)

    def _recv(self, into: Batch, timeout: float | None, max: int | None, want: int, linger: float,
              copy: bool) -> Batch:
        if not _rows_ok(into):  # the kernel can only scatter into plain rows
            tmp = self.recv(Batch.empty(into.cap, into.maxlen), timeout, max, want=want, linger=linger)
            k = len(tmp)
            wire.put(into.headers[:k], tmp.headers)
            into.payload[:k], into.lengths[:k], into.peer[:k] = tmp.payload, tmp.lengths, tmp.peer
            if into.ecn is not None:
                into.ecn[:k] = tmp.ecn
            into.n = k
            return into.view(0, k)
        cap = min(into.cap, self.max_batch, max or into.cap)
        if self._spill_n or (self.gro and cap < GRO_SEGS):
            return self._recv_spill(into, cap, timeout, want, linger)
        if self.gro:
            return self._recv_gro(into, cap, timeout, want, linger, copy)
        self._point_rx(into)
        k = self._read(cap, timeout)
        if k <= 0:
            into.n = 0
            return into.view(0, 0)
        if k < min(want, cap) and linger > 0 and not (into.headers["kind"][:k] != DATA_KIND).any():
            # coalesce: read on every LINGER_STEP until `want`, a control packet, or the linger's end
            end = time.monotonic() + linger
            while k < min(want, cap):
                left = end - time.monotonic()
                if left <= 0:
                    break
                time.sleep(min(LINGER_STEP, left))
                k2 = libc.recvmmsg(self._fd, self._rx_mmsg.ctypes.data + k * MMSG_DTYPE.itemsize, cap - k,
                                    MSG_DONTWAIT | MSG_TRUNC, None)
                if k2 > 0:
                    k += k2
                    self._rx_dirty = k
                    if (into.headers["kind"][k - k2: k] != DATA_KIND).any():  # a control packet: answer it now
                        break
        if into.ecn is not None:
            self._rx_ecn(k, into.ecn[:k])
        return self._deliver(into, into.payload, self._rx_mmsg["len"][:k].astype(np.int64), self._match(k), 0)

    def _recv_failed(self, e: Exception) -> None:
        """Drop what a narrow batch left over too: the datagrams read with the failed batch are gone."""
        self._spill_n = self._spill_at = 0
        super()._recv_failed(e)

    def _recv_gro(self, into: Batch, cap: int, timeout, want: int, linger: float, copy: bool) -> Batch:
        """``recv`` on a GRO socket: one message a read, as whole datagrams into the rows of a
        frames buffer (header and payload contiguous, one buffer per read: no scatter), each
        message right after the last one's datagrams; a merged run of row-sized datagrams lands
        row by row, other sizes are re-cut in place.  Reads go on while messages are queued and
        GRO_SEGS rows are left; then the headers are copied out and the payload rows copied or
        (``copy=False``) lent."""
        row = wire.HEADER_LEN + into.maxlen
        if self._frames_h is None or self._frames_h.strides[0] != row or len(self._frames_h) < cap:
            rows = max(cap, 2048)
            # GRO_OVERFLOW more bytes: a message of datagrams wider than a row still arrives whole
            self._frames = np.zeros(rows * row + GRO_OVERFLOW, np.uint8)
            self._frames_mv = memoryview(self._frames)
            self._frames_h = np.ndarray((rows,), wire.HEADER_DTYPE, self._frames, 0, (row,))
            self._gro_plen = np.zeros(rows, np.int64)  # the compiled read's per-row results
            self._gro_peer = np.zeros(rows, np.int32)
            self._gro_ecn = np.zeros(rows, np.uint8)  # each row's ECN field, where into.ecn cannot take it
            self._ecn_at = None
        if self._lib is not None:
            return self._recv_gro_native(into, cap, row, timeout, want, linger, copy)
        used, lost, end, nbytes, widest = 0, 0, None, 0, 0
        urgent = False  # a control packet came: it wants an answer, so no more lingering
        runs = []  # per message: (datagrams, size, last one's size, peer, ECN field)
        wait = timeout
        while cap - used >= GRO_SEGS:
            got = self._read_gro(used * row, wait)
            wait = 0
            if got is not None:
                total, g, peer, ecn = got
                c = max(-(-total // g), 1)
                last = total - (c - 1) * g
                if c > 1 and g != row:  # merged datagrams of another size than a row
                    c, drop, last = self._recut(used, row, total, g)
                    lost += drop
                elif c > cap - used:  # more row-sized datagrams than rows left (UDP_SEGMENT sends up to
                    lost += c - (cap - used)  # 128 on newer kernels; GRO merges 64): the rest are lost
                    c, last = cap - used, g
                elif c == 1 and total < wire.HEADER_LEN:  # shorter than a header: no magic, rejected as invalid
                    self._frames[used * row + total: used * row + wire.HEADER_LEN] = 0
                if c > 1:
                    self._c["rx_gro_packets"] += c
                if c:
                    # a control packet (several may come merged): answer it now, linger no more
                    urgent = urgent or self._frames[used * row + KIND_AT] != DATA_KIND
                    runs.append((c, g, last, peer, ecn))
                    used += c
                    nbytes += (c - 1) * g + last
                    widest = max(widest, g, last)
                continue
            if used == 0 or used >= min(want, cap) or linger <= 0 or urgent:
                break
            now = time.monotonic()  # coalesce: read on every LINGER_STEP until `want` or the linger ends
            end = now + linger if end is None else end
            if now >= end:
                break
            time.sleep(min(LINGER_STEP, end - now))
        if not runs:
            into.n = 0
            return into.view(0, 0)
        cs, gs, lasts, ps, es = zip(*runs)
        g = gs[0]
        if gs.count(g) == len(gs) and lasts.count(g) == len(lasts):  # one datagram size (a data stream)
            plen = np.full(used, g, np.int64)
        else:
            plen = np.repeat(np.array(gs, np.int64), cs)
            plen[np.cumsum(cs) - 1] = lasts
        peers = np.full(used, ps[0], np.int32) if ps.count(ps[0]) == len(ps) else np.repeat(np.array(ps, np.int32), cs)
        if into.ecn is not None:  # a merged message's datagrams share its one TOS
            into.ecn[:used] = es[0] if es.count(es[0]) == len(es) else np.repeat(np.array(es, np.uint8), cs)
        return self._gro_out(into, used, row, plen, peers, lost, widest, nbytes, copy)

    def _gro_out(self, into: Batch, used: int, row: int, plen: np.ndarray, peers: np.ndarray, lost: int,
                 widest: int, nbytes: int, copy: bool, ecn: np.ndarray | None = None, valid: bool = False) -> Batch:
        """The ``used`` datagrams a GRO receive left in the frames buffer, as ``recv``'s batch
        (``ecn``: their ECN fields where ``into.ecn`` does not hold them yet; ``valid``: every
        header is known to pass ``wire.all_valid``'s checks)."""
        frames = self._frames[: used * row].reshape(used, row)
        wire.put(into.headers[:used], self._frames_h[:used])
        if copy:
            into.payload[:used] = frames[:, wire.HEADER_LEN:]
            return self._deliver(into, into.payload, plen, peers, lost, widest, nbytes, ecn, valid)
        b = self._deliver(into, frames[:, wire.HEADER_LEN:], plen, peers, lost, widest, nbytes, ecn, valid)
        return Batch(b.headers, frames[: b.n, wire.HEADER_LEN:], b.lengths, b.peer, b.n, None, b.ecn)

    def _recv_gro_native(self, into: Batch, cap: int, row: int, timeout, want: int, linger: float,
                         copy: bool) -> Batch:
        """``_recv_gro`` with its reads in compiled code (``dblp_udp_gro_read``: the same rows,
        lengths, peers and counts); the waiting and lingering here, as there."""
        lib, res = self._lib, self._gro_res
        res[:] = 0
        names = self._names
        if self._gro_fixed is None or self._gro_fixed[0] is not self._frames or self._gro_fixed[1] is not names:
            key = (8, 16) if self.family == socket.AF_INET6 else (4, 4)  # the address in a sockaddr row
            self._gro_fixed = (self._frames, names, (self._frames.ctypes.data, len(self._frames), row),
                               (names.ctypes.data, len(names), SOCKADDR_LEN, *key, self._gro_plen.ctypes.data,
                                self._gro_peer.ctypes.data))
        args, tail = self._gro_fixed[2], self._gro_fixed[3]
        to = self._ecn_at
        if to is None or to[0] is not into.ecn or to[1] < cap:  # (held: no reuse of its id)
            to = self._ecn_to(into.ecn, cap)
        ecn, at, res_at = to[2], to[3], self._gro_res_at

        def read(used: int) -> int:
            used = lib.dblp_udp_gro_read(self._fd, *args, used, cap, *tail, at, res_at)
            if res[5]:
                raise TransportError(int(res[5]), f"recvmsg: {os.strerror(int(res[5]))}")
            return used

        used = read(0)
        if used == 0 and timeout != 0:
            got = 0

            def ready():
                nonlocal got
                got = read(0)
                return got > 0

            if not self._spin(ready, timeout):
                self._poll.poll(None if timeout is None else int(timeout * 1000))
                got = read(0)
            used = got
        end = None
        while 0 < used < min(want, cap) and linger > 0 and not res[4] and cap - used >= GRO_SEGS:
            now = time.monotonic()  # coalesce: read on every LINGER_STEP until `want` or the linger ends
            end = now + linger if end is None else end
            if now >= end:
                break
            time.sleep(min(LINGER_STEP, end - now))
            used = read(used)
        if not used:
            into.n = 0
            return into.view(0, 0)
        self._c["rx_gro_packets"] += int(res[1])
        return self._gro_out(into, used, row, self._gro_plen[:used], self._gro_peer[:used], int(res[0]),
                             int(res[3]), int(res[2]), copy, None if ecn is None else ecn[:used], valid=not res[7])

    def _ecn_to(self, ecn: np.ndarray | None, cap: int) -> tuple:
        """Where the compiled GRO read writes each row's ECN field, for ``into.ecn`` = ``ecn``:
        (ecn, rows, None, its address) where it is plain uint8 rows (the read writes straight
        into them), else (ecn, rows, the transport's own rows, their address) (``_deliver`` copies
        them over; or, with ``ecn`` None, drops them).  Kept in ``_ecn_at`` for the next read."""
        if ecn is not None and ecn.dtype == np.uint8 and ecn.flags.c_contiguous and ecn.flags.writeable \
                and len(ecn) >= cap:
            self._ecn_at = (ecn, len(ecn), None, ecn.ctypes.data)
        else:
            own = self._gro_ecn
            self._ecn_at = (ecn, len(own), None if ecn is None else own, own.ctypes.data)
        return self._ecn_at

    def _read_gro(self, at: int, timeout: float | None):
        """One message into the frames buffer from byte ``at``, waiting up to ``timeout``:
        (bytes, datagram size, peer id, ECN field), or None when none is queued."""
        try:
            n, anc, _, addr = self._sock.recvmsg_into([self._frames_mv[at:]], self._anc, MSG_DONTWAIT | MSG_TRUNC)
        except BlockingIOError:
            if timeout == 0:
                return None
            got = None

            def ready():
                nonlocal got
                got = self._read_gro(at, 0)
                return got is not None

            if not self._spin(ready, timeout):
                self._poll.poll(None if timeout is None else int(timeout * 1000))
                got = self._read_gro(at, 0)
            return got
        except InterruptedError:
            return None
        except OSError as e:
            raise TransportError(e.errno, f"recvmsg: {os.strerror(e.errno)}") from None
        g, ecn = n, 0
        for level, kind, data in anc:  # UDP_GRO: the merged datagrams' size (absent: one datagram)
            if level == SOL_UDP and kind == UDP_GRO and len(data) >= 4:
                g = int.from_bytes(data[:4], sys.byteorder)
            elif level == socket.IPPROTO_IP and kind == socket.IP_TOS and data:  # the TOS byte
                ecn = data[0] & 3
            elif level == socket.IPPROTO_IPV6 and kind == socket.IPV6_TCLASS and len(data) >= 4:  # an int
                ecn = int.from_bytes(data[:4], sys.byteorder) & 3
        peer = self._host_peer.get(addr[0])
        if peer is None:
            peer = self._peer_of(addr[0])
        return n, max(g, 1), peer, ecn

    def _peer_of(self, host: str) -> int:
        """Peer id of a source address as recvmsg gives it (-1: none), remembered (a bounded cache)."""
        try:
            packed = socket.inet_pton(self.family, host.split("%")[0])
        except OSError:
            return -1
        peer = self._peer_key.get(packed, -1)
        if len(self._host_peer) >= 4096:  # sources that are no peer: never an unbounded table
            self._host_peer.clear()
        self._host_peer[host] = peer
        return peer

    def _recvmmsg(self, ptr: int, nmsg: int, timeout: float | None) -> int:
        """recvmmsg of up to ``nmsg`` messages at ``ptr``, waiting up to ``timeout``; the count (<= 0: none)."""
        k = libc.recvmmsg(self._fd, ptr, nmsg, MSG_DONTWAIT | MSG_TRUNC, None)
        if k < 0:
            e = ctypes.get_errno()
            if e not in (errno.EAGAIN, errno.EINTR):
                raise TransportError(e, f"recvmmsg: {os.strerror(e)}")

            def ready():
                nonlocal k
                k = libc.recvmmsg(self._fd, ptr, nmsg, MSG_DONTWAIT | MSG_TRUNC, None)
                return k >= 0

            if not self._spin(ready, timeout) and timeout != 0:
                self._poll.poll(None if timeout is None else int(timeout * 1000))
                k = libc.recvmmsg(self._fd, ptr, nmsg, MSG_DONTWAIT | MSG_TRUNC, None)
        return k

    def _read(self, nmsg: int, timeout: float | None) -> int:
        """recvmmsg of up to ``nmsg`` messages (one datagram each: no GRO) into rows 0..; the count.

        The kernel writes each returned message's name and control lengths back; they are set to
        the buffers' sizes again before the next read, in those messages only (``_rx_dirty``: the
        rows the last read returned), not in all ``nmsg``: a few messages from a wide batch cost
        two small writes, not two of ``nmsg`` strided rows."""
        d = self._rx_dirty
        if d:
            self._rx_mmsg["namelen"][:d] = SOCKADDR_LEN
            self._rx_clen[:d] = RX_CMSG_DTYPE.itemsize
            self._rx_tos[:d] = 0  # a message without a TOS cmsg (controllen 0) then reads ECN 0
        k = self._recvmmsg(self._rx_mmsg.ctypes.data, nmsg, timeout)
        self._rx_dirty = max(k, 0)
        return k

    def _rx_ecn(self, k: int, out: np.ndarray) -> None:
        """The ECN field of each of the first ``k`` messages a recvmmsg read, into ``out``: the low
        2 bits of its IP_TOS or IPV6_TCLASS cmsg, 0 without one.

        One numpy call: the TOS cmsg is the only one this socket asks for (IP_RECVTOS,
        IPV6_RECVTCLASS; UDP_GRO is off on this path), so it is each message's first, its data
        at byte 16 (IP_TOS's byte, IPV6_TCLASS's int's low byte); ``_read`` zeroes that byte in
        the rows it reads again, so a message that came without one (controllen 0) reads 0.
        (Checking each row's cmsg level, type and controllen took 5 numpy calls more, ~7 us a
        read on 2 shared vCPUs: a third of a one-datagram receive.)"""
        np.bitwise_and(self._rx_tos[:k], ECN_MASK, out=out)

    def _recut(self, r0: int, row: int, total: int, g: int) -> tuple[int, int, int]:
        """Re-cut a merged message of ``g``-byte datagrams, received as one byte stream into the
        frames buffer from row ``r0`` (rows ``row`` bytes), into one datagram per row from ``r0``.

        Returns (datagrams kept, datagrams lost, the last kept one's size).  A datagram wider
        than a row keeps what the row takes (counted as truncated by ``_deliver``); one shorter
        than a header gets the rest of its header zeroed (no magic: rejected as invalid).
        """
        c = -(-total // g)
        n = min(c, GRO_SEGS)  # rows for at most GRO_SEGS (what UDP_GRO merges)
        f, base = self._frames, r0 * row
        order = range(n - 1, 0, -1) if g < row else range(1, n)  # never overwrite a datagram not moved yet
        for i in order:
            w = min(g, total - i * g, row)
            src, dst = base + i * g, base + i * row
            f[dst: dst + w] = f[src: src + w]  # (numpy copies through a buffer when the ranges overlap)
            if w < wire.HEADER_LEN:
                f[dst + w: dst + wire.HEADER_LEN] = 0
        if g < wire.HEADER_LEN:
            f[base + g: base + wire.HEADER_LEN] = 0
        return n, c - n, min(g, total - (n - 1) * g)

    def _recv_spill(self, into: Batch, cap: int, timeout, want, linger) -> Batch:
        """A batch narrower than one merged message: read into the spill batch, hand out ``cap`` rows."""
        sp = self._spill
        if not self._spill_n:
            if sp is None or sp.maxlen != into.maxlen:
                sp = self._spill = Batch.empty(SPILL_ROWS, into.maxlen)
            got = self.recv(sp, timeout, want=want, linger=linger)
            self._spill_n, self._spill_at = len(got), 0
        m = min(cap, self._spill_n)
        rows = slice(self._spill_at, self._spill_at + m)
        wire.put(into.headers[:m], sp.headers[rows])
        w = min(into.maxlen, sp.maxlen)
        into.payload[:m, :w] = sp.payload[rows, :w]
        into.lengths[:m], into.peer[:m] = np.minimum(sp.lengths[rows], into.maxlen), sp.peer[rows]
        if into.ecn is not None:
            into.ecn[:m] = sp.ecn[rows]
        self._spill_n -= m
        self._spill_at += m
        into.n = m
        return into.view(0, m)

    def _deliver(self, into: Batch, pay: np.ndarray, plen: np.ndarray, peer: np.ndarray, lost: int,
                 widest: int | None = None, total: int | None = None, ecn: np.ndarray | None = None,
                 valid: bool = False) -> Batch:
        """Validate the datagrams in rows [0, len(plen)) (UDP payload lengths ``plen``; headers in
        ``into``, payloads in ``pay``'s rows), count, return them.  ``widest`` and ``total``:
        ``plen``'s max and sum where the caller knows them already; ``valid``: the compiled read
        found every header passing :func:`wire.all_valid`'s checks.  ``into.ecn`` (where not None)
        holds each row's ECN field already, unless ``ecn`` gives them (then copied there).  The
        rows that remain are compacted in it like the rest."""
        k = len(plen)
        hdrs = into.headers[:k]
        lens = plen - wire.HEADER_LEN
        self._c["rx_truncated"] += lost
        ok = None  # None: all valid (the usual case, checked in few numpy calls)
        if (int(plen.max()) if widest is None else widest) - wire.HEADER_LEN > into.maxlen:
            total = None
            ok = wire.validate_batch(hdrs, plen) == 0
            self._c["rx_truncated"] += int(((lens > into.maxlen) & ok).sum())
            lens = np.minimum(lens, into.maxlen)
        elif not valid and not wire.all_valid(hdrs, plen):
            ok = wire.validate_batch(hdrs, plen) == 0
        if ok is not None and not ok.all():  # rare: compact the valid rows to the front
            total = None
            sel = np.flatnonzero(ok)
            self._c["rx_invalid"] += k - len(sel)
            wire.put(into.headers[: len(sel)], wire.take(hdrs, sel))
            pay[: len(sel)] = pay[sel]
            lens, peer = lens[sel], peer[sel]
            if into.ecn is not None:
                ecn = (into.ecn[:k] if ecn is None else ecn)[sel]  # (a copy: then put back)
            k = len(sel)
        into.lengths[:k] = lens
        into.peer[:k] = peer
        if ecn is not None and into.ecn is not None:
            into.ecn[:k] = ecn
        into.n = k
        self._c["rx_packets"] += k
        self._c["rx_bytes"] += int(lens.sum()) + k * wire.HEADER_LEN if total is None else total
        return into.view(0, k)

    def _match(self, k: int) -> np.ndarray:
        """Peer id of each of the first ``k`` messages read, from its source address (-1: unknown)."""
        if k <= SMALL:  # a few messages (merged ones, control packets): a dict beats numpy's per-call cost
            get, key, names = self._peer_key.get, self._addr_key, self._rx_name
            return np.array([get(key(names[i]), -1) for i in range(k)], np.int32)
        out = np.full(k, -1, np.int32)
        if not self._peers:
            return out
        names = self._rx_name[:k]
        for pid in range(len(self._peers)):
            ref = self._names[pid]
            if self.family == socket.AF_INET6:
                hit = np.all(names[:, 8:24] == ref[8:24], axis=1)
            else:
                hit = np.all(names[:, 4:8] == ref[4:8], axis=1)
            out[hit & (out < 0)] = pid
        return out

    # ---- transmit ------------------------------------------------------

    def send(self, batch: Batch, timeout: float | None = 1.0) -> int:
        self._check_open()
        n = len(batch)
        if n == 0:
            return 0
        if self._lib is not None:
            return self._send_native(batch, n, timeout)
        if n <= FEW_SEND:
            return self._send_few(batch, n, timeout)
        peer = np.asarray(batch.peer[:n], np.int64)
        if peer.min() < 0 or peer.max() >= len(self._peers):
            raise ValueError(f"peer ids must be in [0, {len(self._peers)}); add_peer() first")
        hdrs = np.ascontiguousarray(batch.headers[:n])
        pay = batch.payload[:n]
        if pay.strides[1] != 1:
            pay = np.ascontiguousarray(pay)
        lens = np.asarray(batch.lengths[:n], np.int64)
        if lens.max() > pay.shape[1]:
            raise ValueError(f"lengths exceed the payload width {pay.shape[1]}")
        names = self._names  # keep alive for the call (the messages point into it)
        tos = None if self._tos is None else self._tos[hdrs["prio"]]
        deadline = None if timeout is None else time.monotonic() + timeout
        sent = 0
        while sent < n:
            m = min(n - sent, self.max_batch)
            rows = slice(sent, sent + m)
            iov = self._tx_iov
            key = (hdrs.ctypes.data + sent * wire.HEADER_LEN, pay.ctypes.data + sent * pay.strides[0],
                   pay.strides[0])
            if key != self._tx_bound[0] or m > self._tx_bound[1]:  # else they point at these rows already
                iov["base"][:m, 0] = np.uint64(key[0]) + self._tx_off[:m] * np.uint64(wire.HEADER_LEN)
                iov["base"][:m, 1] = np.uint64(key[1]) + self._tx_off[:m] * np.uint64(key[2])
                self._tx_bound = (key, m)
            iov["len"][:m, 1] = lens[rows]
            first, count = self._messages(peer[rows], lens[rows], None if tos is None else tos[rows])
            nm = len(first)
            mm = self._tx_mmsg[:nm]
            mm["iov"] = self._tx_iov_at[first]
            mm["iovlen"] = 2 * count
            mm["name"] = np.uint64(names.ctypes.data) + peer[rows][first].astype(np.uint64) * np.uint64(SOCKADDR_LEN)
            seg = count > 1  # a message of several datagrams carries their size in a UDP_SEGMENT cmsg
            self._tx_cmsg["gso"][:nm] = lens[rows][first] + wire.HEADER_LEN
            if tos is None:
                mm["control"] = self._tx_cmsg_at[:nm] * seg
                mm["controllen"] = seg * CMSG_SEG
            else:  # every message carries its TOS (after the UDP_SEGMENT cmsg when it has one)
                mm["control"] = self._tx_cmsg_at[:nm] + (~seg * np.uint64(CMSG_SEG))
                mm["controllen"] = np.where(seg, CMSG_DTYPE.itemsize, CMSG_DTYPE.itemsize - CMSG_SEG)
                self._set_tos(self._tx_cmsg[:nm], peer[rows][first], tos[rows][first])
            done = errs = pk = 0  # messages done, packets failed, packets done
            fallback = False
            while done < nm:
                r = libc.sendmmsg(self._fd, self._tx_mmsg.ctypes.data + done * MMSG_DTYPE.itemsize, nm - done,
                                   MSG_DONTWAIT)
                if r > 0:
                    k = int(count[done: done + r].sum())
                    self._c["tx_gso_packets"] += k - int(np.count_nonzero(~seg[done: done + r]))
                    if self._nbcast:  # each message to a broadcast address comes back once (per datagram
                        to = self._bcast[peer[rows][first[done: done + r]]]  # without GRO here)
                        self._c["tx_looped"] += int(to.sum()) if self.gro else int(count[done: done + r][to].sum())
                    pk += k
                    done += r
                    continue
                e = ctypes.get_errno()
                if e in (errno.EAGAIN, errno.ENOBUFS, errno.EINTR):
                    if not self._wait_room(deadline):
                        break
                    continue
                if seg[done] and e in (errno.EINVAL, errno.EIO, errno.EOPNOTSUPP):
                    # the kernel will not segment this (no checksum offload on the route, a segment
                    # over the path MTU...): datagram by datagram from here on, for this socket
                    self.gso = False
                    self._c["tx_gso_off"] += 1
                    fallback = True
                    break
                # this message failed (unreachable, refused...): count it, skip it
                k = int(count[done])
                self._c["tx_errors"] += k
                errs += k
                pk += k
                done += 1
            ok = pk - errs
            self._c["tx_packets"] += ok
            self._c["tx_bytes"] += int(lens[sent: sent + pk].sum()) + ok * wire.HEADER_LEN  # approx. on errors
            sent += pk
            if done < nm and not fallback:  # blocked past the deadline
                break
        return sent

    def _send_addrs(self) -> tuple:
        """The compiled send's fixed arguments: the peer tables' and scratch arrays' addresses
        (computed again after ``add_peer`` replaces the tables; ``.ctypes.data`` costs ~1 us)."""
        names, v6, bc = self._names, self._v6peer, self._bcast
        if self._send_fixed is None or self._send_fixed[0] is not names or self._send_fixed[1] is not v6 \
                or self._send_fixed[2] is not bc:
            namelen = SOCKADDR_LEN if self.family == socket.AF_INET6 else 16
            self._send_fixed = (names, v6, bc, (names.ctypes.data, namelen, SOCKADDR_LEN, v6.ctypes.data,
                                                bc.ctypes.data, self._tx_mmsg.ctypes.data,
                                                self._tx_iov.ctypes.data, self._tx_cmsg.ctypes.data,
                                                self.max_batch, self._send_res.ctypes.data))
        return self._send_fixed[3]

    def _send_native(self, batch: Batch, n: int, timeout: float | None) -> int:
        """``send`` with its per-packet work in compiled code (``dblp_udp_send``: the same
        messages, datagrams and counts as the Python path; a few packets go one per message,
        as ``_send_few`` sends them)."""
        peer = np.ascontiguousarray(batch.peer[:n], np.int64)
        if peer.min() < 0 or peer.max() >= len(self._peers):
            raise ValueError(f"peer ids must be in [0, {len(self._peers)}); add_peer() first")
        lens = np.ascontiguousarray(batch.lengths[:n], np.int64)
        if lens.min() < 0:
            raise ValueError("negative payload lengths")
        addr = None if batch.addr is None else np.ascontiguousarray(batch.addr[:n], np.uint64)
        pay = batch.payload[:n]
        if addr is None:  # (with addresses the caller vouches for the bytes behind them)
            if lens.max() > pay.shape[1]:
                raise ValueError(f"lengths exceed the payload width {pay.shape[1]}")
            if pay.strides[1] != 1 or pay.strides[0] < 0:
                pay = np.ascontiguousarray(pay)
        hdrs = np.ascontiguousarray(batch.headers[:n])
        tos = None if self._tos is None else np.ascontiguousarray(self._tos[hdrs["prio"]], np.uint8)
        gso = self.gso and n > FEW_SEND
        deadline = None if timeout is None else time.monotonic() + timeout
        res = self._send_res
        fixed = self._send_addrs()
        ps = pay.strides[0]
        h0, p0, l0, q0 = hdrs.ctypes.data, pay.ctypes.data, lens.ctypes.data, peer.ctypes.data
        a0 = None if addr is None else addr.ctypes.data
        t0 = None if tos is None else tos.ctypes.data
        sent = 0
        while sent < n:
            res[:] = 0
            k = self._lib.dblp_udp_send(
                self._fd, h0 + sent * wire.HEADER_LEN, p0 + sent * ps, ps, None if a0 is None else a0 + sent * 8,
                l0 + sent * 8, q0 + sent * 8, n - sent, None if t0 is None else t0 + sent, *fixed[:5], int(gso),
                int(self.gro), *fixed[5:])
            c = self._c
            c["tx_packets"] += int(res[1])
            c["tx_bytes"] += int(res[2])
            c["tx_gso_packets"] += int(res[3])
            c["tx_errors"] += int(res[4])
            c["tx_looped"] += int(res[5])
            sent += k
            if res[0] == 1 and not self._wait_room(deadline):
                break
            if res[0] == 2:  # the kernel will not segment this: datagram by datagram from here on
                self.gso = gso = False
                c["tx_gso_off"] += 1
        return sent

    def _set_tos(self, cm: np.ndarray, peer: np.ndarray, tos: np.ndarray) -> None:
        """Fill the TOS cmsgs ``cm`` for messages to ``peer`` with ``tos``: IP_TOS to an IPv4 peer
        (a dual-stack socket sends to it over IPv4), IPV6_TCLASS to an IPv6 one."""
        v6 = self._v6peer[peer]
        cm["tlevel"] = np.where(v6, socket.IPPROTO_IPV6, socket.IPPROTO_IP)
        cm["ttype"] = np.where(v6, socket.IPV6_TCLASS, socket.IP_TOS)
        cm["tos"] = tos

    def _wait_room(self, deadline: float | None) -> bool:
        """The socket buffer is full: wait (<= 5 ms at a time) for room; False once ``deadline`` passed."""
        self._c["tx_blocked"] += 1
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        self._wpoll.poll(5 if left is None else max(1, min(5, int(left * 1000))))
        return True

    def _send_few(self, batch: Batch, n: int, timeout: float | None) -> int:
        """``send`` for a few packets (control packets): one sendmsg each, no vectorised set-up."""
        peer, lens = batch.peer[:n].tolist(), batch.lengths[:n].tolist()
        if min(peer) < 0 or max(peer) >= len(self._peers):
            raise ValueError(f"peer ids must be in [0, {len(self._peers)}); add_peer() first")
        if max(lens) > batch.payload.shape[1]:
            raise ValueError(f"lengths exceed the payload width {batch.payload.shape[1]}")
        hdrs = np.ascontiguousarray(batch.headers[:n])
        hb = hdrs.view(np.uint8).reshape(n, wire.HEADER_LEN)
        anc = [[] for _ in range(n)] if self._tos is None else [
            [(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, int(t).to_bytes(4, sys.byteorder)) if self._v6peer[p]
             else (socket.IPPROTO_IP, socket.IP_TOS, int(t).to_bytes(4, sys.byteorder))]
            for p, t in zip(peer, self._tos[hdrs["prio"]].tolist())]
        deadline = None if timeout is None else time.monotonic() + timeout
        sent = 0
        while sent < n:
            i = sent
            try:
                self._sock.sendmsg([hb[i], np.ascontiguousarray(batch.payload[i, : lens[i]])], anc[i], MSG_DONTWAIT,
                                   self._addrs[peer[i]])
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.ENOBUFS, errno.EINTR):
                    self._c["tx_errors"] += 1  # this packet failed (unreachable, refused...): count it, skip it
                    sent += 1
                elif not self._wait_room(deadline):
                    break
                continue
            self._c["tx_packets"] += 1
            self._c["tx_bytes"] += lens[i] + wire.HEADER_LEN
            self._c["tx_looped"] += int(self._bcast[peer[i]])
            sent += 1
        return sent

    def _messages(self, peer: np.ndarray, lens: np.ndarray, tos: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
        """Group packets into sendmmsg messages: (first packet, packet count) of each.

        With GSO, a message is a run of consecutive packets to one peer with
        one length and one TOS (``tos``, per packet, or None), cut at
        GSO_MAX_SEGS datagrams or GSO_MAX_BYTES; else one packet per message.
        """
        m = len(peer)
        if not self.gso or m == 1:
            return np.arange(m), np.ones(m, np.int64)
        size = lens + wire.HEADER_LEN
        key = peer * 65536 + size  # a run: one peer, one size (one TOS)
        if tos is not None:
            key = key * 256 + tos
        brk = np.empty(m, bool)
        brk[0] = True
        np.not_equal(key[1:], key[:-1], out=brk[1:])
        first = np.flatnonzero(brk)
        if len(first) <= SMALL:  # a few runs: cut them in Python
            starts, counts = [], []
            for r0, r1, sz in zip(first.tolist(), first[1:].tolist() + [m], size[first].tolist()):
                per = min(GSO_MAX_SEGS, GSO_MAX_BYTES // sz)
                starts.extend(range(r0, r1, per))
                counts.extend(min(per, r1 - x) for x in range(r0, r1, per))
            return np.array(starts, np.int64), np.array(counts, np.int64)
        runs = np.cumsum(brk) - 1  # cut runs longer than one message may carry
        per = np.minimum(GSO_MAX_SEGS, GSO_MAX_BYTES // size)
        brk |= (np.arange(m) - first[runs]) % per == 0
        first = np.flatnonzero(brk)
        count = np.empty(len(first), np.int64)
        count[:-1] = first[1:] - first[:-1]
        count[-1] = m - first[-1]
        return first, count

    def stats(self) -> dict:
        s = dict(self._c)
        if self._sock is not None:
            info = np.frombuffer(self._sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, 64), "<u4")
            # (the socket filter's drops of this host's own broadcasts are counted there too: not loss)
            s["rx_dropped"] = max(0, int(info[SK_MEMINFO_DROPS]) - s["tx_looped"])
            s["rx_queued_bytes"] = int(info[0])
        return s

    def fileno(self) -> int:
        return self._fd

    def tx_queued(self) -> int:
        """The socket's send queue (``TIOCOUTQ``: memory of the datagrams not yet out of the host,
        qdisc included; a datagram counts a little over its size)."""
        if self._fd < 0:
            return 0
        fcntl.ioctl(self._fd, termios.TIOCOUTQ, self._outq)
        return self._outq[0]

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._fd = -1
