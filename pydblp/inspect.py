"""Inspection: a scapy layer for the DBLP header, and packet decoding for ``dblp dump``.

Importing this module binds :class:`DBLP` to UDP port 47800 in both
directions, so ``rdpcap``/``sniff`` show DBLP fields::

    >>> from scapy.all import rdpcap
    >>> import pydblp.inspect
    >>> rdpcap("trace.pcap")[0][pydblp.inspect.DBLP].chunk

:func:`bind_port` adds another port.  The decoding helpers
(:func:`summary`, :func:`describe`) judge a packet with
:func:`pydblp.wire.validate` on the UDP payload bytes, not with scapy's
dissection, so a malformed packet is reported with its reason and never
raises.

Needs scapy (``pip install 'pydblp[inspect]'``); importing this module
without it raises :class:`pydblp._extras.MissingExtra`, which says so.
"""

from __future__ import annotations

import datetime as _dt
import logging
import os
import socket
import struct
from collections.abc import Callable, Iterator

from pydblp._extras import require

require("pydblp.inspect", "scapy")

from scapy.fields import ByteEnumField, ByteField, FlagsField, IntField, ShortField, XShortField  # noqa: E402
from scapy.layers.inet import IP, UDP  # noqa: E402
from scapy.layers.inet6 import IPv6  # noqa: E402
from scapy.packet import Packet, bind_bottom_up, bind_layers  # noqa: E402

from pydblp import dscp as dscp_mod  # noqa: E402
from pydblp import wire  # noqa: E402

_FLAG_NAMES = [f.name for f in sorted(wire.Flag, key=int)]
assert [1 << i for i in range(len(_FLAG_NAMES))] == sorted(int(f) for f in wire.Flag)
_DEFAULTS = wire.Header()
_SIZE = {"B": 1, "H": 2, "I": 4}
_NAMES = [n for n, _ in wire.FIELDS]
_LEN_OFFSET = sum(_SIZE[c] for _, c in wire.FIELDS[: _NAMES.index("len")])


def _field(name: str, code: str):
    """The scapy field for one wire.FIELDS entry (enums and flags get names)."""
    default = getattr(_DEFAULTS, name)
    if name == "magic":
        return XShortField(name, default)
    if name == "kind":
        return ByteEnumField(name, int(default), {int(k): k.name for k in wire.Kind})
    if name == "dtype":
        return ByteEnumField(name, int(default), {int(d): d.name for d in wire.Dtype})
    if name == "flags":
        return FlagsField(name, int(default), 8, _FLAG_NAMES)
    if name == "len":
        return ShortField(name, None)  # filled from the payload in post_build
    return {"B": ByteField, "H": ShortField, "I": IntField}[code](name, int(default))


class DBLP(Packet):
    """DBLP v1 header (32 bytes); the payload (and a tag, with flag TAG) follows as Raw."""

    name = "DBLP"
    fields_desc = [_field(name, code) for name, code in wire.FIELDS]

    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        if self.len is None:
            taglen = wire.TAG_LEN if self.flags & wire.Flag.TAG and len(pay) >= wire.TAG_LEN else 0
            n = (len(pay) - taglen).to_bytes(2, "big")
            pkt = pkt[:_LEN_OFFSET] + n + pkt[_LEN_OFFSET + 2:]
        return pkt + pay

    def mysummary(self) -> str:
        return self.sprintf("DBLP %kind% job %job% round %round% chunk %chunk%/%nchunks%")


assert [f.name for f in DBLP.fields_desc] == _NAMES

PORTS: set[int] = set()


def bind_port(port: int) -> None:
    """Dissect UDP traffic to or from ``port`` as DBLP (in addition to the ports bound so far)."""
    port = int(port)
    if not 0 < port < 65536:
        raise ValueError(f"port {port} out of range 1-65535")
    if port in PORTS:
        return
    # dissection only: UDP()/DBLP() keeps building with dport 47800
    bind_bottom_up(UDP, DBLP, sport=port)
    bind_bottom_up(UDP, DBLP, dport=port)
    PORTS.add(port)


bind_layers(UDP, DBLP, dport=wire.DEFAULT_PORT)
bind_port(wire.DEFAULT_PORT)


# ---- decoding ------------------------------------------------------------------

def dblp_payload(pkt: Packet, ports: set[int] | None = None) -> bytes | None:
    """The UDP payload of a packet to or from a DBLP port, or None if it is not one."""
    if UDP not in pkt:
        return None
    udp = pkt[UDP]
    ports = PORTS if ports is None else ports
    if udp.sport not in ports and udp.dport not in ports:
        return None
    data = bytes(udp.payload)
    if udp.len is not None and udp.len >= 8:
        data = data[: udp.len - 8]  # trailing link-layer padding is not payload
    return data


def _endpoints(pkt: Packet) -> str:
    ip = pkt[IP] if IP in pkt else pkt[IPv6] if IPv6 in pkt else None
    if ip is None:
        return "?"
    fmt = "{}:{}" if ip.version == 4 else "[{}]:{}"
    if UDP in pkt:
        return f"{fmt.format(ip.src, pkt[UDP].sport)} > {fmt.format(ip.dst, pkt[UDP].dport)}"
    return f"{ip.src} > {ip.dst}"


def dscp_of(pkt: Packet) -> int | None:
    """The packet's DSCP (IPv4 TOS or IPv6 traffic class, upper six bits); None without IP."""
    if IP in pkt:
        return int(pkt[IP].tos) >> 2
    if IPv6 in pkt:
        return int(pkt[IPv6].tc) >> 2
    return None


ECN_NAMES = {0: "Not-ECT", 1: "ECT1", 2: "ECT0", 3: "CE"}  # RFC 3168: ECT(1), ECT(0), Congestion Experienced


def ecn_of(pkt: Packet) -> int | None:
    """The packet's ECN field (IPv4 TOS or IPv6 traffic class, lower two bits); None without IP."""
    if IP in pkt:
        return int(pkt[IP].tos) & 3
    if IPv6 in pkt:
        return int(pkt[IPv6].tc) & 3
    return None


def _time(pkt: Packet) -> str:
    return _dt.datetime.fromtimestamp(float(pkt.time)).strftime("%H:%M:%S.%f")


def _flags(value: int) -> str:
    names = [f.name for f in wire.Flag if value & f]
    rest = value & ~sum(int(f) for f in wire.Flag)
    if rest:
        names.append(f"{rest:#x}")
    return "|".join(names) or "-"


def _kind(value: int) -> str:
    try:
        return wire.Kind(value).name
    except ValueError:
        return f"kind{value}"


def _dtype(value: int) -> str:
    try:
        return wire.Dtype(value).name
    except ValueError:
        return f"dtype{value}"


def header_line(h: wire.Header) -> str:
    """The DBLP part of a summary line."""
    dst = "all" if h.dst == wire.DST_ALL else h.dst  # a broadcast all-gather
    return (f"{_kind(h.kind)} job {h.job} round {h.round} tensor {h.tensor} rank {h.src}->{dst} "
            f"chunk {h.chunk}/{h.nchunks} prio {h.prio} len {h.len} flags {_flags(h.flags)}")


def tag_status(data: bytes, key: bytes) -> str:
    """How a well-formed packet's tag fares under the job ``key``: ``tag valid (epoch 0x...)``,
    ``tag INVALID`` (forged, altered, or made with another key) or ``untagged``."""
    h = wire.Header.unpack(data)
    if not h.flags & wire.Flag.TAG:
        return "untagged"
    if wire.validate(data, key=key) is not wire.Reason.OK:
        return "tag INVALID"
    return f"tag valid (epoch {wire.tag_epoch(data[-wire.TAG_LEN:]):#010x})"


def summary(pkt: Packet, ports: set[int] | None = None, key: bytes | None = None) -> str:
    """One line, tcpdump style: time, endpoints, then the DBLP fields or ``malformed (reason)``,
    the IP header's DSCP when not 0 (``dscp AF41``: :mod:`pydblp.dscp`), its ECN field when
    not Not-ECT (``ecn ECT0``, ``ecn ECT1``, ``ecn CE``: a congested switch's mark);
    with the job ``key``, then the tag's verdict (:func:`tag_status`).

    Packets that are not on a DBLP port get scapy's own summary.
    """
    data = dblp_payload(pkt, ports)
    if data is None:
        return f"{_time(pkt)} {pkt.summary()}"
    head = f"{_time(pkt)} {_endpoints(pkt)}"
    reason = wire.validate(data)
    if reason is not wire.Reason.OK:
        return f"{head} malformed ({reason.name.lower()}) {len(data)} bytes"
    d = dscp_of(pkt)
    mark = f" dscp {dscp_mod.name(d)}" if d else ""  # (best effort, the usual, is not shown)
    e = ecn_of(pkt)
    mark += f" ecn {ECN_NAMES[e]}" if e else ""  # (Not-ECT, the usual, is not shown)
    return f"{head} {header_line(wire.Header.unpack(data))}{mark}" + (f" {tag_status(data, key)}" if key else "")


def describe(pkt: Packet, ports: set[int] | None = None, key: bytes | None = None) -> str:
    """The summary line followed by every header field, one per line (``key`` as :func:`summary`),
    the IP header's DSCP and ECN, the payload, and a STOP's payload decoded: the receiver's
    probe-timeout ``estimate`` (100 us units) and, from senders that send it, the ``echo`` of
    what it received from the STOP's destination (``rx`` DATA packets, ``ce`` of them CE-marked);
    a HELLO's: its number and how long its sender has been out of rounds."""
    line = summary(pkt, ports, key)
    data = dblp_payload(pkt, ports)
    if data is None:
        return line
    out = [line]
    if len(data) < wire.HEADER_LEN:
        out.append(f"    {len(data)} bytes: {data.hex()}")
        return "\n".join(out)
    h = wire.Header.unpack(data)
    shown = {"magic": f"{h.magic:#06x}", "kind": f"{_kind(h.kind)} ({h.kind})",
             "dtype": f"{_dtype(h.dtype)} ({h.dtype})", "flags": f"{_flags(h.flags)} ({h.flags:#04x})",
             "tol": f"{h.tol} ({h.tol / wire.TOL_SCALE:.2%})"}
    for name, _ in wire.FIELDS:
        out.append(f"    {name:<8} {shown.get(name, getattr(h, name))}")
    d = dscp_of(pkt)
    if d is not None:  # the IP header's mark of the priority (pydblp.dscp)
        out.append(f"    {'dscp':<8} {dscp_mod.name(d)} ({d})")
    e = ecn_of(pkt)
    if e is not None:  # RFC 3168: set to CE by a congested switch (the testbed's queue: mark)
        out.append(f"    {'ecn':<8} {ECN_NAMES[e]} ({e})")
    taglen = wire.TAG_LEN if h.flags & wire.Flag.TAG else 0
    body = data[wire.HEADER_LEN: len(data) - taglen] if len(data) - wire.HEADER_LEN >= taglen else b""
    out.append(f"    {'payload':<8} {len(body)} bytes" + (f": {body[:16].hex()}{'...' if len(body) > 16 else ''}"
                                                         if body else ""))
    if h.kind == wire.Kind.STOP:
        out += _stop_lines(body)
    elif h.kind == wire.Kind.HELLO and len(body) >= wire.HELLO_PAYLOAD.size:
        number, ms = wire.HELLO_PAYLOAD.unpack_from(body)
        what = ("asks" if h.flags & wire.Flag.ASK else f"out of rounds {ms} ms" if ms
                else "in the round, on behalf of a busy one")
        out.append(f"    {'hello':<8} number {number}, {what}")
    if taglen:
        out.append(f"    {'tag':<8} {data[-taglen:].hex() if len(data) >= wire.HEADER_LEN + taglen else 'missing'}")
    return "\n".join(out)


def _stop_lines(body: bytes) -> list[str]:
    """A STOP's payload: ``!H`` the probe-timeout estimate in 100 us units, then (10 bytes and
    more; older senders send 2) ``!II`` the echo: DATA packets received from the STOP's
    destination rank and how many of them arrived CE-marked, both mod 2^32."""
    out = []
    if len(body) >= 2:
        (est,) = struct.unpack_from("!H", body)
        out.append(f"    {'estimate':<8} {est} ({est / 10:g} ms)")
    if len(body) >= 10:
        rx, ce = struct.unpack_from("!II", body, 2)
        out.append(f"    {'echo':<8} rx {rx} ce {ce}")
    return out


# ---- capture sources -------------------------------------------------------------

class CaptureError(RuntimeError):
    """A capture could not be opened or read; the message says why."""


def default_filter(ports: set[int] | None = None) -> str:
    """The BPF expression for DBLP traffic: UDP to or from any DBLP port."""
    return " or ".join(f"udp port {p}" for p in sorted(PORTS if ports is None else ports))


def check_filter(expr: str) -> None:
    """Raise :class:`CaptureError` if libpcap cannot compile ``expr`` for Ethernet."""
    from scapy.arch.common import compile_filter
    from scapy.data import DLT_EN10MB
    from scapy.error import Scapy_Exception

    try:
        compile_filter(expr, linktype=DLT_EN10MB)
    except (Scapy_Exception, ImportError) as e:
        raise CaptureError(f"bad filter {expr!r}: {e}") from None


class _HeldWarnings(logging.Handler):
    """Hold what scapy logs inside ``with``; :meth:`replay` hands it to scapy's own handlers.
    A file scapy cannot open then fails with one line, not its warnings first."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self._log = logging.getLogger("scapy")

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self):
        self._propagate = self._log.propagate
        self._saved = self._log.handlers[:]
        self._log.handlers = [self]
        self._log.propagate = False
        return self

    def __exit__(self, *exc) -> None:
        self._log.handlers = self._saved
        self._log.propagate = self._propagate

    def replay(self) -> None:
        for r in self.records:
            self._log.handle(r)
        self.records.clear()


def read_pcap(path: str, expr: str | None = None) -> Iterator[Packet]:
    """Packets of a pcap/pcapng file, through the BPF filter ``expr`` (tcpdump) if given."""
    from scapy.error import Scapy_Exception
    from scapy.utils import PcapReader, tcpdump

    if not os.path.isfile(path):
        raise CaptureError(f"{path}: {'a directory' if os.path.isdir(path) else 'no such file'}")
    proc = None
    held = _HeldWarnings()  # scapy's warnings while it opens the file: shown only if it opens
    try:
        with held:
            if expr:
                check_filter(expr)
                proc = tcpdump(path, args=["-w", "-"], flt=expr, getproc=True, quiet=True)
                reader = PcapReader(proc.stdout)
            else:
                reader = PcapReader(path)
    except Scapy_Exception as e:
        raise CaptureError(f"{path}: not a capture file scapy can read ({e})") from None
    except OSError as e:
        raise CaptureError(f"{path}: {e.strerror or e}") from None
    held.replay()
    try:
        yield from reader
    finally:
        reader.close()
        if proc is not None:
            proc.wait()


ARPHRD_LOOPBACK = 772
SOL_PACKET, PACKET_ADD_MEMBERSHIP, PACKET_MR_PROMISC = 263, 1, 1  # <linux/if_packet.h>


def _listen_class():
    from scapy.arch.linux import L2ListenSocket, get_last_packet_timestamp
    from scapy.data import MTU

    class ListenSocket(L2ListenSocket):
        """Both directions, like tcpdump, but loopback packets once (not as sent and received)."""

        def recv_raw(self, x=MTU):
            pkt, sa_ll, ts = self._recv_raw(self.ins, x)
            if sa_ll[3] == ARPHRD_LOOPBACK and sa_ll[2] == socket.PACKET_OUTGOING:
                return None, None, None
            return self.LL, pkt, ts if ts is not None else get_last_packet_timestamp(self.ins)

    return ListenSocket


def _netns_iface(name: str):
    """A scapy interface for ``name`` as seen from the calling thread's netns.

    scapy's interface table lists the namespace it was loaded in; describe
    the interface from a probe socket here instead (index, link type).
    """
    from scapy.config import conf
    from scapy.interfaces import NetworkInterface

    with socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0) as probe:
        probe.bind((name, 0))  # ENODEV if the interface is not here
        hatype = probe.getsockname()[3]
    provider = next(iter(conf.ifaces.providers.values()), None)
    return NetworkInterface(provider, {"name": name, "network_name": name, "description": name,
                                       "index": socket.if_nametoindex(name), "type": hatype})


def sniff_live(iface: str, prn: Callable[[Packet], None], expr: str, count: int = 0,
               timeout: float | None = None, netns: str | None = None) -> int:
    """Capture on ``iface`` (inside ``netns``), calling ``prn`` per packet; return how many.

    The capture socket is opened inside the namespace, so it stays there;
    the filter is compiled in the kernel (libpcap).
    """
    from scapy.error import Scapy_Exception
    from scapy.sendrecv import sniff

    from pydblp.net import in_netns

    check_filter(expr)
    _ListenSocket = _listen_class()
    seen = 0

    def each(pkt):
        nonlocal seen
        seen += 1
        prn(pkt)

    from scapy.config import conf

    where = f" in netns {netns}" if netns else ""
    with in_netns(netns):
        try:
            # promiscuous mode by this namespace's index: scapy's would look the name up in the
            # table of the namespace it was loaded in (a testbed worker's eth0 is not the host's)
            sock = _ListenSocket(iface=_netns_iface(iface), filter=expr, promisc=False)
            if conf.sniff_promisc:
                try:
                    sock.ins.setsockopt(SOL_PACKET, PACKET_ADD_MEMBERSHIP,
                                        struct.pack("IHH8s", socket.if_nametoindex(iface), PACKET_MR_PROMISC, 0, b""))
                except BaseException:
                    sock.close()
                    raise
        except PermissionError:
            raise CaptureError(f"cannot capture on {iface!r}{where}: needs root (CAP_NET_RAW)") from None
        except OSError as e:
            raise CaptureError(f"cannot capture on {iface!r}{where}: {e.strerror or e}") from None
        except Scapy_Exception as e:
            raise CaptureError(f"cannot capture on {iface!r}{where}: {e}") from None
        try:
            sniff(opened_socket=sock, prn=each, count=count, timeout=timeout, store=False)
        finally:
            sock.close()
    return seen
