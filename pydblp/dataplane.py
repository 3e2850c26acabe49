"""The data plane of one rank: its transport, the host XDP program it needs, what it tells peers.

:func:`open_dataplane` is the one place that assembles it, for every kind:

* ``udp``: :class:`~pydblp.transport.udp.UdpTransport`, plain UDP sockets (any user).
* ``xsk``: :class:`~pydblp.transport.xsk.XskTransport`, AF_XDP receive and
  transmit (root).  Transmit bypasses qdiscs, so ``rate`` paces it.
* ``xsk-ktx``: AF_XDP receive, transmit through a kernel UDP socket on the
  interface (``XskTransport(tx="kernel")``), paced by the interface's qdisc.

The AF_XDP kinds need pydblp's host program on the interface: the one
``dblp load`` pinned there if any, else one attached for this data plane
alone.  The job is registered on it (as delivered over AF_XDP).

With a job ``key`` the transport is wrapped in
:class:`~pydblp.transport.auth.AuthTransport` (docs/authentication.md): every
packet sent is tagged with the key and the run ``epoch``, every packet received
is verified before anything above sees it.  Without one, nothing changes.

Ownership: :meth:`DataPlane.close` (also ``with``) closes the transport,
removes the job registration it made and detaches the host program it
attached; a program ``dblp load`` attached stays.  If assembly fails, what
was opened so far is released before the error propagates.
"""

from __future__ import annotations

import dataclasses
import logging

from pydblp import net, wire
from pydblp.transport.base import Transport, check_port

KINDS = ("udp", "xsk", "xsk-ktx")

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """What a rank publishes so that peers can reach its data plane.

    Attributes:
        addr: the address peers send to.
        port: the UDP port the transport receives on.
        mac: the interface's MAC (None without an interface).
        queue: the receive queue the transport is bound to.
        mtu: the interface's MTU (None without an interface).
    """

    addr: str
    port: int
    mac: str | None
    queue: int
    mtu: int | None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class DataPlane:
    """An open data plane: :attr:`transport`, :attr:`endpoint` and what it attached for them.

    Made by :func:`open_dataplane`; :meth:`close` releases everything.
    """

    def __init__(self, kind: str, transport: Transport, endpoint: Endpoint, host=None,
                 job: int | None = None, prior_job: dict | None = None, owns_host: bool = False):
        self.kind = kind
        self.transport = transport
        self.endpoint = endpoint
        self.host = host  # pydblp.host.HostMaps (HostProgram when attached here), or None
        self._job, self._prior_job, self._owns_host = job, prior_job, owns_host

    def close(self) -> None:
        """Close the transport, undo the job registration and detach what was attached.  Idempotent."""
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.host is not None:
            host, self.host = self.host, None
            try:
                _unregister(host, self._job, self._prior_job, self._owns_host)
            finally:
                host.close()

    def __enter__(self) -> "DataPlane":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_kind(kind: str, iface: str | None) -> None:
    """Raise ValueError unless ``kind`` is a data-plane kind that can open with ``iface``."""
    if kind not in KINDS:
        raise ValueError(f"transport {kind!r}: use udp, xsk or xsk-ktx")
    if kind != "udp" and not iface:
        raise ValueError(f"the {kind} transport needs iface=")


def open_dataplane(kind: str, iface: str | None = None, *, netns: str | None = None,
                   port: int = wire.DEFAULT_PORT, queue: int = 0, addr: str | None = None,
                   job: int | None = None, rank: int = 0, world: int = 1, rate: float = 0,
                   spin: float = 0.0, max_payload: int | None = None, key: bytes | None = None,
                   epoch: int | None = None, **kw) -> DataPlane:
    """Open the data plane of kind ``kind`` on ``iface``.

    Args:
        kind: ``udp``, ``xsk`` or ``xsk-ktx`` (module docstring).
        iface: the data-plane interface; None (``udp`` only): any, on loopback.
        netns: the interface's network namespace.
        port: UDP port to receive on (``udp``: 0 picks a free one).
        queue: receive queue (the AF_XDP kinds bind their socket to it).
        addr: the address to publish (default: the first IPv4 address of
            ``iface``, or 127.0.0.1 without one).
        job, rank, world: the job registered on the host program (AF_XDP kinds).
        rate: bits/s at which ``xsk`` paces its transmit (0: unpaced); the
            other kinds transmit through the qdisc and ignore it.
        spin: seconds a receive busy-polls before sleeping.
        max_payload: the largest DBLP payload (bytes) the AF_XDP receive
            frames must hold whole (its tag included); None: the transport's
            default frames (2 KiB, enough for 1408-byte chunks).
        key: the job key (:func:`pydblp.jobkey.load_key`); None: no authentication.
        epoch: the run epoch every rank of this run uses with ``key``
            (:func:`pydblp.jobkey.new_epoch`, drawn by one rank and shared).
        **kw: passed to the transport's constructor.

    Raises:
        ValueError: a bad kind or argument (before anything is opened).
        pydblp.net.NetError, pydblp.host.HostError, pydblp.transport.TransportError:
            the interface, the host program or the transport cannot be set up;
            nothing this call opened stays open.
    """
    check_kind(kind, iface)
    if key is not None and epoch is None:
        raise ValueError("key= needs epoch=: one rank draws it (pydblp.jobkey.new_epoch) and gives it to all")
    if kind != "udp":
        if job is None:
            raise ValueError(f"the {kind} transport needs job= (registered on the host program)")
        check_port(port)
    mtu = net.iface_mtu(iface, netns) if iface else None
    mac = net.iface_mac(iface, netns) if iface else None
    addr = addr or (net.iface_addr(iface, netns) if iface else "127.0.0.1")
    if kind == "udp":
        from pydblp.transport.udp import UdpTransport

        t = _keyed(UdpTransport(iface, netns=netns, queue=queue, port=port, spin=spin, **kw), key, epoch)
        return DataPlane(kind, t, Endpoint(addr, t.port, mac, queue, mtu))

    from pydblp import host as hostprog
    from pydblp.transport.xsk import XskTransport
    from pydblp.transport.xsk_ring import frame_size_for

    try:
        maps, owns = hostprog.open_pinned(iface, netns), False
        if maps.port != port:
            log.warning("the host program pinned on %s filters UDP port %d, not %d: AF_XDP receives nothing "
                        "until `dblp config` or the port agree", iface, maps.port, port)
    except hostprog.HostError:
        maps, owns = hostprog.HostProgram(iface, netns=netns, port=port), True
    prior = None
    registered = False
    try:
        prior = maps.jobs().get(job)
        maps.register_job(job, world, rank, hostprog.JobTransport.XSK)
        registered = True
        if max_payload is not None:
            kw.setdefault("frame_size", frame_size_for(max_payload + (wire.TAG_LEN if key else 0)))
        t = _keyed(XskTransport(iface, netns=netns, queue=queue, port=port, host=maps, spin=spin,
                                rate=rate if kind == "xsk" else 0, tx="xsk" if kind == "xsk" else "kernel", **kw),
                   key, epoch)
    except BaseException:
        try:
            if registered:
                _unregister(maps, job, prior, owns)
        finally:
            maps.close()
        raise
    return DataPlane(kind, t, Endpoint(addr, t.port, mac, queue, mtu), maps, job, prior, owns)


def _keyed(t: Transport, key: bytes | None, epoch: int | None) -> Transport:
    """``t`` itself without a key, else wrapped to tag and verify every packet (closed on failure)."""
    if key is None:
        return t
    from pydblp.transport.auth import authenticate

    try:
        return authenticate(t, key, epoch)
    except BaseException:
        t.close()
        raise


def _unregister(maps, job: int | None, prior: dict | None, owns_host: bool) -> None:
    """Undo :func:`open_dataplane`'s registration of ``job``: restore what was there before."""
    if job is None or owns_host:  # a program attached here goes, its jobs with it
        return
    try:
        if prior is None:
            maps.unregister_job(job)
        else:
            maps.register_job(job, prior["world_size"], prior["rank"], prior["transport"])
    except (OSError, net.NetError) as e:  # the pinned program went away meanwhile (`dblp unload`)
        log.warning("job %d on %s left as it was: %s", job, maps.ifname, e)
