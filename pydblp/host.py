"""The host XDP program (``bpf/dblp_host.bpf.c``): attach, configure, observe.

:class:`HostProgram` compiles the program (about 2 s), attaches it to one
interface and owns that attachment: :meth:`HostProgram.close` (also run by
``with``, garbage collection and interpreter exit) detaches it with the
mode flags used to attach and removes its pins.  :class:`HostMaps` is the
map API alone; :func:`open_pinned` gives one for a program loaded by another
process (``dblp load``), without compiling.

The structs below mirror ``bpf/dblp.h``; ``tests/unit/test_header_agreement.py``
checks them against the C side.
"""

from __future__ import annotations

import enum
import errno
import fcntl
import logging
import mmap
import os
import struct
import weakref
from pathlib import Path

from pydblp import bpf, net, wire
from pydblp._libc import unlink_pruned
from pydblp.net import Mode

log = logging.getLogger(__name__)

PROG_NAME = "dblp_host"
MAX_QUEUES = 64
MAX_JOBS = 256
SHED_ENTRIES = 65536
PRESSURE_MAX = 1000
MAX_PEERS = 4096
CLAIM_DIR = Path(os.environ.get("DBLP_JOBS_DIR", "/run/dblp/jobs"))  # job claims (JobClaim)
# an AF_XDP data plane holds its interface's queues: what to do where a second one asks for them
ONE_PER_IFACE = ("the AF_XDP kinds take one rank per interface: give each rank on a host its own "
                 "(DBLP_IFACE=eth1,eth2,... picks one per local rank), or use transport udp")

CNT_PASS = 0
CNT_DBLP_PASS = 1
CNT_REDIRECT = 2
CNT_NOSOCK = 3
CNT_DROP_BASE = 16
CNT_SHED_BASE = 32
CNT_MAX = 40

# (member, struct code) of each map struct in dblp.h, in order
STRUCTS = {
    "dblp_job": (("world_size", "H"), ("rank", "H"), ("transport", "B"), ("pad", "3x")),
    "dblp_msg_key": (("job", "I"), ("round", "I"), ("tensor", "H"), ("src", "H"), ("allgather", "H"), ("pad", "H")),
    "dblp_host_cfg": (("port", "H"), ("classify", "H"), ("rate_pps", "I"), ("shed_at", "8I"),
                      ("dscp_prio", "64B")),
    "dblp_peer_key": (("job", "I"), ("rank", "H"), ("pad", "H")),
    "dblp_peer": (("ip", "16s"), ("mac", "6s"), ("family", "B"), ("has_mac", "B")),
}
JOB, MSG_KEY, HOST_CFG, PEER_KEY, PEER = (struct.Struct("=" + "".join(code for _, code in STRUCTS[name]))
                                          for name in ("dblp_job", "dblp_msg_key", "dblp_host_cfg",
                                                       "dblp_peer_key", "dblp_peer"))
MAPS = ("config", "pressure", "jobs", "xsks", "shed", "counters", "rate", "ctrl_seen", "peers")

NDSCP = 64

# Default pressure at which each priority is shed: prio 7 first, prio 0 never.
DEFAULT_SHED_AT = (0, 900, 800, 700, 600, 500, 400, 300)


class JobTransport(enum.IntEnum):
    """How the host program delivers a registered job's packets (``DBLP_JOB_TRANSPORT_*``)."""

    XSK = 0  # redirect to the AF_XDP socket of the rx queue
    UDP = 1  # XDP_PASS to the kernel UDP stack


class Classify(enum.IntEnum):
    """Where a shedding decision takes a packet's priority from (``DBLP_CLASSIFY_*``)."""

    HEADER = 0  # the DBLP header's prio
    DSCP = 1    # the IP header's DSCP, through pydblp.dscp.prio_table


CLASSIFY = tuple(c.name.lower() for c in Classify)


class HostError(net.NetError):
    """Loading or talking to the host program failed; the message says how to fix it."""


def check_job(job: int, world_size: int, rank: int) -> None:
    """Raise HostError, naming the range, for a job id, world size or rank a job cannot have
    (what :meth:`HostMaps.register_job` checks; the CLI asks before it looks anything up)."""
    if not 0 < job < 2**32:
        raise HostError(f"job id {job} must be in 1..2^32-1")
    if not 0 < world_size <= 0xFFFF:
        raise HostError(f"world size {world_size} must be in 1..65535")
    if not 0 <= rank < world_size:
        raise HostError(f"rank {rank} must be in 0..{world_size - 1} (world size {world_size})")


def check_config(port: int | None = None, rate_pps: int | None = None, shed_at=None) -> None:
    """Raise HostError, naming the range, for values :meth:`HostMaps.configure` cannot take
    (None: not given)."""
    if port is not None and not 0 < port < 65536:
        raise HostError(f"port {port} out of range 1..65535")
    if rate_pps is not None and not 0 <= rate_pps < 2**32:
        raise HostError(f"rate_pps {rate_pps} out of range 0..{2**32 - 1} (0: off)")
    if rate_pps is not None and 0 < rate_pps < 1000:
        raise HostError(f"rate_pps {rate_pps}: the estimate counts packets per 1 ms window; use 0 (off) "
                        f"or 1000 and more")
    if shed_at is not None:
        n = wire.MAX_PRIO + 1
        if len(shed_at) != n or not all(0 <= x <= PRESSURE_MAX for x in shed_at):
            raise HostError(f"shed_at needs {n} levels in 0..{PRESSURE_MAX}, e.g. "
                            f"{','.join(map(str, DEFAULT_SHED_AT))}; got {','.join(map(str, shed_at))}")
        if shed_at[0]:
            raise HostError(f"shed_at's first level is priority 0's, which is never shed: give 0, got {shed_at[0]}")


class HostMaps:
    """Configuration and counters of one attached host program, through its maps."""

    def __init__(self, maps: dict[str, bpf.Map], ifname: str, netns: str | None):
        self.maps = maps
        self.ifname = ifname
        self.netns = netns

    # -- configuration --
    def _cfg(self) -> list:
        return list(HOST_CFG.unpack(self.maps["config"].lookup(b"\0" * 4)))

    def _set_cfg(self, vals: list) -> None:
        self.maps["config"].update(b"\0" * 4, HOST_CFG.pack(*vals))

    @property
    def port(self) -> int:
        return self._cfg()[0]

    def configure(self, port: int | None = None, rate_pps: int | None = None,
                  shed_at: tuple[int, ...] | None = None, classify: str | None = None,
                  dscp="default") -> None:
        """Set the DBLP UDP port, the in-kernel rate estimate (0 = off) and per-prio shed levels.

        ``shed_at[p]`` is the pressure (0..1000) from which prio ``p`` is shed;
        0 means never; prio 0's must be 0 (it is never shed).  HostError for a value out of
        range (:func:`check_config`).  ``classify``:
        ``"header"`` takes a packet's priority from its DBLP header, ``"dscp"``
        from its IP header's DSCP through ``dscp`` (a map as ``Config.dscp``:
        :func:`pydblp.dscp.prio_table`); None leaves it as it is.
        """
        check_config(port, rate_pps, shed_at)
        c = self._cfg()
        if port is not None:
            c[0] = port
        if rate_pps is not None:
            c[2] = int(rate_pps)
        if shed_at is not None:
            c[3:11] = [int(x) for x in shed_at]
        if classify is not None:
            if classify not in CLASSIFY:
                raise HostError(f"classify {classify!r}: use header or dscp")
            from pydblp import dscp as dscp_mod

            c[1] = Classify[classify.upper()]
            c[11:] = dscp_mod.prio_table(dscp).tolist()
        self._set_cfg(c)

    @property
    def pressure(self) -> int:
        return struct.unpack("=I", self.maps["pressure"].lookup(b"\0" * 4))[0]

    def set_pressure(self, level: int) -> None:
        """Write the pressure level (0..1000) that shedding compares against (a map of its own:
        the receiver writes it often, and never over a :meth:`configure` made meanwhile)."""
        self.maps["pressure"].update(b"\0" * 4, struct.pack("=I", max(0, min(PRESSURE_MAX, int(level)))))

    # -- jobs --
    def register_job(self, job: int, world_size: int, rank: int,
                     transport: JobTransport | str = JobTransport.XSK) -> None:
        """Admit ``job``: packets must have src/dst < world_size and dst == rank.

        Args:
            job: the job id (1..2^32-1).
            world_size, rank: the job's size and this host's rank in it.
            transport: how its packets are delivered (a :class:`JobTransport` or its name).

        Raises :class:`HostError` on a bad argument.
        """
        if isinstance(transport, str):
            try:
                transport = JobTransport[transport.upper()]
            except KeyError:
                raise HostError(f"transport {transport!r}: use xsk or udp") from None
        check_job(job, world_size, rank)
        self.maps["jobs"].update(struct.pack("=I", job), JOB.pack(world_size, rank, transport))

    def unregister_job(self, job: int) -> bool:
        """Remove ``job`` and its ranks' address bindings; False if it was not registered."""
        for k in [k for k in self.maps["peers"].keys() if PEER_KEY.unpack(k)[0] == job]:
            self.maps["peers"].delete(k)
        return self.maps["jobs"].delete(struct.pack("=I", job))

    def bind_peer(self, job: int, rank: int, ip=None, mac: str | bytes | None = None) -> None:
        """Anti-spoofing: admit packets of ``job`` claiming src ``rank`` only from source ``ip``
        (IPv4 or IPv6; None: any) and, if given, Ethernet source ``mac``; others are dropped and
        counted as ``spoof_ip`` / ``spoof_mac``.  A rank without a binding is not checked.

        Args:
            job: a job id (registered or not yet: the binding waits for it).
            rank: 0..65535, the src rank packets claim.
            ip: an address string or ``ipaddress`` object.
            mac: "aa:bb:cc:dd:ee:ff" or 6 bytes.

        Raises:
            HostError: an argument out of range or unparsable (one line, with the fix); the map full.
        """
        key, value = peer_entry(job, rank, ip, mac)
        try:
            self.maps["peers"].update(key, value)
        except OSError as e:
            raise HostError(f"cannot bind rank {rank} of job {job}: {e.strerror or e} "
                            f"(at most {MAX_PEERS} bindings; `dblp job del` unused jobs)") from None

    def set_job(self, job: int, world_size: int, rank: int, transport: JobTransport | str,
                peers=()) -> None:
        """Admit ``job`` (:meth:`register_job`) and bind ``peers`` ((rank, ip, mac) each,
        :meth:`bind_peer`), all or nothing: every binding is checked before a map is touched,
        bindings of ranks the new ``world_size`` no longer has are removed, and if a map
        refuses an entry the job's previous entry and bindings come back.

        Raises:
            HostError: a bad argument (nothing changed), or a map full (restored).
        """
        entries = [peer_entry(job, r, ip, mac) for r, ip, mac in peers]
        for r, _, _ in peers:
            if r >= world_size:
                raise HostError(f"peer rank {r}: use 0..{world_size - 1} (world {world_size})")
        jkey = struct.pack("=I", job)
        old_job = self.maps["jobs"].lookup(jkey)
        old_peers = {k: v for k, v in self.maps["peers"].items() if PEER_KEY.unpack(k)[0] == job}
        try:
            self.register_job(job, world_size, rank, transport)
            for k in old_peers:
                if PEER_KEY.unpack(k)[1] >= world_size:
                    self.maps["peers"].delete(k)
            for k, v in entries:
                self.maps["peers"].update(k, v)
        except (OSError, HostError) as e:
            for k in [k for k in self.maps["peers"].keys() if PEER_KEY.unpack(k)[0] == job]:
                self.maps["peers"].delete(k)
            for k, v in old_peers.items():
                self.maps["peers"].update(k, v)
            if old_job is None:
                self.maps["jobs"].delete(jkey)
            else:
                self.maps["jobs"].update(jkey, old_job)
            if isinstance(e, HostError):
                raise
            raise HostError(f"cannot admit job {job}: {e.strerror or e} (at most {MAX_PEERS} bindings; "
                            f"`dblp job del` unused jobs); nothing changed") from None

    def unbind_peer(self, job: int, rank: int) -> bool:
        return self.maps["peers"].delete(PEER_KEY.pack(job, rank, 0))

    def peers(self) -> dict[tuple[int, int], dict]:
        """(job, rank) -> {"ip": address or None, "mac": "aa:bb:..." or None}."""
        import ipaddress

        out = {}
        for k, v in self.maps["peers"].items():
            job, rank, _ = PEER_KEY.unpack(k)
            ip, mac, family, has_mac = PEER.unpack(v)
            out[(job, rank)] = {"ip": ipaddress.IPv4Address(ip[:4]) if family == 4 else
                                ipaddress.IPv6Address(ip) if family == 6 else None,
                                "mac": mac.hex(":") if has_mac else None}
        return out

    def jobs(self) -> dict[int, dict]:
        out = {}
        for k, v in self.maps["jobs"].items():
            ws, rank, tr = JOB.unpack(v)
            out[struct.unpack("=I", k)[0]] = {"world_size": ws, "rank": rank,
                                             "transport": JobTransport(tr).name.lower()}
        return out

    # -- AF_XDP sockets --
    def control_seen(self) -> mmap.mmap:
        """A read-only mapping whose first 8 bytes (a native-endian u64) count the valid DBLP
        control packets (any kind but DATA) of AF_XDP jobs this program let through (redirected,
        or passed where the queue has no socket): a receive that lingers for data stops once the
        count moves.  The caller closes it."""
        return mmap.mmap(self.maps["ctrl_seen"].fd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ)

    def xsk_insert(self, queue: int, fd: int) -> None:
        """Steer the rx queue's valid DBLP packets to socket ``fd`` (bind and fill it first)."""
        if not 0 <= queue < MAX_QUEUES:
            raise HostError(f"queue {queue} out of range 0..{MAX_QUEUES - 1}")
        self.maps["xsks"].update(struct.pack("=I", queue), struct.pack("=I", fd))

    def xsk_remove(self, queue: int) -> bool:
        return self.maps["xsks"].delete(struct.pack("=I", queue))

    # -- observation --
    def counters(self) -> dict:
        """Totals over CPUs: pass, dblp_pass, redirect, nosock, drop{reason}, shed[prio]
        (drop reasons as :class:`pydblp.wire.Reason`, lower case: ``spoof_ip``, ``spoof_mac``
        are the anti-spoofing drops)."""
        raw = []
        for i in range(CNT_MAX):
            per_cpu = self.maps["counters"].lookup(struct.pack("=I", i))
            raw.append(sum(struct.unpack("=Q", v)[0] for v in per_cpu))
        return {
            "pass": raw[CNT_PASS],
            "dblp_pass": raw[CNT_DBLP_PASS],
            "redirect": raw[CNT_REDIRECT],
            "nosock": raw[CNT_NOSOCK],
            "drop": {r.name.lower(): raw[CNT_DROP_BASE + r] for r in wire.Reason if r},
            "shed": raw[CNT_SHED_BASE: CNT_SHED_BASE + wire.MAX_PRIO + 1],
        }

    def shed_count(self, job: int, round: int, tensor: int, src: int, allgather: bool = False) -> int:
        """Packets of one message shed so far (0 when the LRU has no entry).

        Args:
            job, round, tensor, src: the message's header fields.
            allgather: the all-gather message (DATA with ``Flag.ALLGATHER``) rather than the
                reduce-scatter one; each has its own budget.
        """
        v = self.maps["shed"].lookup(MSG_KEY.pack(job, round, tensor, src, int(allgather), 0))
        return struct.unpack("=Q", v)[0] if v else 0

    def shed_counts(self) -> dict[tuple[int, int, int, int, bool], int]:
        """Every message's shed count, by ``(job, round, tensor, src, allgather)``."""
        out = {}
        for k, v in self.maps["shed"].items():
            job, rnd, tensor, src, allgather, _ = MSG_KEY.unpack(k)
            out[(job, rnd, tensor, src, bool(allgather))] = struct.unpack("=Q", v)[0]
        return out

    def close(self) -> None:
        for m in self.maps.values():
            m.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _mac_bytes(mac, rank: int) -> bytes:
    if isinstance(mac, (bytes, bytearray)) and len(mac) == 6:
        return bytes(mac)
    try:
        raw = bytes.fromhex(str(mac).replace(":", "").replace("-", ""))
    except ValueError:
        raw = b""
    if len(raw) != 6:
        raise HostError(f"rank {rank}: {mac!r} is not a MAC address (e.g. 02:00:00:00:00:01)")
    return raw


def pin_dir(ifname: str, netns: str | None) -> Path:
    """Where pydblp pins the maps of one host program: /sys/fs/bpf/dblp/host/<netns>/<ifname>.

    bpffs is one for the whole host, so ``netns`` None (this thread's namespace) is named by
    what it is: ``-`` in the root namespace, and a named namespace's name when this thread is
    inside one (``ip netns exec``, ``nsenter``): a process there finds the pins one outside made
    for that namespace, and never those of the root's ``eth0`` or another namespace's (one
    without a name shares ``-`` with the root's).
    """
    return bpf.PIN_ROOT / "host" / (netns or net.current_netns() or "-") / ifname


def open_pinned(ifname: str, netns: str | None = None) -> HostMaps:
    """Maps of a program that ``dblp load`` (or a pinning HostProgram) attached."""
    d = pin_dir(ifname, netns)
    if not (d / "config").exists():
        if netns is not None and not net.netns_exists(netns):
            raise HostError(f"network namespace {netns!r} does not exist (see `ip netns list`)")
        where = f" --netns {netns}" if netns else ""
        raise HostError(f"pydblp is not loaded on {ifname}{where}: run `dblp load {ifname}{where}`")
    missing = [name for name in MAPS if not (d / name).exists()]
    if missing:  # pins of a program from another pydblp version, still attached
        where = f" --netns {netns}" if netns else ""
        raise HostError(f"the program pinned on {ifname} lacks map(s) {', '.join(missing)} (another pydblp "
                        f"version): `dblp unload {ifname}{where}` and `dblp load {ifname}{where}` again")
    maps = {}
    try:
        for name in MAPS:
            maps[name] = bpf.Map.pinned(d / name)
    except FileNotFoundError:  # a pin gone meanwhile (`dblp unload` racing this)
        for m in maps.values():
            m.close()
        where = f" --netns {netns}" if netns else ""
        raise HostError(f"pydblp was unloaded from {ifname} meanwhile: run `dblp load {ifname}{where}`") from None
    except BaseException:
        for m in maps.values():
            m.close()
        raise
    return HostMaps(maps, ifname, netns)


def open_attached(prog_id: int, ifname: str, netns: str | None = None) -> HostMaps | None:
    """Maps of the host program ``prog_id`` read through the program itself: what a data plane
    attached without pins (the torch integration, the experiment) shows ``dblp status``.  None if
    the program is gone or is not this version's."""
    maps = bpf.prog_maps(prog_id)
    if any(name not in maps for name in MAPS):
        for m in maps.values():
            m.close()
        return None
    for name in set(maps) - set(MAPS):
        maps.pop(name).close()
    return HostMaps(maps, ifname, netns)


def attached_program(ifname: str, netns: str | None = None) -> dict | None:
    """The XDP program on ``ifname`` with its name and mode, or None."""
    found = net.xdp_query(ifname, netns)
    if not found:
        return None
    info = bpf.prog_info_by_id(found["prog_id"]) or {"name": "?"}
    return {**found, "name": info["name"]}


class HostProgram(HostMaps):
    """Compile and attach the host program to ``ifname`` (in ``netns``), and own it.

    ``mode`` is native by default (veth supports it); ``skb`` on request.  With
    ``generic`` a driver without native XDP gets the program in generic (skb)
    mode instead, logged (a data plane's choice; ``dblp load`` says so and stops).
    An XDP program pydblp did not attach is never replaced unless
    ``force``.  With ``pin`` the maps and program are pinned under
    ``/sys/fs/bpf/dblp/host/<netns>/<ifname>`` so other processes (the CLI)
    can find them; with ``keep`` the attachment and pins outlive this object
    (``dblp load``); otherwise :meth:`close` removes both.
    """

    def __init__(self, ifname: str, netns: str | None = None, mode: Mode | str = Mode.NATIVE,
                 port: int = wire.DEFAULT_PORT, force: bool = False, pin: bool = False,
                 keep: bool = False, shed_at: tuple[int, ...] = DEFAULT_SHED_AT, generic: bool = False):
        mode = Mode(mode)
        current = attached_program(ifname, netns)
        if current and not force:
            where = f" --netns {netns}" if netns else ""
            if current["name"] == PROG_NAME:
                raise HostError(f"pydblp is already loaded on {ifname}; `dblp unload {ifname}{where}` first, or --force")
            raise HostError(f"{ifname} has XDP program {current['name']!r} (id {current['prog_id']}) "
                            f"that pydblp did not attach; detach it or use --force to replace it")
        if pin:
            bpf.require_bpffs()
        self._bpf, fn = bpf.compile_xdp("dblp_host.bpf.c", PROG_NAME)
        self.prog_fd = fn.fd
        self.frags = fn.frags  # multi-buffer: attaches natively at any MTU, sees jumbo frames whole
        self.prog_id = bpf.prog_info(fn.fd)["id"]
        maps = {name: bpf.Map(self._bpf[name.encode()].map_fd, owned=False) for name in MAPS}
        super().__init__(maps, ifname, netns)
        self.mode = mode
        self.pins, self.link = None, None
        attached = False
        try:  # (anything that fails, or an interrupt, releases what came before it)
            self.configure(port=port, rate_pps=0, shed_at=shed_at)
            if current and force:
                net.xdp_detach(ifname, current["mode"], netns)
            try:
                self._attach(keep)
            except net.NetError as e:
                if not (generic and self.mode == Mode.NATIVE and e.errno == errno.EOPNOTSUPP):
                    raise
                log.warning("%s: the driver has no native XDP; the host program runs in generic (skb) mode, "
                            "each frame copied into an skb before it (slower)", ifname)
                self.mode = Mode.SKB
                self._attach(keep)
            attached = True
            if pin:
                self.pins = pin_dir(ifname, netns)
                if self.pins.exists():
                    bpf.unpin(self.pins)  # stale pins of a crashed load
                self.pins.mkdir(parents=True)
                for name, m in maps.items():
                    bpf.obj_pin(m.fd, self.pins / name)
                bpf.obj_pin(self.prog_fd, self.pins / "prog")
        except BaseException:
            _release(ifname, netns, mode, self.prog_id if attached else None, self.link, self.pins, self._bpf)
            raise
        self._finalizer = None if keep else weakref.finalize(
            self, _release, ifname, netns, mode, self.prog_id, self.link, self.pins, self._bpf)

    def _attach(self, keep: bool) -> None:
        """Attach the program in ``self.mode``.  Not kept: a BPF link owns the attachment, so the
        kernel detaches it when this process dies, SIGKILL and SIGTERM included (a netlink
        attachment would outlive it and block the next run).  Kept (`dblp load`): netlink, which
        outlives the CLI."""
        self.link = None if keep else net.xdp_link(self.ifname, self.prog_fd, self.mode, self.netns)
        if self.link is None:
            net.xdp_attach(self.ifname, self.prog_fd, self.mode, self.netns, replace=False)

    def close(self) -> None:
        """Detach (if still ours) and unpin.  Idempotent."""
        if self._finalizer is not None:
            self._finalizer()
        else:
            self._bpf.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _release(ifname, netns, mode, prog_id, link, pins, bpf_obj) -> None:
    """Detach program ``prog_id`` (None: not attached) from ``ifname``: close its ``link``, or
    detach it through netlink if it is still the one there; remove ``pins``; free the program."""
    try:
        if link is not None:
            os.close(link)
        elif prog_id is not None:
            found = net.xdp_query(ifname, netns) if (netns is None or net.netns_exists(netns)) else None
            if found and found["prog_id"] == prog_id:
                net.xdp_detach(ifname, mode, netns)
    except net.NetError:
        pass  # interface or namespace already gone: nothing attached any more
    finally:
        if pins is not None:
            bpf.unpin(pins)
        bpf_obj.cleanup()


def unload(ifname: str, netns: str | None = None) -> bool:
    """Detach pydblp's host program from ``ifname`` and remove its pins (after a crash too, and
    after its namespace went: its pins are all that is left)."""
    if netns is not None and not net.netns_exists(netns):
        pins = pin_dir(ifname, netns)
        had_pins = pins.exists()
        bpf.unpin(pins)
        _forget_claims(ifname, netns)
        return had_pins
    current = attached_program(ifname, netns)
    detached = False
    if current and current["name"] == PROG_NAME:
        net.xdp_detach(ifname, current["mode"], netns)
        detached = True
    elif current:
        raise HostError(f"{ifname} has XDP program {current['name']!r} that pydblp did not attach; not touching it")
    pins = pin_dir(ifname, netns)
    had_pins = pins.exists()
    bpf.unpin(pins)
    _forget_claims(ifname, netns)
    return detached or had_pins


def loaded() -> list[dict]:
    """Every host program pydblp attached: in the root netns and all named ones,
    plus pin directories whose attachment is gone (``stale``)."""
    out = []
    seen = set()
    for ns in [None, *net.netns_list()]:
        try:
            links = net.links(ns)
        except Exception:
            continue
        for link in links:
            pid = link["xdp_prog_id"]
            if not pid:
                continue
            info = bpf.prog_info_by_id(pid)
            if info and info["name"] == PROG_NAME:
                mode = Mode.SKB if link["xdp_attached"] in ("xdpgeneric", "skb") else Mode.NATIVE
                out.append({"netns": ns, "ifname": link["ifname"], "mode": mode, "prog_id": pid,
                            "pinned": pin_dir(link["ifname"], ns).exists()})
                seen.add((ns, link["ifname"]))
    root = bpf.PIN_ROOT / "host"
    if root.exists():
        for nsdir in root.iterdir():
            for ifdir in nsdir.iterdir():
                ns = None if nsdir.name == "-" else nsdir.name
                if (ns, ifdir.name) not in seen:
                    out.append({"netns": ns, "ifname": ifdir.name, "mode": None, "prog_id": None,
                                "pinned": True, "stale": True})
    return out


def peer_entry(job: int, rank: int, ip=None, mac: str | bytes | None = None) -> tuple[bytes, bytes]:
    """The ``peers`` map's key and value binding ``rank`` of ``job`` to ``ip`` and ``mac``
    (:meth:`HostMaps.bind_peer`'s arguments); HostError in one line for a bad one."""
    import ipaddress

    if not 0 < job < 2**32:
        raise HostError(f"job id {job} must be in 1..2^32-1")
    if not 0 <= rank <= 0xFFFF:
        raise HostError(f"rank {rank} must be in 0..65535")
    if ip is None and mac is None:
        raise HostError(f"rank {rank}: give its IP address, MAC address or both")
    try:
        addr = None if ip is None else ipaddress.ip_address(ip)
    except ValueError:
        raise HostError(f"rank {rank}: {ip!r} is not an IP address (e.g. 198.18.0.2 or 2001:db8::2)") from None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped  # the wire carries an IPv4 header for it
    raw_mac = b"\0" * 6 if mac is None else _mac_bytes(mac, rank)
    family = 0 if addr is None else addr.version
    packed = b"" if addr is None else addr.packed
    return (PEER_KEY.pack(job, rank, 0),
            PEER.pack(packed.ljust(16, b"\0"), raw_mac, family, int(mac is not None)))


class JobClaim:
    """This process's hold on ``job`` of the program pinned on ``ifname`` (in ``netns``): an
    exclusive lock on ``CLAIM_DIR/<netns or ->/<ifname>/<job>``, a file holding the holder's pid.

    The kernel drops the lock when the holder ends, however it ends. :meth:`release` removes
    the file, so a file found unlocked was left by a holder that died (:attr:`stale`): the
    registration it made is not someone else's to put back.

    Raises:
        HostError: another open data plane (this process's or another's) holds the job here.
    """

    def __init__(self, ifname: str, netns: str | None, job: int):
        self.dir = CLAIM_DIR / (netns or "-") / ifname
        self.path = self.dir / str(job)
        self._fd = None
        try:
            self._fd = self._lock(ifname, netns, job)
            self.stale = bool(os.pread(self._fd, 32, 0).strip())
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, str(os.getpid()).encode(), 0)
        except OSError as e:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            raise HostError(f"cannot claim job {job} on {ifname}: {self.path}: {e.strerror or e} "
                            f"(run as root, or set DBLP_JOBS_DIR to a writable directory)") from None

    def _lock(self, ifname: str, netns: str | None, job: int) -> int:
        while True:  # (until the file locked is the one at the path: a release may unlink it meanwhile)
            self.dir.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    return fd
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                where = f" --netns {netns}" if netns else ""
                raise HostError(f"job {job} is open on {ifname}{where} by pid {holder}: {ONE_PER_IFACE}") from None
            except FileNotFoundError:
                pass
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def release(self) -> None:
        """Remove the file (and the directories it leaves empty), then drop the lock; idempotent."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            unlink_pruned(self.path, 2)
        finally:
            os.close(fd)


def _forget_claims(ifname: str, netns: str | None) -> None:
    """Remove the job claims on ``ifname``'s program that no live data plane holds (a killed
    one's): its program is gone, and with it what they claimed."""
    d = CLAIM_DIR / (netns or "-") / ifname
    try:
        claims = list(d.iterdir())
    except OSError:
        return  # (none, or the last holder out removed the directory meanwhile)
    for f in claims:
        try:
            fd = os.open(f, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # (held: a live data plane's)
        else:
            unlink_pruned(f, 2)
        finally:
            os.close(fd)
