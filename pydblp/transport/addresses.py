"""Addresses for frames a transport builds itself: the local source address and the peer's MAC.

A transport that writes whole Ethernet frames (AF_XDP) needs what the kernel's
stack would otherwise fill in: a source IP address on the interface and the
next hop's MAC from the kernel's ARP/ND table, resolved on demand.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import time

from pydblp import net
from pydblp.transport import frames
from pydblp.transport.base import TransportError

NUD_INCOMPLETE, NUD_FAILED = 0x01, 0x20


def local_addr(ifindex: int, ifname: str, dst, netns: str | None = None):
    """The address of interface ``ifindex`` to send to ``dst`` from.

    Args:
        ifindex, ifname: the interface (the name for messages).
        dst: an ``ipaddress`` address; its version picks the family.
        netns: the interface's network namespace.

    One in ``dst``'s subnet (of the same scope, for IPv6) if any, else the
    first (global, for IPv6).  Raises :class:`TransportError` (EADDRNOTAVAIL)
    when the interface has no address of that family.
    """
    with net.ipr(netns) as ip:
        rows = ip.get_addr(index=ifindex, family=socket.AF_INET if dst.version == 4 else socket.AF_INET6)
    cands = [(ipaddress.ip_interface(f"{r.get_attr('IFA_ADDRESS')}/{r['prefixlen']}")) for r in rows]
    if not cands:
        raise TransportError(errno.EADDRNOTAVAIL, f"{ifname} has no IPv{dst.version} address")
    for c in cands:
        if dst in c.network and (dst.version == 4 or c.ip.is_link_local == dst.is_link_local):
            return c.ip
    for c in cands:
        if dst.version == 4 or not c.ip.is_link_local:
            return c.ip
    return cands[0].ip


def lookup_mac(ifindex: int, dst, netns: str | None = None) -> bytes | None:
    """``dst``'s MAC from the kernel's ARP/ND table on ``ifindex`` (None: no usable entry).

    Reads the table (pyroute2's ``get_neighbours``, the kernel's neighbour table); sends nothing.
    """
    with net.ipr(netns) as ip:
        for r in ip.get_neighbours(ifindex=ifindex, dst=str(dst)):
            mac = r.get_attr("NDA_LLADDR")
            if mac and r["state"] not in (NUD_FAILED, NUD_INCOMPLETE):
                return frames.mac_bytes(mac)
    return None


def resolve_mac(ifindex: int, ifname: str, dst, netns: str | None = None, timeout: float = 2.0) -> bytes:
    """``dst``'s MAC, making the kernel resolve it (ARP or ND) if its table has none.

    Sends empty datagrams to ``dst``'s discard port until the entry appears;
    raises :class:`TransportError` (EHOSTUNREACH) after ``timeout`` seconds.
    """
    mac = lookup_mac(ifindex, dst, netns)
    if mac:
        return mac
    fam = socket.AF_INET if dst.version == 4 else socket.AF_INET6
    with net.in_netns(netns), socket.socket(fam, socket.SOCK_DGRAM) as s:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:  # any datagram makes the kernel resolve dst's MAC (discard port)
                s.sendto(b"", (str(dst), 9))
            except OSError:
                pass
            time.sleep(0.05)
            mac = lookup_mac(ifindex, dst, netns)
            if mac:
                return mac
    raise TransportError(errno.EHOSTUNREACH, f"cannot resolve the MAC of {dst} on {ifname}; pass mac=")
