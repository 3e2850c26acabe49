"""Transports: move batches of DBLP packets between hosts.

:class:`XskTransport` (AF_XDP, needs root and an XDP program that redirects
to its XSKMAP) and :class:`UdpTransport` (ordinary UDP sockets, no root)
share the :class:`Transport` interface and the :class:`Batch` type; see
:mod:`pydblp.transport.base` for the threading model and overload behaviour.
:func:`pydblp.dataplane.open_dataplane` opens one by kind, with what it needs.
"""

from pydblp.transport.base import Batch, Transport, TransportError

__all__ = ["Batch", "Transport", "TransportError", "XskTransport", "UdpTransport"]


def __getattr__(name):
    if name == "XskTransport":
        from pydblp.transport.xsk import XskTransport
        return XskTransport
    if name == "UdpTransport":
        from pydblp.transport.udp import UdpTransport
        return UdpTransport
    raise AttributeError(name)

