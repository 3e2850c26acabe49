"""The data plane of one rank: its transport, the host XDP program it needs, what it tells peers.

:func:`open_dataplane` is the one place that assembles it, for every kind:

* ``udp``: :class:`~pydblp.transport.udp.UdpTransport`, plain UDP sockets (any user).
* ``xsk``: :class:`~pydblp.transport.xsk_queues.XskQueues`, AF_XDP receive
  on every receive queue of the interface (or a chosen set: ``queues=``) and
  transmit through the first queue's socket (root).  Transmit bypasses
  qdiscs, so ``rate`` paces it.
* ``xsk-ktx``: AF_XDP receive as ``xsk``, transmit through a kernel UDP socket on the
  interface (``XskTransport(tx="kernel")``), paced by the interface's qdisc.

A NIC spreads flows over its receive queues, so the AF_XDP kinds bind one
socket per queue by default; ``steer=Q`` instead asks the driver to steer the
job's port to queue Q (an ntuple filter, removed on close) and binds that
queue alone (docs/architecture.md, "Receive queues").

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

On a pinned program a data plane holds its job as a claim (:class:`pydblp.host.JobClaim`,
a lock the kernel releases when the process ends): a second data plane of the
same job on that interface is refused while the first is open, and a
registration a data plane made before it died is replaced, not put back, when
the next one closes.  A registration made otherwise (``HostMaps.register_job``)
is put back as it was.
"""

from __future__ import annotations

import dataclasses
import ipaddress
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
        queue: the (first) receive queue the transport is bound to.
        mtu: the interface's MTU (None without an interface).
        queues: every receive queue the transport is bound to (AF_XDP: one socket each).
    """

    addr: str
    port: int
    mac: str | None
    queue: int
    mtu: int | None
    queues: tuple[int, ...] = ()

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class DataPlane:
    """An open data plane: :attr:`transport`, :attr:`endpoint` and what it attached for them.

    Made by :func:`open_dataplane`; :meth:`close` releases everything.
    """

    def __init__(self, kind: str, transport: Transport, endpoint: Endpoint, host=None,
                 job: int | None = None, prior_job: dict | None = None, owns_host: bool = False,
                 queues=None, steered: tuple | None = None, claim=None):
        self.kind = kind
        self.transport = transport
        self.endpoint = endpoint
        self.host = host  # pydblp.host.HostMaps (HostProgram when attached here), or None
        self._job, self._prior_job, self._owns_host = job, prior_job, owns_host
        self.xsk = queues  # the XskQueues under any authentication wrapper (AF_XDP kinds), else None
        self._steered = steered  # (ifname, ntuple rule location, netns) to remove on close
        self._claim = claim  # the job's claim on a pinned program, released after the registration

    @property
    def queues(self) -> tuple[int, ...]:
        """The receive queues the transport is bound to."""
        return self.endpoint.queues

    def link_mac(self, addr: str, mac: str | None) -> str | None:
        """What a peer's published interface MAC (``mac``, its :class:`Endpoint`'s) is worth here:
        ``mac`` where the peer at ``addr`` is on this data plane's link, or on this host (a rank
        beside this one on another interface: frames reach it where the two share a link); None
        where the kernel routes ``addr`` through a gateway (a routed fabric).  Frames to a routed
        peer carry the gateway's MAC, which the transport resolves when given None, and arrive
        with the gateway's as their source, so the host program can bind only the peer's
        address.  The UDP kind, whose frames the kernel builds, gets ``mac`` back.

        Raises:
            pydblp.transport.TransportError: no route to ``addr``, or one out of another
                interface (one line naming it).
        """
        if self.xsk is None or mac is None:
            return mac
        from pydblp.transport import addresses

        s = self.xsk.sockets[0]
        dst = ipaddress.ip_address(addr)
        return mac if addresses.next_hop(s.ifindex, s.ifname, dst, s.netns, local=True) == dst else None

    def describe(self) -> str:
        """One line for a log: the kind, and for AF_XDP the interface, queues, copy or zero-copy
        mode and UMEM size (``xsk on eth0 queues 0-3: copy mode, 40.3 MiB UMEM``)."""
        if self.xsk is None:
            return f"{self.kind} on {self.transport.ifname or 'any interface'} port {self.endpoint.port}"
        generic = getattr(self.host, "mode", None) == net.Mode.SKB  # (known where attached here)
        return (f"{self.kind} on {self.xsk.describe()}" + (" (port steered)" if self._steered else "")
                + (", generic XDP" if generic else ""))

    def close(self) -> None:
        """Close the transport, undo the job registration and detach what was attached.  Idempotent."""
        if self.transport is not None:
            self.transport.close()
            self.transport = None
            self.xsk = None
        if self._steered is not None:
            steered, self._steered = self._steered, None
            try:
                from pydblp.transport.xsk_queues import unsteer

                unsteer(*steered)
            except OSError as e:
                log.warning("ntuple rule %d on %s left in place: %s (ethtool -N %s delete %d)",
                            steered[1], steered[0], e, steered[0], steered[1])
        if self.host is not None:
            host, self.host = self.host, None
            try:
                _unregister(host, self._job, self._prior_job, self._owns_host)
            finally:
                host.close()
                if self._claim is not None:
                    self._claim.release()
                    self._claim = None

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
                   port: int = wire.DEFAULT_PORT, queue: int | None = None, queues="all",
                   steer: int | None = None, addr: str | None = None,
                   job: int | None = None, rank: int = 0, world: int = 1, rate: float = 0,
                   spin: float = 0.0, max_payload: int | None = None, key: bytes | None = None,
                   epoch: int | None = None, **kw) -> DataPlane:
    """Open the data plane of kind ``kind`` on ``iface``.

    Args:
        kind: ``udp``, ``xsk`` or ``xsk-ktx`` (module docstring).
        iface: the data-plane interface; None (``udp`` only): any, on loopback.
        netns: the interface's network namespace.
        port: UDP port to receive on (``udp``: 0 picks a free one).
        queue: one receive queue to bind (AF_XDP kinds), as ``queues=[queue]``;
            ``udp``: recorded in the endpoint only.
        queues: the AF_XDP kinds' receive queues: ``"all"`` (every queue of
            ``iface``, the default) or a list (``[0, 2]``); one socket each.
        steer: AF_XDP kinds: steer the job's UDP port to this queue with an
            ntuple filter (the driver must have them; veth has not) and bind
            it alone; the rule goes with :meth:`DataPlane.close`.
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
        ValueError: a bad kind or argument, a queue the interface lacks (before anything is opened).
        pydblp.net.NetError, pydblp.host.HostError, pydblp.transport.TransportError:
            the interface, the host program or the transport cannot be set up;
            nothing this call opened stays open.
    """
    check_kind(kind, iface)
    if queue is not None and (not isinstance(queues, str) or queues != "all"):
        raise ValueError(f"queue={queue} and queues={queues!r}: give one of them")
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

        if steer is not None:
            raise ValueError("steer= is for the AF_XDP kinds (xsk, xsk-ktx)")
        queue = queue or 0
        t = _keyed(UdpTransport(iface, netns=netns, queue=queue, port=port, spin=spin, **kw), key, epoch)
        return DataPlane(kind, t, Endpoint(addr, t.port, mac, queue, mtu, (queue,)))

    from pydblp import host as hostprog
    from pydblp.transport import xsk_queues
    from pydblp.transport.xsk_ring import frame_size_for

    if queue is not None:
        queues = [queue]
    if steer is not None:
        if isinstance(queues, str):
            queues = [steer]
        elif steer not in queues:
            raise ValueError(f"steer={steer} is not among queues={list(queues)}: steer to a queue you bind")
    queues = xsk_queues.check_queues(queues, xsk_queues.rx_queue_count(iface, netns), iface)

    try:
        maps, owns = hostprog.open_pinned(iface, netns), False
        if maps.port != port:
            log.warning("the host program pinned on %s filters UDP port %d, not %d: AF_XDP receives nothing "
                        "until `dblp config` or the port agree", iface, maps.port, port)
    except hostprog.HostError:
        try:
            maps, owns = hostprog.HostProgram(iface, netns=netns, port=port, generic=True), True
        except hostprog.HostError:
            current = hostprog.attached_program(iface, netns)
            if current and current["name"] == hostprog.PROG_NAME:  # another data plane's, not pinned
                raise hostprog.HostError(f"{iface} already has a data plane: {hostprog.ONE_PER_IFACE}") from None
            raise
    prior = None
    registered = False
    steered = claim = None
    try:
        if not owns and job is not None:
            claim = hostprog.JobClaim(iface, netns, job)
        if steer is not None:
            steered = (iface, xsk_queues.steer_port(iface, port, steer, netns), netns)
        prior = None if claim is not None and claim.stale else maps.jobs().get(job)
        maps.register_job(job, world, rank, hostprog.JobTransport.XSK)
        registered = True
        if max_payload is not None:
            kw.setdefault("frame_size", frame_size_for(max_payload + (wire.TAG_LEN if key else 0)))
        xq = xsk_queues.XskQueues(iface, netns=netns, queues=queues, port=port, host=maps, spin=spin,
                                  rate=rate if kind == "xsk" else 0, tx="xsk" if kind == "xsk" else "kernel", **kw)
        t = _keyed(xq, key, epoch)
    except BaseException:
        try:
            if steered is not None:
                xsk_queues.unsteer(*steered)
            if registered:
                _unregister(maps, job, prior, owns)
        finally:
            if claim is not None:
                claim.release()
            maps.close()
        raise
    return DataPlane(kind, t, Endpoint(addr, t.port, mac, xq.queue, mtu, xq.queues), maps, job, prior, owns,
                     queues=xq, steered=steered, claim=claim)


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
