"""Transports: move batches of DBLP packets between hosts.

:class:`XskTransport` (AF_XDP, needs root and an XDP program that redirects
to its XSKMAP) and :class:`UdpTransport` (ordinary UDP sockets, no root)
share the :class:`Transport` interface and the :class:`Batch` type; see
:mod:`pydblp.transport.base` for the threading model and overload behaviour.
"""

from pydblp.transport.base import Batch, Transport, TransportError

__all__ = ["Batch", "Transport", "TransportError", "XskTransport", "UdpTransport", "open_transport"]


def __getattr__(name):
    if name == "XskTransport":
        from pydblp.transport.xsk import XskTransport
        return XskTransport
    if name == "UdpTransport":
        from pydblp.transport.udp import UdpTransport
        return UdpTransport
    raise AttributeError(name)


def open_transport(kind: str, netns=None, ifname=None, queue: int = 0, port: int = 47800, **kw) -> Transport:
    """``kind`` 'xsk' or 'udp'; the rest as the transports' ``open``."""
    if kind == "xsk":
        from pydblp.transport.xsk import XskTransport
        return XskTransport.open(netns, ifname, queue, port, **kw)
    if kind == "udp":
        from pydblp.transport.udp import UdpTransport
        return UdpTransport.open(netns, ifname, queue, port, **kw)
    raise ValueError(f"unknown transport kind {kind!r} (xsk, udp)")
