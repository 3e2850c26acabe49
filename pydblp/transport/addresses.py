"""Addresses for frames a transport builds itself: the local source address and the next hop's MAC.

A transport that writes whole Ethernet frames (AF_XDP) needs what the kernel's
stack would otherwise fill in: a source IP address on the interface and the
next hop's MAC from the kernel's ARP/ND table, resolved on demand.  The next hop
is the peer itself where it is on the link, else the gateway of the kernel's
route to it (a routed fabric: a leaf switch per rack, a /31 per host), and that
route must leave by the interface the frames go out of.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import time

from pyroute2.netlink.exceptions import NetlinkError

from pydblp import net
from pydblp.transport import frames
from pydblp.transport.base import TransportError

NUD_INCOMPLETE, NUD_FAILED = 0x01, 0x20
RTN_LOCAL = 2  # a route's type: an address of this host


def local_addr(ifindex: int, ifname: str, dst, netns: str | None = None):
    """The address of interface ``ifindex`` to send to ``dst`` from.

    Args:
        ifindex, ifname: the interface (the name for messages).
        dst: an ``ipaddress`` address; its version picks the family.
        netns: the interface's network namespace.

    One in ``dst``'s subnet (of the same scope, for IPv6) if any, else the
    preferred source of the kernel's route to ``dst`` where that route leaves by
    this interface, else the first (global, for IPv6).  Raises
    :class:`TransportError` (EADDRNOTAVAIL) when the interface has no address of
    that family.
    """
    with net.ipr(netns) as ip:
        rows = ip.get_addr(index=ifindex, family=socket.AF_INET if dst.version == 4 else socket.AF_INET6)
    cands = [(ipaddress.ip_interface(f"{r.get_attr('IFA_ADDRESS')}/{r['prefixlen']}")) for r in rows]
    if not cands:
        raise TransportError(errno.EADDRNOTAVAIL, f"{ifname} has no IPv{dst.version} address")
    for c in cands:
        if dst in c.network and (dst.version == 4 or c.ip.is_link_local == dst.is_link_local):
            return c.ip
    r = _route(dst, netns)  # routed: the source the kernel would pick, if it is this interface's
    pref = r.get_attr("RTA_PREFSRC") if r is not None and r.get_attr("RTA_OIF") == ifindex else None
    for c in cands:
        if pref is not None and c.ip == ipaddress.ip_address(pref):
            return c.ip
    for c in cands:
        if dst.version == 4 or not c.ip.is_link_local:
            return c.ip
    return cands[0].ip


def _route(dst, netns: str | None):
    """The kernel's route to ``dst`` (``ip route get``: the one it would send by), or None."""
    with net.ipr(netns) as ip:
        try:
            rows = ip.route("get", dst=str(dst), family=socket.AF_INET if dst.version == 4 else socket.AF_INET6)
        except NetlinkError:
            return None  # (unreachable, prohibited: no route)
    return rows[0] if rows else None


def is_local(dst, netns: str | None = None) -> bool:
    """Whether ``dst`` is an address of this host (the kernel's route to it is ``local``)."""
    r = _route(dst, netns)
    return r is not None and r["type"] == RTN_LOCAL


def next_hop(ifindex: int, ifname: str, dst, netns: str | None = None, local: bool = False):
    """The address whose MAC frames to ``dst`` carry: ``dst`` where it is on the link,
    else the gateway of the kernel's route to it.  An address of this host (another
    interface's: a rank beside this one) is ``dst`` itself with ``local``: frames
    built here leave by ``ifname`` whatever the kernel would do with them, so they
    reach it where its interface shares the link, by its own MAC.

    Raises :class:`TransportError` (ENETUNREACH) where the kernel has no route to
    ``dst``, where the route leaves by another interface (frames built here leave by
    ``ifname`` only), or, without ``local``, where ``dst`` is an address of this host.
    """
    if dst.version == 6 and dst.is_link_local:
        return dst  # (on the link by definition; a lookup would need the interface as its scope)
    r = _route(dst, netns)
    if r is None:
        raise TransportError(errno.ENETUNREACH, f"no route to {dst}: add one through {ifname} "
                             f"(ip route add {dst} via GATEWAY dev {ifname})")
    oif = r.get_attr("RTA_OIF")
    if r["type"] == RTN_LOCAL:
        if local:
            return dst
        raise TransportError(errno.ENETUNREACH, f"{dst} is an address of this host: frames to it leave by "
                             f"{ifname} and come back over the link; give its interface's MAC (mac=)")
    if oif != ifindex:
        with net.ipr(netns) as ip:
            links = ip.get_links(oif) if oif else []
        other = links[0].get_attr("IFLA_IFNAME") if links else f"interface {oif}"
        raise TransportError(errno.ENETUNREACH, f"{dst} is routed out of {other}, not {ifname}: open the "
                             f"data plane on {other}, or route {dst} through {ifname}")
    gw = r.get_attr("RTA_GATEWAY")
    return ipaddress.ip_address(gw) if gw else dst


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
    """The MAC of the next hop to ``dst`` (:func:`next_hop`: ``dst`` itself on the link, else
    its route's gateway), making the kernel resolve it (ARP or ND) if its table has none.

    Sends empty datagrams to ``dst``'s discard port until the entry appears;
    raises :class:`TransportError`: ENETUNREACH as :func:`next_hop` does, EHOSTUNREACH
    after ``timeout`` seconds.
    """
    hop = next_hop(ifindex, ifname, dst, netns)
    mac = lookup_mac(ifindex, hop, netns)
    if mac:
        return mac
    fam = socket.AF_INET if dst.version == 4 else socket.AF_INET6
    with net.in_netns(netns), socket.socket(fam, socket.SOCK_DGRAM) as s:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:  # any datagram to dst makes the kernel resolve the next hop's MAC (discard port)
                s.sendto(b"", (str(dst), 9))
            except OSError:
                pass
            time.sleep(0.05)
            mac = lookup_mac(ifindex, hop, netns)
            if mac:
                return mac
    via = "" if hop == dst else f" (the gateway to {dst})"
    raise TransportError(errno.EHOSTUNREACH, f"cannot resolve the MAC of {hop}{via} on {ifname}; pass mac=")
