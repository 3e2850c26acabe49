"""AF_XDP on every receive queue: one :class:`~pydblp.transport.xsk.XskTransport` socket per queue.

A NIC spreads flows over its receive queues (RSS); the host program hands
each packet to the AF_XDP socket of the queue it arrived on
(``bpf_redirect_map(&xsks, ctx->rx_queue_index, XDP_PASS)``), and a queue
without a socket passes it to a stack where nothing listens.  One socket on
queue 0 therefore hears only the flows that hash to queue 0 (a 4-queue veth:
about a quarter).  :class:`XskQueues` binds one socket to each queue of a set
(default: every receive queue the device has), each inserted at its own index
of the host program's ``xsks`` map, and offers them as one
:class:`~pydblp.transport.base.Transport`:

* receive polls every socket and drains the ready ones into consecutive rows
  of the caller's batch (its ``ecn`` rows too; starting from a different queue
  each call, so a busy queue cannot starve the others when the batch is small);
* transmit goes out through the first queue's socket (its tx ring, or with
  ``tx="kernel"`` its UDP socket; ``set_ect`` is that socket's); the others keep
  a token share of transmit frames (:data:`TOKEN_TX_FRAMES`) they never use;
* the pressure written to the host program is the highest receive-ring
  occupancy of any queue (the program sheds by one level for the interface);
* :meth:`XskQueues.stats` sums the sockets' counters and adds a breakdown
  per queue (``stats()["queues"]``), each with its copy / zero-copy mode.

UMEM: one per socket (not ``XDP_SHARED_UMEM``).  Shared, every socket would
still need its own fill and completion rings (5.10+), frames returned by one
queue's receive could not go to another's fill ring without a shared free
list between threads, and a payload lent with ``recv(copy=False)`` is a view
of one UMEM either way.  Separate UMEMs need no coordination and cost nothing
extra: the default receive budget (:data:`DEFAULT_RX_FRAMES` frames) is split
across the queues, at least :data:`MIN_RX_FRAMES` each, so N queues of 2 KiB
frames take ``max(16384, 2048 N) * 2 KiB`` for receive (32 MiB up to 8
queues, 4 MiB more per queue beyond) plus 8 MiB of transmit frames on the
first queue (128 KiB with ``tx="kernel"``) and 128 KiB on each other.

``recv(copy=False)``: when one queue delivered the batch, its payload rows are
that socket's UMEM frames, lent until the next receive (as
:class:`~pydblp.transport.xsk.XskTransport` does); when several did, their
payloads are copied into the caller's batch (frames of several UMEMs cannot
be one array).  Either way every frame lent by any socket goes back to its
fill ring at the next receive, not before.

Where the driver supports ntuple filters, :func:`steer_port` steers the job's
UDP port to one chosen queue (``ethtool -N IF flow-type udp4 dst-port P action
Q``) and :func:`unsteer` removes the rule; veth has no ntuple filters and is
refused in one line.

Each open :class:`XskQueues` publishes its sockets (queue, mode, counters, at
most :data:`PUBLISH_EVERY` s old) in a small JSON file under
:data:`STATUS_DIR`, removed on close; ``dblp status`` reads them
(:func:`published`).
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import fcntl
import json
import logging
import os
import select
import socket
import struct
import time
from pathlib import Path

from pydblp import net, wire
from pydblp._libc import pid_alive, unlink_pruned
from pydblp.host import MAX_QUEUES, PRESSURE_MAX
from pydblp.transport import addresses, frames
from pydblp.transport.base import Batch, Transport, TransportError, check_port, parse_ip
from pydblp.transport.xsk import PRESSURE_STEP, _U64, XskTransport, linger_paced, wait_paced
from pydblp.transport.xsk_ring import XDP_RING_NEED_WAKEUP

log = logging.getLogger(__name__)

DEFAULT_RX_FRAMES = 16384  # receive frames of all queues together (one socket's default)
MIN_RX_FRAMES = 2048       # receive frames per queue at least: ~2 ms of a 10 Gbit/s stream in 1.4 KB packets
TOKEN_TX_FRAMES = 64       # transmit frames of the queues that never transmit (the kernel wants a tx ring)
PUBLISH_EVERY = 1.0        # s: the status file's counters are at most this old (refreshed by stats())
STATUS_DIR = Path(os.environ.get("DBLP_XSK_STATUS_DIR", "/run/dblp/xsk"))

# linux/ethtool.h
SIOCETHTOOL = 0x8946
ETHTOOL_GCHANNELS = 0x3C
ETHTOOL_GRXCLSRLCNT, ETHTOOL_GRXCLSRLALL = 0x2E, 0x30
ETHTOOL_SRXCLSRLDEL, ETHTOOL_SRXCLSRLINS = 0x31, 0x32
UDP_V4_FLOW = 0x02
RX_CLS_LOC_SPECIAL, RX_CLS_LOC_ANY = 0x80000000, 0xFFFFFFFF
# struct ethtool_rxnfc: cmd, flow_type, data (u64), fs (struct ethtool_rx_flow_spec, 168 bytes), rule_cnt
RXNFC_LEN = 192
FS = 16                                # fs: flow_type u32, h_u (52 bytes), h_ext (20), m_u (52), m_ext (20),
FS_H_U, FS_M_U = FS + 4, FS + 76       # ring_cookie u64 (8-aligned), location u32
FS_RING_COOKIE, FS_LOCATION, RULE_CNT = FS + 152, FS + 160, FS + 168
UDP4_PDST = 10                         # struct ethtool_tcpip4_spec: ip4src, ip4dst, psrc, pdst (be16), tos


def _ethtool(ifname: str, netns: str | None, buf: ctypes.Array) -> None:
    """One SIOCETHTOOL ioctl on ``ifname`` (in ``netns``) with the command struct ``buf``; raises OSError."""
    ifr = struct.pack("16sP", ifname.encode(), ctypes.addressof(buf))
    with net.in_netns(netns), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), SIOCETHTOOL, ifr)


def rx_queue_count(ifname: str, netns: str | None = None) -> int:
    """How many receive queues ``ifname`` has now (what an AF_XDP socket may bind to).

    ETHTOOL_GCHANNELS (rx + combined channels); a driver without it
    (EOPNOTSUPP) answers through rtnetlink's ``IFLA_NUM_RX_QUEUES``.

    Raises:
        pydblp.net.NetError: no such interface.
    """
    buf = ctypes.create_string_buffer(struct.pack("=9I", ETHTOOL_GCHANNELS, *[0] * 8), 36)
    try:
        _ethtool(ifname, netns, buf)
        _, _, _, _, _, rx, _, _, combined = struct.unpack("=9I", buf.raw)
        if rx + combined:
            return rx + combined
    except OSError as e:
        if e.errno == errno.ENODEV:
            raise net.NetError(f"no interface {ifname!r}" + (f" in netns {netns}" if netns else "")) from None
    with net.ipr(netns) as ip:
        return int(ip.get_links(net.ifindex(ifname, netns))[0].get_attr("IFLA_NUM_RX_QUEUES") or 1)


def check_queues(queues, count: int, ifname: str) -> tuple[int, ...]:
    """The queue set ``queues`` means on a device ``ifname`` with ``count`` receive queues.

    Args:
        queues: ``"all"`` (every queue, 0..count-1), one queue index, or a
            non-empty sequence of distinct queue indexes.

    Raises:
        ValueError: a bad set, one line naming the fix.
    """
    if isinstance(queues, str):
        if queues != "all":
            raise ValueError(f"queues={queues!r}: 'all' or a list of queue indexes, e.g. queues=[0, 2]")
        qs = tuple(range(count))
    else:
        try:
            qs = (queues,) if hasattr(queues, "__index__") else tuple(queues)
        except TypeError:
            raise ValueError(f"queues={queues!r}: 'all' or a list of queue indexes, e.g. queues=[0, 2]") from None
        if not qs:
            raise ValueError("queues=[]: give at least one queue index, or queues='all'")
        bad = [q for q in qs if isinstance(q, bool) or not hasattr(q, "__index__") or q < 0]
        if bad:
            raise ValueError(f"queues={list(qs)!r}: {bad[0]!r} is not a queue index (an integer >= 0)")
        qs = tuple(q.__index__() for q in qs)
        if len(set(qs)) != len(qs):
            raise ValueError(f"queues={list(qs)!r}: a queue appears twice; list each once")
        beyond = [q for q in qs if q >= count]
        if beyond:
            raise ValueError(f"queue {beyond[0]} does not exist on {ifname}: it has {count} receive "
                             f"queue{'s' if count != 1 else ''} (0..{count - 1}); choose among them or queues='all'")
    if len(qs) > MAX_QUEUES or builtins.max(qs) >= MAX_QUEUES:
        raise ValueError(f"queues up to {MAX_QUEUES - 1}: the host program's socket map has {MAX_QUEUES} "
                         "entries; choose at most that many with queues=[...]")
    return qs


def rx_frames_per_queue(total: int, n: int) -> int:
    """Receive frames each of ``n`` sockets gets from a budget of ``total``: an even share rounded
    down to a power of two, at least :data:`MIN_RX_FRAMES` (and at most ``total``)."""
    share = builtins.max(1, total // n)
    return builtins.min(total, builtins.max(MIN_RX_FRAMES, 1 << (share.bit_length() - 1)))


# ---- ntuple steering -------------------------------------------------------------------------

def _rxnfc(cmd: int) -> ctypes.Array:
    buf = ctypes.create_string_buffer(RXNFC_LEN)
    struct.pack_into("=I", buf, 0, cmd)
    return buf


def steer_port(ifname: str, port: int, queue: int, netns: str | None = None) -> int:
    """Steer IPv4 UDP packets to ``port`` to receive ``queue`` with an ntuple filter
    (``ethtool -N IF flow-type udp4 dst-port PORT action QUEUE``); returns the rule's location
    for :func:`unsteer`.

    Raises:
        TransportError: the driver has no ntuple filters (veth), they are off, or the rule was
            refused; one line with the fix.
    """
    port = check_port(port)
    where = f"{ifname}" + (f" (netns {netns})" if netns else "")
    cnt = _rxnfc(ETHTOOL_GRXCLSRLCNT)
    try:
        _ethtool(ifname, netns, cnt)
    except OSError as e:
        raise TransportError(e.errno, f"steer: {where} has no ntuple filters ({os.strerror(e.errno)}); "
                             "leave steer off: queues='all' hears every queue") from None
    size = struct.unpack_from("=Q", cnt, 8)[0]
    if size & RX_CLS_LOC_SPECIAL:  # the driver picks a location itself
        loc = RX_CLS_LOC_ANY
    else:  # the first free one of the table, as ethtool(8) does
        used_n = struct.unpack_from("=I", cnt, RULE_CNT)[0]
        allr = ctypes.create_string_buffer(RXNFC_LEN + 4 * used_n)
        struct.pack_into("=I", allr, 0, ETHTOOL_GRXCLSRLALL)
        struct.pack_into("=I", allr, RULE_CNT, used_n)
        try:
            _ethtool(ifname, netns, allr)
        except OSError as e:
            raise TransportError(e.errno, f"steer: cannot list {where}'s ntuple rules ({os.strerror(e.errno)}); "
                                 "leave steer off") from None
        used = set(struct.unpack_from(f"={used_n}I", allr, RXNFC_LEN)) if used_n else set()
        free = [i for i in range(size & 0xFFFFFFFF) if i not in used]
        if not free:
            raise TransportError(errno.ENOSPC, f"steer: {where}'s ntuple table is full; "
                                 "delete a rule (ethtool -N IF delete N) or leave steer off")
        loc = free[0]
    ins = _rxnfc(ETHTOOL_SRXCLSRLINS)
    struct.pack_into("=I", ins, FS, UDP_V4_FLOW)
    struct.pack_into("!H", ins, FS_H_U + UDP4_PDST, port)
    struct.pack_into("!H", ins, FS_M_U + UDP4_PDST, 0xFFFF)
    struct.pack_into("=QI", ins, FS_RING_COOKIE, queue, loc)
    try:
        _ethtool(ifname, netns, ins)
    except OSError as e:
        hint = {errno.EOPNOTSUPP: "the driver has no ntuple filters",
                errno.EINVAL: f"queue {queue} or the rule is not accepted; `ethtool -K {ifname} ntuple on` first?"}
        raise TransportError(e.errno, f"steer: {where} refused UDP port {port} -> queue {queue} "
                             f"({os.strerror(e.errno)}: {hint.get(e.errno, 'see ethtool -n')}); "
                             "leave steer off") from None
    return struct.unpack_from("=I", ins, FS_LOCATION)[0]


def unsteer(ifname: str, location: int, netns: str | None = None) -> None:
    """Remove the ntuple rule at ``location`` (from :func:`steer_port`); OSError from the ioctl."""
    buf = _rxnfc(ETHTOOL_SRXCLSRLDEL)
    struct.pack_into("=I", buf, FS_LOCATION, location)
    _ethtool(ifname, netns, buf)


# ---- the status files `dblp status` reads ----------------------------------------------------

def published(root: Path | None = None) -> list[dict]:
    """The AF_XDP sockets open :class:`XskQueues` transports published (one dict per transport:
    ``pid``, ``netns``, ``ifname``, ``port``, ``tx``, ``queues``: per queue its ``queue``, ``mode``
    (``zerocopy`` or ``copy``), ``busy_poll`` and counters), sorted by netns, interface, pid.  Files of
    processes that are gone (killed before closing) are removed."""
    root = STATUS_DIR if root is None else root
    out = []
    for p in sorted(root.glob("*/*/*.json")) if root.exists() else []:
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if not pid_alive(int(rec.get("pid", 0))):
            unlink_pruned(p, 2)
            continue
        out.append(rec)
    return sorted(out, key=lambda r: (r.get("netns") or "", r["ifname"], r["pid"]))


# ---- the transport ---------------------------------------------------------------------------

def _ignore(level: int) -> None:
    """A socket's own pressure callback when several share the interface: the transport writes
    the maximum over its queues instead."""


class _Socket(XskTransport):
    """One queue's socket, with the few looks into its rings :class:`XskQueues` needs."""

    def rx_avail(self) -> int:
        """Descriptors waiting on the rx ring."""
        rx = self._rx
        return (int(rx.prod[0]) - int(rx.cons[0])) & 0xFFFFFFFF

    def wants_wakeup(self) -> bool:
        """The kernel asks for a syscall before it fills the rx ring again (zero-copy drivers)."""
        return self.need_wakeup and bool(int(self._fill.flags[0]) & XDP_RING_NEED_WAKEUP)

    def wake(self) -> None:
        self._poll.poll(0)

    def give_back(self) -> None:
        """Return the frames the last ``recv(copy=False)`` lent to the fill ring."""
        if self._lent is not None:
            self._fill_push(self._lent)
            self._lent = None

    def pump(self) -> float | None:
        """Release paced transmit frames that may go (``XskTransport`` does it in its receive)."""
        return self._pump()


class XskQueues(Transport):
    """AF_XDP sockets on the receive queues ``queues`` of (``netns``, ``ifname``), as one transport.

    Args:
        ifname, netns, port, host, xskmap: as :class:`~pydblp.transport.xsk.XskTransport`.
        queues: ``"all"`` (every receive queue the device has now), one queue
            index, or a list of them (``[0, 2]``).
        pressure: called with the highest rx ring occupancy of any queue,
            0..1000 (default: ``host.set_pressure`` when ``host`` is given).
        rx_frames: receive frames of all queues together, split evenly
            (:func:`rx_frames_per_queue`; module docstring: memory).
        tx_frames, rate, rate_burst, tx, dscp: the first queue's socket's,
            the one that transmits.
        spin: seconds a receive with a timeout busy-polls the rings before
            sleeping in poll(2).
        **kw: passed to every socket (``mode``, ``frame_size``, ``sg``,
            ``need_wakeup``, ``busy_poll``, ``busy_poll_budget``, ``rx_ring``,
            ``bind_timeout``).

    Raises:
        ValueError: a bad queue set or argument (before anything is opened).
        pydblp.net.NetError: no such interface.
        TransportError: a socket could not be opened; none stays open.
    """

    kind = "xsk"

    def __init__(self, ifname: str, netns: str | None = None, queues="all", port: int = wire.DEFAULT_PORT,
                 *, host=None, xskmap=None, pressure=None, rx_frames: int = DEFAULT_RX_FRAMES,
                 tx_frames: int = 4096, rate: float = 0, rate_burst: int | None = None, tx: str = "xsk",
                 dscp="off", spin: float = 200e-6, **kw):
        self.ifname, self.netns, self.port, self.spin = ifname, netns, check_port(port), spin
        # the namespace `dblp status` shows: named, or found (a process started inside one, nsenter)
        self._status_ns = netns or net.current_netns()
        self._socks: list[_Socket] = []
        self._ep = None
        self._ctrl = None
        self._status_path: Path | None = None
        self._c = dict.fromkeys(("rx_errors", "rx_polls"), 0)
        self.queues = check_queues(queues, rx_queue_count(ifname, netns), ifname)
        self.queue = self.queues[0]
        n = len(self.queues)
        if pressure is None and host is not None and hasattr(host, "set_pressure"):
            pressure = host.set_pressure
        self._pressure_fn, self._pressure = pressure, -1
        per = rx_frames_per_queue(rx_frames, n)
        try:
            for i, q in enumerate(self.queues):
                first = i == 0
                self._socks.append(_Socket(
                    ifname, netns, q, port, host=host, xskmap=xskmap, spin=spin, rx_frames=per,
                    pressure=pressure if n == 1 else _ignore,
                    tx_frames=tx_frames if first else TOKEN_TX_FRAMES, rate=rate if first else 0,
                    rate_burst=rate_burst if first else None, tx=tx if first else "xsk",
                    dscp=dscp if first else "off", **kw))
            self._ep = select.epoll()  # fileno(): readable when any socket is
            self._poller = select.poll()  # recv's own wait: poll(2) runs each socket's xsk_poll (wakeups)
            for s in self._socks:
                self._ep.register(s.fileno(), select.EPOLLIN)
                self._poller.register(s.fileno(), select.POLLIN)
            self._ctrl = host.control_seen() if n > 1 and host is not None and hasattr(host, "control_seen") else None
            self._ctrl_last = self._ctrl_count()
            self._ready = [0] * n
            self._next = 0
            self._published = 0.0
            self._publish()
        except BaseException:
            self.close()
            raise

    # ---- what it is ----------------------------------------------------

    @property
    def sockets(self) -> list[XskTransport]:
        """The per-queue sockets, in :attr:`queues` order; the first transmits."""
        return list(self._socks)

    @property
    def tx(self) -> str:
        return self._socks[0].tx

    @property
    def zerocopy(self) -> bool:
        """Every socket is bound in zero-copy mode."""
        return all(s.zerocopy for s in self._socks)

    @property
    def mode(self) -> str:
        """``zerocopy``, ``copy``, or ``mixed`` (some queues each)."""
        zc = {s.zerocopy for s in self._socks}
        return "mixed" if len(zc) > 1 else "zerocopy" if zc == {True} else "copy"

    @property
    def umem_bytes(self) -> int:
        """UMEM bytes of all sockets together (what this transport pins in memory)."""
        return sum(len(s._umem_mm) for s in self._socks if s._umem_mm is not None)

    def describe(self) -> str:
        """One line: interface, queues, mode, memory (``eth0 queues 0-3: copy mode, 42.3 MiB UMEM``)."""
        qs = self.queues
        span = (f"{qs[0]}-{qs[-1]}" if len(qs) > 1 and qs == tuple(range(qs[0], qs[-1] + 1))
                else ",".join(map(str, qs)))
        bp = self._socks[0].busy_poll if self._socks else 0
        return (f"{self.ifname} queue{'s' if len(qs) > 1 else ''} {span}: {self.mode} mode, "
                f"{self.umem_bytes / 2 ** 20:.1f} MiB UMEM" + (f", busy poll {bp} us" if bp else ""))

    # ---- peers and transmit: the first socket's ------------------------

    def add_peer(self, addr, port: int = wire.DEFAULT_PORT, mac=None, src=None) -> int:
        """Register ``addr`` on every socket (receive recognises it on any queue); one peer id.

        The MAC is resolved once (as :meth:`XskTransport.add_peer`) unless given.
        """
        self._check_open()
        first = self._socks[0]
        if mac is None and len(self._socks) > 1:
            mac = addresses.resolve_mac(first.ifindex, self.ifname, parse_ip(addr), self.netns)
        ids = {s.add_peer(addr, port, mac, src) for s in self._socks}
        if len(ids) != 1:  # peers are added to every socket in the same order
            raise TransportError(errno.EPROTO, f"peer ids differ across queues: {sorted(ids)}")
        return ids.pop()

    @property
    def reads_addresses(self) -> bool:
        return bool(self._socks) and self._socks[0].reads_addresses  # (send is the first socket's)

    @property
    def reports_tx_queue(self) -> bool:
        return bool(self._socks) and self._socks[0].reports_tx_queue

    def send(self, batch: Batch, timeout: float | None = 1.0) -> int:
        self._check_open()
        return self._socks[0].send(batch, timeout)

    def set_ect(self, on: bool) -> None:
        """:meth:`XskTransport.set_ect` of the transmitting socket (the first); ``ect`` is its."""
        self._check_open()
        first = self._socks[0]
        first.set_ect(on)
        self.ect = first.ect

    def flush(self, timeout: float = 1.0) -> bool:
        """:meth:`XskTransport.flush` of the transmitting socket."""
        return self._socks[0].flush(timeout)

    def tx_backlog(self) -> float:
        return self._socks[0].tx_backlog()

    def tx_queued(self) -> int:
        return self._socks[0].tx_queued()

    # ---- receive -------------------------------------------------------

    def _avail(self) -> int:
        """Descriptors waiting on every rx ring (each kept in ``_ready``); their sum."""
        r = self._ready
        for i, s in enumerate(self._socks):
            r[i] = s.rx_avail()
        return sum(r)

    def _ctrl_count(self) -> int | None:
        return None if self._ctrl is None else _U64.unpack_from(self._ctrl)[0]

    def _set_pressure(self) -> None:
        """Write the fullest rx ring's occupancy (0..1000) when it moved ``PRESSURE_STEP`` or reached 0."""
        if self._pressure_fn is None:
            return
        level = builtins.max(a * PRESSURE_MAX // s._rx.n for a, s in zip(self._ready, self._socks))
        if abs(level - self._pressure) >= PRESSURE_STEP or (level == 0 and self._pressure != 0):
            self._pressure_fn(level)
            self._pressure = level

    def _recv(self, into: Batch, timeout: float | None, max: int | None, want: int, linger: float,
              copy: bool) -> Batch:
        socks = self._socks
        if len(socks) == 1:  # one queue: the socket's own receive, lending and lingering included
            return socks[0].recv(into, timeout, max, want=want, linger=linger, copy=copy)
        cap = into.cap if max is None else builtins.min(max, into.cap)
        for s in socks:  # what the last receive lent is the caller's no longer
            s.give_back()
        first = socks[0]
        pace = first.pump()
        total = self._avail()
        if total == 0 and timeout != 0 and not self._spin(lambda: self._avail() > 0, timeout):
            self._c["rx_polls"] += 1
            total = wait_paced(self._poller, timeout, pace, self._avail, first.pump)
        total, self._ctrl_last = linger_paced(total, want, linger, self._avail, first.pump, self._ctrl_count,
                                              self._ctrl_last)
        self._set_pressure()
        n = len(socks)
        start, self._next = self._next, (self._next + 1) % n
        busy = [(start + j) % n for j in range(n) if self._ready[(start + j) % n]]
        for i in range(n):
            if not self._ready[i] and socks[i].wants_wakeup():
                socks[i].wake()
        lend = not copy and len(busy) == 1  # one UMEM: its frames can be the payload rows
        ecn = into.ecn  # each socket writes its rows' ECN field there (None: not reported)
        k = 0
        for i in busy:
            if k >= cap:
                break
            part = Batch(into.headers[k:cap], into.payload[k:cap], into.lengths[k:cap], into.peer[k:cap], 0,
                         None, None if ecn is None else ecn[k:cap])
            got = socks[i].recv(part, 0.0, copy=not lend)
            if lend:
                m = got.n
                into.n = m
                return Batch(into.headers[:m], got.payload, into.lengths[:m], into.peer[:m], m,
                             None, None if ecn is None else ecn[:m])
            k += got.n
        into.n = k
        return into.view(0, k)

    # ---- the rest ------------------------------------------------------

    def stats(self) -> dict:
        """The sockets' counters summed (``pressure``: the highest; ``zerocopy``: all sockets),
        plus ``queues``: ``{queue: that socket's stats()}`` and ``mode``."""
        s = dict(self._c)
        per = {q: t.stats() for q, t in zip(self.queues, self._socks)}
        for st in per.values():
            for k, v in st.items():
                if isinstance(v, bool) or not isinstance(v, int):
                    continue
                s[k] = builtins.max(s.get(k, 0), v) if k == "pressure" else s.get(k, 0) + v
        if self._socks and not self.closed:
            s["pressure"] = builtins.max(self._pressure, 0) if len(self._socks) > 1 else s.get("pressure", 0)
            s["zerocopy"] = self.zerocopy
            s["mode"] = self.mode
        s["queues"] = per
        if time.monotonic() - self._published >= PUBLISH_EVERY:
            self._publish(per)
        return s

    def _publish(self, per: dict | None = None) -> None:
        """Write (or refresh) this transport's status file for ``dblp status``; a failure is only logged."""
        if self.closed:
            return
        per = per if per is not None else {q: t.stats() for q, t in zip(self.queues, self._socks)}
        rec = {"pid": os.getpid(), "netns": self._status_ns, "ifname": self.ifname, "port": self.port, "tx": self.tx,
               "updated": time.time(),
               "queues": [{"queue": q, "mode": "zerocopy" if t.zerocopy else "copy", "busy_poll": t.busy_poll,
                           "umem_bytes": len(t._umem_mm), "rx_frames": t.rx_frames, "tx_frames": t.tx_frames,
                           **{k: per[q].get(k, 0) for k in ("rx_packets", "tx_packets", "rx_dropped", "rx_ring_full",
                                                           "rx_fill_ring_empty_descs", "rx_invalid")}}
                          for q, t in zip(self.queues, self._socks)]}
        try:
            if self._status_path is None:
                d = STATUS_DIR / (self._status_ns or "-") / self.ifname
                self._status_path = d / f"{os.getpid()}-{self._socks[0].fileno()}.json"
            # (each time: `dblp status` removes a directory a dead transport left empty, and this
            # one's may be that, between its mkdir and its first write)
            self._status_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self._status_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(rec))
            os.replace(tmp, self._status_path)
        except OSError as e:
            log.debug("no status file for dblp status: %s", e)
        self._published = time.monotonic()

    def fileno(self) -> int:
        """An epoll descriptor, readable when any socket is (poll it for POLLIN); -1 once closed."""
        return -1 if self._ep is None else self._ep.fileno()

    def close(self) -> None:
        """Close every socket (each leaves the host program's map), the pressure back at 0; idempotent."""
        socks, self._socks = self._socks, []
        for s in socks:
            s.close()
        if self._pressure_fn is not None and self._pressure > 0:
            with contextlib.suppress(OSError):
                self._pressure_fn(0)
        self._pressure = -1
        if self._ep is not None:
            self._ep.close()
            self._ep = None
        if self._ctrl is not None:
            self._ctrl.close()
            self._ctrl = None
        if self._status_path is not None:
            unlink_pruned(self._status_path, 2)
            self._status_path = None
