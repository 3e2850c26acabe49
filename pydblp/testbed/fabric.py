"""The testbed's switch program (``bpf/fabric.bpf.c``) from userspace.

:func:`load` compiles the program once per testbed, pins its maps under
``/sys/fs/bpf/dblp/testbed/<name>/`` and attaches it to the switch ports;
:class:`Fabric` opens those pins (no compile), so ``dblp fault`` in another
process changes faults at run time.

Faults are per *egress* port: the switch-side veth ``wK`` carries frames to
worker K, and a fault set on ``wK`` acts on frames delivered to worker K.  The
program runs at the ingress of the port a frame arrives on and finds the
egress port from the destination MAC (the ``fdb`` map, filled here).  DBLP
data to every rank (``wire.DST_ALL``, a broadcast all-gather) is copied to
every other port through the devmap ``bcast`` (filled here), whose egress
program applies each port's faults to its copy.

The structs below mirror ``bpf/fabric.h``; tests/linux/test_fabric.py checks
them against the compiled object's types.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from pathlib import Path

from pydblp import bpf, net, units

SOURCE = "fabric.bpf.c"
P_ONE = 1 << 32
NPRIO = 8
F_GE = 1 << 0
F_QUEUE = 1 << 1
F_DSCP = 1 << 2
F_DELAY = 1 << 3
F_MARK_DROP = 1 << 4
NDSCP = 64

# counter causes (bpf/fabric.h FABRIC_C_*)
C_PASS, C_LOSS, C_GE, C_BURST, C_TAIL, C_BOUND, C_FLOOD, C_MARK, C_EARLY = 0, 1, 2, 3, 4, 5, 6, 7, 8
C_MARK_DROP = C_EARLY + NPRIO
NCAUSES = 17
CAUSES = {C_PASS: "pass", C_LOSS: "loss", C_GE: "ge", C_BURST: "burst", C_TAIL: "tail",
          C_BOUND: "bound", C_FLOOD: "flood", C_MARK: "mark", C_MARK_DROP: "mark_drop"}
CAUSES.update({C_EARLY + p: f"early{p}" for p in range(NPRIO)})
DROP_CAUSES = ("loss", "ge", "burst", "tail", "mark_drop") + tuple(f"early{p}" for p in range(NPRIO))

# struct layouts (native byte order, as the kernel sees them)
CFG = struct.Struct("=11QII8I64BII")  # struct fabric_cfg
CFG_FIELDS = ("loss", "ge_p", "ge_r", "ge_loss_good", "ge_loss_bad", "burst_ratio",
              "burst_start_ns", "burst_dur_ns", "burst_period_ns", "burst_count", "rate",
              "buffer", "flags", "thresh", "dscp_prio", "mark", "pad")
_SCALARS = CFG_FIELDS[:CFG_FIELDS.index("thresh")]  # the fields before the arrays
STATE = struct.Struct("=IIQQQ")      # struct fabric_state (lock, ge_bad, backlog, last_ns, peak)
CKEY = struct.Struct("=II")          # struct fabric_ckey
CVAL = struct.Struct("=QQ")          # struct fabric_cval
MSG = struct.Struct("=IIHHHHHH")     # struct fabric_msg (job..dst as on the wire: big-endian bytes)
DEVMAP_VAL = struct.Struct("=Ii")    # struct bpf_devmap_val: ifindex, egress program fd
MAC = struct.Struct("=6sH")          # struct fabric_mac
U32 = struct.Struct("=I")
MAPS = ("port_cfg", "port_state", "fdb", "counters", "msgs")


class FabricError(net.NetError):
    """A fault or fabric setting that cannot be applied; the message says why."""


def prob(p: float, what: str = "probability") -> int:
    """A probability in [0, 1] as the program's fixed point."""
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise FabricError(f"{what} must be within [0, 1], got {p}")
    return round(p * P_ONE)


@dataclass
class PortConfig:
    """One egress port's faults (the Python face of ``struct fabric_cfg``)."""

    loss: int = 0
    ge_p: int = 0
    ge_r: int = 0
    ge_loss_good: int = 0
    ge_loss_bad: int = 0
    burst_ratio: int = 0
    burst_start_ns: int = 0
    burst_dur_ns: int = 0
    burst_period_ns: int = 0
    burst_count: int = 0
    rate: int = 0
    buffer: int = 0
    flags: int = 0
    thresh: tuple = (0,) * NPRIO
    dscp_prio: tuple = (0,) * NDSCP
    mark: int = 0  # ECN: CE-mark ECT frames admitted past this backlog (bytes); 0 never

    def pack(self) -> bytes:
        vals = [getattr(self, f) for f in _SCALARS]
        return CFG.pack(*vals, *self.thresh, *self.dscp_prio, self.mark, 0)

    @classmethod
    def unpack(cls, raw: bytes) -> "PortConfig":
        vals = CFG.unpack(raw)
        n = len(_SCALARS)
        return cls(*vals[:n], thresh=tuple(vals[n:n + NPRIO]),
                   dscp_prio=tuple(vals[n + NPRIO:n + NPRIO + NDSCP]), mark=vals[n + NPRIO + NDSCP])

    def describe(self) -> dict:
        """Human units: what ``dblp fault stats``/``status`` print."""
        out = {}
        if self.loss:
            out["loss"] = _p(self.loss)
        if self.flags & F_GE:
            out["ge"] = {"p": _p(self.ge_p), "r": _p(self.ge_r),
                         "loss_good": _p(self.ge_loss_good), "loss_bad": _p(self.ge_loss_bad)}
        if self.burst_dur_ns:
            out["burst"] = {"ratio": _p(self.burst_ratio), "start": self.burst_start_ns / 1e9,
                            "duration": self.burst_dur_ns / 1e9,
                            "every": self.burst_period_ns / 1e9 or None,
                            "count": self.burst_count or None}
        if self.flags & F_QUEUE:
            out["queue"] = {"rate_bps": self.rate * 8, "buffer": self.buffer, "thresh": list(self.thresh),
                            "classify": "dscp" if self.flags & F_DSCP else "header", "mark": self.mark,
                            "mark_drop": bool(self.flags & F_MARK_DROP), "delay": bool(self.flags & F_DELAY)}
        return out


def default_thresholds(buffer: int) -> tuple:
    """Early-drop thresholds: prio p sheds once the backlog passes buffer*(8-p)/8; prio 0 never."""
    return (0,) + tuple(buffer * (NPRIO - p) // NPRIO for p in range(1, NPRIO))


U64_MAX, U32_MAX = 2**64 - 1, 2**32 - 1


def _field(value: int, top: int, what: str) -> int:
    """``value`` if the program's field holds it (0..top), else a FabricError naming ``what``."""
    if not 0 <= value <= top:
        raise FabricError(f"{what} out of range: {value} (0..{top})")
    return value


def parse_rate(text: str | int | float | None) -> int:
    """:func:`pydblp.units.rate`, raising FabricError."""
    return _parsed(units.rate, text)


def parse_size(text: str | int) -> int:
    """:func:`pydblp.units.size`, raising FabricError."""
    return _parsed(units.size, text)


def parse_duration(text: str | float) -> float:
    """:func:`pydblp.units.duration`, raising FabricError."""
    return _parsed(units.duration, text)


def _parsed(parse, text):
    try:
        return parse(text)
    except ValueError as e:
        raise FabricError(str(e)) from None
    except OverflowError:  # int(float("inf"))
        raise FabricError(f"{text!r} is out of range") from None


def parse_mark(mark, buffer: int) -> int:
    """A queue's CE-marking threshold in bytes (``mark``: bytes or a size, '32k'; None or 0: no
    marking), checked against its ``buffer`` (bytes): a FabricError saying what is wrong and the fix."""
    if mark is None:
        return 0
    try:
        value = parse_size(mark)
    except FabricError as e:
        raise FabricError(f"queue mark: {e} (0: no marking)") from None
    if value < 0:
        raise FabricError(f"queue mark {value} bytes is negative: give a backlog in bytes, e.g. 32k "
                          "(0: no marking)")
    if value > buffer:
        raise FabricError(f"queue mark {value} bytes is above the buffer ({buffer} bytes), where frames are "
                          "dropped, not marked: use a mark <= the buffer or a larger buffer")
    return value


class Fabric:
    """The maps of one testbed's fabric, opened from their pins (or given fds).

    ``ports`` maps a port name (``w0``...) to the switch-side ifindex.
    """

    def __init__(self, pin_dir: Path, ports: dict[str, int]):
        self.pin_dir = Path(pin_dir)
        self.ports = dict(ports)
        self._names = {v: k for k, v in self.ports.items()}
        try:
            self.maps = {m: bpf.Map.pinned(self.pin_dir / m) for m in MAPS}
        except FileNotFoundError:
            raise FabricError(f"fabric maps not pinned under {self.pin_dir}: is the testbed up "
                              "(`dblp testbed status`)?") from None

    def close(self):
        for m in self.maps.values():
            m.close()
        self.maps = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- config ---------------------------------------------------------
    def _ifindexes(self, port) -> list[int]:
        if port is None:
            return list(self.ports.values())
        names = [port] if isinstance(port, (str, int)) else list(port)
        out = []
        for p in names:
            key = f"w{p}" if isinstance(p, int) or str(p).isdigit() else p  # (w1 or 1, as everywhere)
            if key not in self.ports:
                raise FabricError(f"no port {p!r}: the testbed has {', '.join(self.ports)}")
            out.append(self.ports[key])
        return out

    def config(self, ifindex: int) -> PortConfig:
        raw = self.maps["port_cfg"].lookup(U32.pack(ifindex))
        return PortConfig.unpack(raw) if raw else PortConfig()

    def _update(self, port, **fields) -> None:
        for idx in self._ifindexes(port):
            cfg = self.config(idx)
            for k, v in fields.items():
                setattr(cfg, k, v)
            self.maps["port_cfg"].update(U32.pack(idx), cfg.pack())

    def loss(self, p: float, port=None) -> None:
        """Bernoulli loss ``p`` on frames to ``port`` (all ports if None)."""
        self._update(port, loss=prob(p, "loss"))

    def ge(self, p: float, r: float, loss_bad: float = 1.0, loss_good: float = 0.0, port=None) -> None:
        """Gilbert-Elliott loss: good->bad ``p``, bad->good ``r`` per packet, drop rates per state.

        Mean burst (bad-state run) length is ``1/r`` packets; the long-run loss is
        ``(p*loss_bad + r*loss_good) / (p + r)``.  ``p=0`` turns it off.
        """
        pp, rr = prob(p, "ge p"), prob(r, "ge r")
        if pp and not rr:
            raise FabricError("ge r must be > 0 (r = 0 would stay in the bad state forever)")
        for idx in self._ifindexes(port):
            cfg = self.config(idx)
            cfg.ge_p, cfg.ge_r = pp, rr
            cfg.ge_loss_bad, cfg.ge_loss_good = prob(loss_bad, "loss_bad"), prob(loss_good, "loss_good")
            cfg.flags = (cfg.flags | F_GE) if pp else (cfg.flags & ~F_GE)
            self.maps["port_cfg"].update(U32.pack(idx), cfg.pack())
            self._reset_state(idx, keep_queue=True)

    def burst(self, ratio: float = 0.8, duration: float = 0.05, at: float | None = None,
              delay: float = 0.0, every: float | None = None, count: int | None = None,
              port=None) -> float:
        """Arm a microburst: drop ``ratio`` of frames for ``duration`` seconds.

        The window starts ``delay`` s from now, or at ``at`` (``time.monotonic()``
        seconds, the clock of ``bpf_ktime_get_ns``); with ``every`` it repeats
        with that period (``count`` windows, or forever).  Returns the start
        time of the first window (monotonic seconds).  ``duration=0`` disarms.
        """
        if duration < 0 or delay < 0:
            raise FabricError("burst duration and delay must be >= 0")
        if every is not None and every < duration:
            raise FabricError(f"burst period ({every}s) must be at least the duration ({duration}s)")
        if count is not None and count < 1:
            raise FabricError("burst count must be >= 1")
        if at is not None and not at >= 0:
            raise FabricError(f"burst start {at} must be a time.monotonic() value (>= 0)")
        start_ns = int(at * 1e9) if at is not None else time.monotonic_ns() + int(delay * 1e9)
        self._update(port, burst_ratio=prob(ratio, "burst ratio"),
                     burst_start_ns=_field(start_ns, U64_MAX, "burst start (ns)"),
                     burst_dur_ns=_field(int(duration * 1e9), U64_MAX, "burst duration (ns)"),
                     burst_period_ns=_field(int((every or 0) * 1e9), U64_MAX, "burst period (ns)"),
                     burst_count=_field(int(count or 0), U64_MAX, "burst count"))
        return start_ns / 1e9

    def queue(self, rate, buffer=256 * 1024, thresholds=None, port=None, classify: str = "header",
              dscp="default", mark=None, mark_drop: bool = False, delay: bool = False) -> None:
        """Virtual queue on the egress port: drain at ``rate`` (bits/s or '1gbit'), ``buffer`` bytes.

        ``thresholds``: early-drop backlog per DBLP prio (8 values, bytes; prio 0
        is never early-dropped whatever its value); default
        :func:`default_thresholds`; all 0: a drop-tail queue.  ``rate=0`` removes
        the queue.  ``classify``: a packet's prio from its DBLP header
        (``"header"``) or from its IP header's DSCP (``"dscp"``, through
        ``dscp``, a map as ``Config.dscp``: :func:`pydblp.dscp.prio_table`).
        ``mark``: ECN, bytes or a size ('32k', at most ``buffer``): an ECN-capable frame (ECT(0) or
        ECT(1), any IP protocol) admitted while the backlog would pass it is set to CE, counted
        ``mark``; None or 0: no marking.  Not-ECT frames only meet the drops, unless
        ``mark_drop``: then an IP frame that cannot be marked (Not-ECT) and would pass the mark is
        dropped, counted ``mark_drop``, as an ECN AQM signals a flow without ECN (needs ``mark``).
        ``delay``: admitted unicast frames go up the switch's bridge (XDP_PASS) instead of
        straight to the port, so a qdisc on the port can delay them; the qdisc is the caller's
        (:meth:`pydblp.testbed.Testbed.queue` sets a TBF at ``rate``).
        """
        if classify not in ("header", "dscp"):
            raise FabricError(f"classify {classify!r}: use header or dscp")
        from pydblp import dscp as dscp_mod

        try:
            dscp_prio = tuple(dscp_mod.prio_table(dscp).tolist())
        except ValueError as e:
            raise FabricError(str(e)) from None
        bits = parse_rate(rate)
        size = parse_size(buffer)
        if bits and size < 64:
            raise FabricError(f"queue buffer {size} bytes is too small (one frame at least)")
        _field(size, U32_MAX, "queue buffer (bytes)")
        ce = parse_mark(mark, size)
        if mark_drop and bits and not ce:
            raise FabricError("mark drop needs a mark: give the backlog past which frames are marked "
                              "or dropped, e.g. mark='32k'")
        if thresholds is None:
            thresholds = default_thresholds(size)
        thresholds = tuple(_field(int(t), U32_MAX, "queue threshold (bytes)") for t in thresholds)
        if len(thresholds) != NPRIO:
            raise FabricError(f"thresholds: want {NPRIO} values (prio 0..7), got {len(thresholds)}")
        for idx in self._ifindexes(port):
            cfg = self.config(idx)
            cfg.rate, cfg.buffer = bits // 8, size if bits else 0
            cfg.thresh = thresholds if bits else (0,) * NPRIO
            cfg.flags = (cfg.flags | F_QUEUE) if bits else (cfg.flags & ~F_QUEUE)
            cfg.flags = (cfg.flags | F_DSCP) if bits and classify == "dscp" else (cfg.flags & ~F_DSCP)
            cfg.flags = (cfg.flags | F_DELAY) if bits and delay else (cfg.flags & ~F_DELAY)
            cfg.flags = (cfg.flags | F_MARK_DROP) if bits and mark_drop else (cfg.flags & ~F_MARK_DROP)
            cfg.dscp_prio = dscp_prio
            cfg.mark = ce if bits else 0
            self.maps["port_cfg"].update(U32.pack(idx), cfg.pack())
            self._reset_state(idx, keep_queue=False)

    def clear(self, port=None) -> None:
        """Remove every fault from ``port`` (all ports if None) and reset its state."""
        for idx in self._ifindexes(port):
            self.maps["port_cfg"].update(U32.pack(idx), PortConfig().pack())
            self._reset_state(idx, keep_queue=False)
        if port is None:
            self.maps["msgs"].clear()

    def _reset_state(self, idx: int, keep_queue: bool) -> None:
        m = self.maps["port_state"]
        raw = m.lookup(U32.pack(idx))
        _, _, backlog, last, peak = STATE.unpack(raw) if raw else (0, 0, 0, 0, 0)
        if not keep_queue:
            backlog, last, peak = 0, 0, 0
        m.update(U32.pack(idx), STATE.pack(0, 0, backlog, last, peak))

    # ---- counters -------------------------------------------------------
    def stats(self, reset: bool = False) -> dict:
        """``{port: {cause: {'packets', 'bytes'}, ..., 'backlog', 'peak', 'config'}}``.

        Causes: pass, loss, ge, burst, tail, early0..7, bound (early drop refused
        because the message's bound was spent; forwarded), mark (ECN-capable, set to
        CE past the queue's mark; forwarded, so also in pass), mark_drop (Not-ECT past the
        mark of a queue with ``mark_drop``: dropped), flood (broadcast or
        unknown destination handed to the bridge, counted on the ingress port; a
        broadcast all-gather's copies count on their egress ports like unicast).
        """
        out = {name: {"config": self.config(idx).describe()} for name, idx in self.ports.items()}
        cm = self.maps["counters"]
        for key, vals in cm.items():
            ifindex, cause = CKEY.unpack(key)
            name = self._names.get(ifindex, f"if{ifindex}")
            pk = sum(CVAL.unpack(v)[0] for v in vals)
            by = sum(CVAL.unpack(v)[1] for v in vals)
            out.setdefault(name, {})[CAUSES.get(cause, f"cause{cause}")] = {"packets": pk, "bytes": by}
        for name, idx in self.ports.items():
            raw = self.maps["port_state"].lookup(U32.pack(idx))
            if raw:
                _, bad, backlog, _, peak = STATE.unpack(raw)
                out[name].update(backlog=backlog, peak=peak)
        if reset:
            cm.clear()
        return out

    def dropped(self, port=None, causes=DROP_CAUSES) -> int:
        """Frames dropped on ``port`` or all ports, for any of ``causes`` (default: any cause;
        ``("tail",)``: what overflowed a queue's buffer)."""
        s = self.stats()
        names = list(self.ports) if port is None else [port if isinstance(port, str) else f"w{port}"]
        return sum(s.get(n, {}).get(c, {}).get("packets", 0) for n in names for c in causes)


def load(pin_dir: Path, switch_ns: str, ports: dict[str, int], macs: dict[str, bytes],
         mode: str = "native", prog=None) -> int:
    """Compile (unless ``prog`` = (bcc object, fn) is given), pin, fill and attach to ``ports``.

    ``ports``: port name -> switch-side ifindex (ifnames equal the port names);
    ``macs``: port name -> MAC of the worker behind it.  Returns the program id.
    The bcc object is released before returning: the attachments and pins keep
    the program and maps alive until the switch namespace and pins go (the
    devmap ``bcast`` and its egress program live as long as the program).
    One loaded object serves one testbed: its ``bcast`` entries are this one's ports.
    """
    from pydblp import net

    bpf.require_bpffs()
    own = prog is None
    if own:
        b, fn = bpf.compile_xdp(SOURCE, "fabric")
    else:
        b, fn = prog
    try:
        pin_dir.mkdir(parents=True, exist_ok=True)
        for m in MAPS:
            bpf.obj_pin(b[m.encode()].map_fd, pin_dir / m)
        bpf.obj_pin(fn.fd, pin_dir / "prog")
        fab = Fabric(pin_dir, ports)
        try:
            for name, idx in ports.items():
                fab.maps["fdb"].update(MAC.pack(macs[name], 0), U32.pack(idx))
                fab.maps["port_cfg"].update(U32.pack(idx), PortConfig().pack())
                fab.maps["port_state"].update(U32.pack(idx), STATE.pack(0, 0, 0, 0, 0))
        finally:
            fab.close()
        egress = b.funcs.get(b"fabric_egress") or bpf.load_xdp(b, "fabric_egress", fn.frags, bpf.BPF_XDP_DEVMAP)
        bcast = bpf.Map(b[b"bcast"].map_fd, owned=False)
        with net.in_netns(switch_ns):  # (the kernel finds a devmap entry's ifindex in the caller's netns)
            for i, idx in enumerate(ports.values()):  # struct bpf_devmap_val: ifindex, program fd
                bcast.update(U32.pack(i), DEVMAP_VAL.pack(idx, egress.fd))
        for name in ports:
            net.xdp_attach(name, fn.fd, mode=net.Mode(mode), netns=switch_ns)
        pid = prog_id_of(fn.fd)
    finally:
        if own:
            b.cleanup()
    return pid


def prog_id_of(fd: int) -> int:
    return bpf.prog_info(fd)["id"]


def prog_exists(prog_id: int) -> bool:
    """Whether a BPF program with this id is still loaded anywhere."""
    return bpf.prog_info_by_id(prog_id) is not None


def _p(fixed: int) -> float:
    return round(fixed / P_ONE, 9)
