"""The fabric program, frame by frame through BPF_PROG_TEST_RUN (deterministic).

One compile for the module.  Maps are used through the same pinned-map code
(:class:`pydblp.testbed.fabric.Fabric`) the testbed uses, pinned in a
private directory; egress ports are fake ifindexes reached through the fdb.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import struct
import time

import pytest

from pydblp import bpf, dscp, wire
from pydblp.testbed import fabric as fb
from tests.helpers import skip_without

pytestmark = [pytest.mark.root, pytest.mark.bpf]

PORT_A, PORT_B = 1001, 1002
MAC_A = bytes.fromhex("02db00000063")
MAC_B = bytes.fromhex("02db00000064")
SRC_MAC = bytes.fromhex("02db00000001")
XDP_DROP, XDP_PASS, XDP_REDIRECT = 1, 2, 4
FORWARD = XDP_REDIRECT  # known unicast goes straight to its egress port


def ip4_frame(proto: int, l4: bytes, dst_mac: bytes = MAC_A) -> bytes:
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(l4), 1, 0, 64, proto, 0,
                     bytes([198, 18, 0, 1]), bytes([198, 18, 0, 2]))
    return dst_mac + SRC_MAC + b"\x08\x00" + ip + l4


def udp_frame(payload: bytes = b"x" * 64, dst_mac: bytes = MAC_A) -> bytes:
    return ip4_frame(17, struct.pack("!HHHH", 40000, wire.DEFAULT_PORT, 8 + len(payload), 0) + payload,
                     dst_mac)


def tcp_frame(dst_mac: bytes = MAC_A) -> bytes:
    return ip4_frame(6, struct.pack("!HHIIBBHHH", 40000, 80, 1, 0, 5 << 4, 0x10, 65535, 0, 0) + b"y" * 64,
                     dst_mac)


def dblp_frame(prio: int, tensor: int = 0, src: int = 0, nchunks: int = 100, tol: int = 0,
               chunk: int = 0, size: int = 1000, dst_mac: bytes = MAC_A, flags: int = 0) -> bytes:
    hdr = wire.Header(job=7, round=3, tensor=tensor, src=src, dst=1, prio=prio, chunk=chunk,
                      nchunks=nchunks, tol=tol, flags=flags)
    frame = udp_frame(wire.encode(hdr, b"\0" * (size - 14 - 20 - 8 - 32)), dst_mac)
    assert len(frame) == size
    return frame


@pytest.fixture(scope="module")
def compiled(bpf_xdp):
    b, fn = bpf.compile_xdp(fb.SOURCE, "fabric")
    yield b, fn
    b.cleanup()


@pytest.fixture
def fab(compiled, tmp_path_factory):
    """A Fabric over the compiled maps (pinned in a private dir), two fake egress ports."""
    b, fn = compiled
    pin = bpf.PIN_ROOT / "test-fabric" / tmp_path_factory.mktemp("f").name
    pin.mkdir(parents=True)
    for m in fb.MAPS:
        bpf.obj_pin(b[m.encode()].map_fd, pin / m)
    f = fb.Fabric(pin, {"a": PORT_A, "b": PORT_B})
    for m in ("port_cfg", "port_state", "fdb", "counters", "msgs"):
        f.maps[m].clear()
    f.maps["fdb"].update(fb.MAC.pack(MAC_A, 0), fb.U32.pack(PORT_A))
    f.maps["fdb"].update(fb.MAC.pack(MAC_B, 0), fb.U32.pack(PORT_B))
    for idx in (PORT_A, PORT_B):
        f.maps["port_cfg"].update(fb.U32.pack(idx), fb.PortConfig().pack())
        f.maps["port_state"].update(fb.U32.pack(idx), fb.STATE.pack(0, 0, 0, 0, 0))
    f.prog_fd = fn.fd
    yield f
    f.close()
    bpf.unpin(pin)
    bpf.unpin(bpf.PIN_ROOT / "test-fabric")


def verdicts(f, frame: bytes, n: int) -> list[int]:
    return [bpf.test_run(f.prog_fd, frame)[0] for _ in range(n)]


def counts(f, port: str = "a") -> dict[str, int]:
    return {k: v["packets"] for k, v in f.stats()[port].items() if isinstance(v, dict) and "packets" in v}


# ---- agreement of the Python mirrors with the compiled structs ---------------

def _layout(ctype) -> list[tuple[str, int, int]]:
    return [(name, getattr(ctype, name).offset, ctypes.sizeof(t)) for name, t in ctype._fields_
            if not name.startswith("__pad")]


def test_struct_mirrors_match_compiled_types(compiled):
    b, _ = compiled
    assert ctypes.sizeof(b[b"port_cfg"].Leaf) == fb.CFG.size == 200
    assert ctypes.sizeof(b[b"port_state"].Leaf) == fb.STATE.size
    assert ctypes.sizeof(b[b"msgs"].Key) == fb.MSG.size
    assert ctypes.sizeof(b[b"fdb"].Key) == fb.MAC.size
    assert ctypes.sizeof(b[b"counters"].Key) == fb.CKEY.size
    assert ctypes.sizeof(b[b"counters"].Leaf) == fb.CVAL.size * bpf.possible_cpus()
    # field order and offsets of fabric_cfg as the Python struct packs them
    names = [n for n, _, _ in _layout(b[b"port_cfg"].Leaf)]
    assert names == list(fb.CFG_FIELDS)
    offs = {n: o for n, o, _ in _layout(b[b"port_cfg"].Leaf)}
    assert offs["buffer"] == 88 and offs["flags"] == 92 and offs["thresh"] == 96
    assert offs["dscp_prio"] == 128 and offs["mark"] == 192 and offs["pad"] == 196
    assert [n for n, _, _ in _layout(b[b"port_state"].Leaf)] == ["lock", "ge_bad", "backlog", "last_ns", "peak"]


def test_constants_match_header():
    text = (bpf.BPF_DIR / "fabric.h").read_text()
    consts = {"FABRIC_F_GE": fb.F_GE, "FABRIC_F_QUEUE": fb.F_QUEUE, "FABRIC_F_DSCP": fb.F_DSCP,
              "FABRIC_F_DELAY": fb.F_DELAY, "FABRIC_F_MARK_DROP": fb.F_MARK_DROP,
              "FABRIC_NDSCP": fb.NDSCP, "FABRIC_C_PASS": fb.C_PASS,
              "FABRIC_C_LOSS": fb.C_LOSS, "FABRIC_C_GE": fb.C_GE, "FABRIC_C_BURST": fb.C_BURST,
              "FABRIC_C_TAIL": fb.C_TAIL, "FABRIC_C_BOUND": fb.C_BOUND, "FABRIC_C_FLOOD": fb.C_FLOOD,
              "FABRIC_C_MARK": fb.C_MARK, "FABRIC_C_MARK_DROP": fb.C_MARK_DROP,
              "FABRIC_C_EARLY": fb.C_EARLY, "FABRIC_NCAUSES": fb.NCAUSES, "FABRIC_NPRIO": fb.NPRIO}
    import re

    for name, val in consts.items():
        m = re.search(rf"#define {name}\s+\(?(\d+)(?: << (\d+))?", text)
        assert m, name
        got = int(m.group(1)) << int(m.group(2) or 0)
        assert got == val, name


# ---- loss ------------------------------------------------------------------------

def test_no_fault_forwards_everything(fab):
    assert set(verdicts(fab, udp_frame(), 50)) == {FORWARD}
    assert counts(fab)["pass"] == 50


def test_bernoulli_loss_matches_p(fab):
    """Drops within 4.5 sigma of n*p (a false alarm once in ~150000 runs; 3 sigma flaked in CI)."""
    p, n = 0.1, 200000
    fab.loss(p, port="a")
    bpf.test_run(fab.prog_fd, udp_frame(), repeat=n)
    c = counts(fab)
    assert c["loss"] + c["pass"] == n
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(c["loss"] - n * p) <= 4.5 * sigma, c
    # other port untouched
    assert set(verdicts(fab, udp_frame(dst_mac=MAC_B), 200)) == {FORWARD}


def test_tcp_and_udp_alike_broadcast_untouched(fab):
    fab.loss(1.0)
    assert bpf.test_run(fab.prog_fd, udp_frame())[0] == XDP_DROP
    assert bpf.test_run(fab.prog_fd, tcp_frame())[0] == XDP_DROP
    assert bpf.test_run(fab.prog_fd, dblp_frame(prio=0))[0] == XDP_DROP
    bcast = b"\xff" * 6 + udp_frame()[6:]
    assert bpf.test_run(fab.prog_fd, bcast)[0] == XDP_PASS
    # broadcast DBLP DATA to every rank goes to the ports' devmap, each copy meeting its port's
    # faults there (tests/linux/test_testbed.py: the copies, live)
    hdr = wire.Header(job=7, round=3, src=0, dst=wire.DST_ALL, nchunks=4, flags=wire.Flag.ALLGATHER)
    to_all = udp_frame(wire.encode(hdr, b"\0" * 64), b"\xff" * 6)
    assert bpf.test_run(fab.prog_fd, to_all)[0] == XDP_REDIRECT
    one = dataclasses.replace(hdr, dst=2)  # DATA for one rank, broadcast at L2: the bridge floods it untouched
    assert bpf.test_run(fab.prog_fd, udp_frame(wire.encode(one, b"\0" * 64), b"\xff" * 6))[0] == XDP_PASS
    unknown = bytes.fromhex("02db000000ee") + udp_frame()[6:]
    assert bpf.test_run(fab.prog_fd, unknown)[0] == XDP_PASS
    fab.clear()
    assert bpf.test_run(fab.prog_fd, tcp_frame())[0] == FORWARD


def test_gilbert_elliott_mean_burst_length(fab):
    p, r, n = 0.05, 0.25, 20000
    fab.ge(p, r, loss_bad=1.0, loss_good=0.0, port="a")
    v = verdicts(fab, udp_frame(), n)
    runs, cur = [], 0
    for x in v:
        if x == XDP_DROP:
            cur += 1
        elif cur:
            runs.append(cur)
            cur = 0
    mean = sum(runs) / len(runs)
    # run lengths are geometric with mean 1/r = 4, sd sqrt(1-r)/r ~ 3.5
    sd = math.sqrt(1 - r) / r / math.sqrt(len(runs))
    assert abs(mean - 1 / r) <= 4 * sd, (mean, len(runs))
    frac = v.count(XDP_DROP) / n
    assert abs(frac - p / (p + r)) < 0.03, frac
    assert counts(fab)["ge"] == v.count(XDP_DROP)


# ---- microburst windows -------------------------------------------------------------

def _timed(fab, frame: bytes, seconds: float) -> list[tuple[int, int, int]]:
    out = []
    end = time.monotonic_ns() + int(seconds * 1e9)
    while (t0 := time.monotonic_ns()) < end:
        v = bpf.test_run(fab.prog_fd, frame)[0]
        out.append((t0, time.monotonic_ns(), v))
    return out


def test_burst_window_drops_only_inside(fab):
    # a loaded machine may deschedule the sampling loop for the whole 30 ms window: then the
    # window is armed again (at most 5 times); every attempt must drop only inside it
    for _ in range(5):
        start = fab.burst(ratio=1.0, duration=0.03, delay=0.02, port="a")
        s_ns, e_ns = int(start * 1e9), int(start * 1e9) + 30_000_000
        rec = _timed(fab, udp_frame(), 0.08)
        inside = [v for t0, t1, v in rec if t0 >= s_ns and t1 < e_ns]
        outside = [v for t0, t1, v in rec if t1 < s_ns or t0 >= e_ns]
        assert set(inside) <= {XDP_DROP}
        assert set(outside) <= {FORWARD}
        for t0, t1, v in rec:
            if v == XDP_DROP:
                assert t1 >= s_ns and t0 < e_ns, "drop outside the window"
        if inside and outside:
            break
    assert inside and outside, "no sample landed inside and outside the window in 5 attempts"


def test_periodic_bursts_with_count_and_ratio(fab):
    # as in test_burst_window_drops_only_inside: a sampling loop descheduled through the 10 ms
    # windows leaves too few samples in them; then they are armed again (at most 5 times), and
    # every attempt must drop inside them only
    P, D = 30_000_000, 10_000_000
    for _ in range(5):
        start = fab.burst(ratio=1.0, duration=D / 1e9, delay=0.005, every=P / 1e9, count=2, port="a")
        s_ns = int(start * 1e9)
        windows = [(s_ns + k * P, s_ns + k * P + D) for k in range(2)]
        rec = _timed(fab, udp_frame(), 0.11)
        inside = 0
        for t0, t1, v in rec:
            touches = any(t1 >= a and t0 < b for a, b in windows)
            within = any(t0 >= a and t1 < b for a, b in windows)
            if v == XDP_DROP:
                assert touches, (t0 - s_ns, t1 - s_ns)
            if within:
                inside += 1
                assert v == XDP_DROP, (t0 - s_ns, t1 - s_ns)
        # the third window (k = 2) does not come
        assert all(v == FORWARD for t0, _, v in rec if t0 >= s_ns + P + D)
        third = any(t0 >= s_ns + 2 * P for t0, _, _ in rec)
        if inside > 10 and third:
            break
    assert inside > 10 and third, f"{inside} samples inside the windows, one where the third would be: {third}"
    # partial ratio: about half inside a long window
    fab.burst(ratio=0.5, duration=5.0, port="b")
    v = verdicts(fab, udp_frame(dst_mac=MAC_B), 4000)
    assert abs(v.count(XDP_DROP) / 4000 - 0.5) < 0.05


# ---- the priority queue ---------------------------------------------------------------

def model(frames, buffer, thresh, bounds):
    """Expected verdicts of a queue that never drains (rate ~0) — the C logic in Python."""
    backlog, spent, out = 0, {}, []
    for key, prio, size in frames:
        t = thresh[prio] if prio > 0 else 0
        bound = bounds[key]
        if backlog + size > buffer:
            out.append("tail")
        elif t and backlog + size > t and bound and spent.get(key, 0) < bound:
            spent[key] = spent.get(key, 0) + 1
            out.append("early")
        else:
            backlog += size
            out.append("pass")
    return out, spent


def test_priority_queue_early_drop_order_and_bound(fab):
    size, buffer = 1000, 40_500
    fab.queue(8, buffer=buffer, port="a")          # 1 byte/s: the queue only fills
    thresh = fb.default_thresholds(buffer)
    frames, sent = [], []
    # 8 messages (one per prio, src = prio), 30 chunks each, tol 10 % -> bound 2
    nchunks, tol = 30, 26
    for chunk in range(nchunks):
        for prio in (7, 0, 3, 1, 6, 2, 5, 4):
            frames.append(((prio,), prio, size))
            sent.append(dblp_frame(prio, tensor=prio, src=prio, nchunks=nchunks, tol=tol, chunk=chunk))
    bound = nchunks * tol // 255
    assert bound == 3
    want, spent = model(frames, buffer, thresh, {(p,): bound for p in range(8)})
    got = [bpf.test_run(fab.prog_fd, f)[0] for f in sent]
    assert [XDP_DROP if w != "pass" else FORWARD for w in want] == got
    c = counts(fab)
    assert c.get("early0", 0) == 0
    assert sum(c.get(f"early{p}", 0) for p in range(8)) == want.count("early")
    assert c.get("tail", 0) == want.count("tail") > 0
    # lower priority (higher number) starts losing first
    first = {}
    for (key, prio, _), w in zip(frames, want):
        if w == "early":
            first.setdefault(prio, len(first))
    assert sorted(first, key=first.get) == sorted(first, reverse=True)
    assert first and 0 not in first
    # the kernel's per-message counters: none above its bound
    for k, v in fab.maps["msgs"].items():
        job, rnd, tensor, src, dst, _, _, _ = fb.MSG.unpack(k)
        assert struct.unpack("=I", v)[0] <= bound
    assert max(spent.values()) == bound
    st = fab.stats()["a"]
    assert st["backlog"] <= buffer and st["peak"] <= buffer


@pytest.mark.parametrize("classify", ["header", "dscp"])
def test_queue_classifies_by_dscp_when_told(fab, classify):
    """DBLP prio 1 in the header, AF43 (the default map's prio 6-7) in the IP header: a queue that
    classifies by DSCP early-drops them from prio 6's threshold on, within the message's bound;
    one that reads the header keeps them to prio 1's."""
    buffer, nchunks, tol = 40_500, 30, 26
    bound = nchunks * tol // 255  # 3
    fab.queue(8, buffer=buffer, port="a", classify=classify)  # 1 byte/s: the queue only fills
    assert fab.config(PORT_A).describe()["queue"]["classify"] == classify
    af43 = dscp.NAMES["AF43"] << 2
    got = []
    for i in range(15):
        f = bytearray(dblp_frame(1, tensor=1, src=1, nchunks=nchunks, tol=tol, chunk=i))
        f[15] = af43
        got.append(bpf.test_run(fab.prog_fd, bytes(f))[0])
    if classify == "dscp":  # prio 6 sheds past buffer * 2/8 = 10125 bytes: from the 11th frame on
        assert got == [FORWARD] * 10 + [XDP_DROP] * bound + [FORWARD] * (5 - bound)
        assert counts(fab)["early6"] == bound
    else:
        assert got == [FORWARD] * 15 and not any(k.startswith("early") for k in counts(fab))
    with pytest.raises(fb.FabricError, match="classify"):
        fab.queue(8, buffer=buffer, port="a", classify="tos")


def test_reduce_scatter_and_all_gather_between_two_ranks_have_separate_bounds(fab):
    """A reduce-scatter and an all-gather message of the same (job, round, tensor, src, dst) are
    two messages: each loses up to its own bound to early drop."""
    fab.queue(8, buffer=40_500, port="a")  # 1 byte/s: the queue only fills
    nchunks, tol = 30, 26
    bound = nchunks * tol // 255  # 3
    got = {}
    for flags in (0, wire.Flag.ALLGATHER):
        got[flags] = [bpf.test_run(fab.prog_fd, dblp_frame(7, tensor=5, src=2, nchunks=nchunks, tol=tol,
                                                            chunk=i, flags=flags))[0] for i in range(10)]
    # prio 7 is early-dropped once the backlog passes buffer/8 (5062 bytes): from the 6th frame on
    assert got[0] == [FORWARD] * 5 + [XDP_DROP] * bound + [FORWARD] * (5 - bound)
    assert got[wire.Flag.ALLGATHER] == [XDP_DROP] * bound + [FORWARD] * (10 - bound)
    assert counts(fab)["early7"] == 2 * bound
    spent = sorted((k[-2], fb.U32.unpack(v)[0]) for k, v in
                   ((fb.MSG.unpack(k), v) for k, v in fab.maps["msgs"].items()))
    assert spent == [(0, bound), (1, bound)]  # (allgather, early drops) of the two messages


def test_queue_drains_at_line_rate(fab):
    """800 kbit/s = 100 bytes per ms into a 20 kB buffer.  How much drains between two frames
    depends on when the kernel runs them, so what is admitted is bounded by the time measured
    around the sends (``bpf_ktime_get_ns`` and ``time.monotonic_ns`` are both CLOCK_MONOTONIC)."""
    rate, buffer, size = 100_000, 20_000, 1000
    fab.queue("800kbit", buffer=buffer, port="a")
    frame = udp_frame(b"z" * (size - 42))
    # fill: until a frame is tail-dropped, at least a full buffer goes through
    sent, fwd, t0 = 0, 0, time.monotonic_ns()
    while sent < 10_000:  # > 100 frames/s outruns the drain: some frame is dropped long before
        start = time.monotonic_ns()
        verdict = bpf.test_run(fab.prog_fd, frame)[0]
        full = time.monotonic_ns()
        sent += 1
        if verdict == XDP_DROP:
            break
        assert verdict == FORWARD
        fwd += 1
    assert verdict == XDP_DROP, f"{sent} frames never filled the queue"
    assert buffer // size <= fwd <= (buffer + 1 + rate * (start - t0) // 10**9) // size
    # the queue held more than buffer - size bytes when that frame came (at most `full`)
    time.sleep(0.1)
    after = time.monotonic_ns()
    got = verdicts(fab, frame, 30)
    end = time.monotonic_ns()
    again = got.count(FORWARD)
    # at least what drained in the sleep (10 frames at least) is free again, at most what drained
    # from `start` on (+1 byte: the drain carries sub-byte remainders in time)
    assert min(rate * (after - full) // 10**9, buffer) // size <= again
    assert again <= (size + rate * (end - start) // 10**9) // size
    assert again >= 10
    assert counts(fab)["tail"] == sent + 30 - fwd - again
    assert counts(fab)["pass"] == fwd + again


def test_tol_zero_is_never_early_dropped(fab):
    fab.queue(8, buffer=10_000, port="a")
    v = [bpf.test_run(fab.prog_fd, dblp_frame(7, nchunks=100, tol=0, chunk=i))[0] for i in range(12)]
    assert v == [FORWARD] * 10 + [XDP_DROP] * 2      # only tail drops
    c = counts(fab)
    assert c.get("early7", 0) == 0 and c["bound"] > 0 and c["tail"] == 2


def test_retransmissions_are_never_early_dropped(fab):
    """A retransmission (flag RETX) carries its chunk's priority, but the queue early-drops
    only first sends (as the host program sheds only them): past the threshold it is admitted
    until the buffer is full, then tail-dropped."""
    fab.queue(8, buffer=10_000, port="a")
    retx = [bpf.test_run(fab.prog_fd, dblp_frame(7, tensor=5, nchunks=100, tol=255, chunk=i,
                                                 flags=wire.Flag.RETX))[0] for i in range(12)]
    assert retx == [FORWARD] * 10 + [XDP_DROP] * 2
    c = counts(fab)
    assert c.get("early7", 0) == 0 and c["tail"] == 2
    fab.queue(8, buffer=10_000, port="a")
    first = [bpf.test_run(fab.prog_fd, dblp_frame(7, tensor=6, nchunks=100, tol=255, chunk=i))[0]
             for i in range(12)]
    assert XDP_DROP in first[:10]  # (the same frames as first sends: early-dropped past the threshold)


def test_a_vlan_tagged_dblp_frame_is_classified_as_an_untagged_one(fab):
    """The queue finds DBLP behind one 802.1Q tag, as it finds IP there for ECN."""
    fab.queue(8, buffer=10_000, port="a")
    tagged = []
    for i in range(12):
        f = dblp_frame(7, tensor=9, nchunks=100, tol=255, chunk=i)
        tagged.append(bpf.test_run(fab.prog_fd, f[:12] + b"\x81\x00\x00\x05" + f[12:])[0])
    assert XDP_DROP in tagged[:10] and counts(fab).get("early7", 0) > 0


def test_config_validation(fab):
    with pytest.raises(fb.FabricError):
        fab.loss(1.5)
    with pytest.raises(fb.FabricError):
        fab.ge(0.1, 0)
    with pytest.raises(fb.FabricError):
        fab.burst(duration=0.1, every=0.05)
    with pytest.raises(fb.FabricError):
        fab.loss(0.1, port="zz")
    with pytest.raises(fb.FabricError):
        fab.queue("1gbit", thresholds=[1, 2])
    # values the map's fields cannot hold: one FabricError each, and nothing written
    before = {idx: fab.config(idx) for idx in (PORT_A, PORT_B)}
    for bad in (lambda: fab.queue("-5"), lambda: fab.queue("1gbit", buffer="8g"),
                lambda: fab.queue("1gbit", thresholds=[0] * 7 + [2**32]),
                lambda: fab.burst(at=-5.0), lambda: fab.burst(duration=1e12),
                lambda: fab.burst(duration=0.1, every=1e12)):
        with pytest.raises(fb.FabricError, match="bad rate|out of range|monotonic"):
            bad()
    assert {idx: fab.config(idx) for idx in (PORT_A, PORT_B)} == before
    assert fb.parse_rate("1gbit") == 10**9 and fb.parse_rate("none") == 0
    assert fb.parse_size("64k") == 65536 and fb.parse_duration("50ms") == pytest.approx(0.05)


def test_jumbo_frames_are_counted_and_queued_whole(fab):
    """A multi-buffer (frags) load sees a 9000-byte frame whole: bytes counted and queued are 9000, not
    the first buffer's ~3.5 KB (``dblp_frame_len``)."""
    if not bpf.xdp_frags_supported():
        skip_without("xdp_frags")
    frame = udp_frame(b"j" * (9000 - 42))
    assert len(frame) == 9000
    verdict, out = bpf.test_run(fab.prog_fd, frame)
    assert verdict == FORWARD and out == frame
    assert fab.stats()["a"]["pass"]["bytes"] == 9000
    # a 20 kB queue holds two 9000-byte frames, not five first buffers (1 byte/s: it only fills)
    fab.queue(8, buffer=20_000, port="a")
    assert verdicts(fab, frame, 4) == [FORWARD, FORWARD, XDP_DROP, XDP_DROP]


# ---- ECN: CE marking past the queue's mark ------------------------------------------------

NOT_ECT, ECT1, ECT0, CE = 0, 1, 2, 3


def ip_sum(hdr: bytes) -> int:
    """The one's complement sum of a header's 16-bit words (0xffff: its checksum is valid)."""
    s = sum(struct.unpack(f"!{len(hdr) // 2}H", hdr))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def with_checksum(ip: bytes) -> bytes:
    """``ip`` (an IPv4 header) with its checksum computed from scratch."""
    ip = ip[:10] + b"\0\0" + ip[12:]
    return ip[:10] + struct.pack("!H", ~ip_sum(ip) & 0xFFFF) + ip[12:]


def ecn_frame(ecn: int, family: int = 4, size: int = 1000, proto: int = 17, dscp_: int = 0,
              ident: int = 1, ttl: int = 64, options: bytes = b"", vlan: bool = False) -> bytes:
    """An Ethernet/IPv4|IPv6 frame of ``size`` bytes, traffic class ``dscp_ << 2 | ecn``, a valid
    IPv4 checksum, UDP (or ``proto``'s bytes) to a port that is not DBLP's."""
    tc = dscp_ << 2 | ecn
    eth = MAC_A + SRC_MAC + (b"\x81\x00\x00\x2a" if vlan else b"")
    if family == 4:
        l4len = size - len(eth) - 2 - 20 - len(options)
        ip = struct.pack("!BBHHHBBH4s4s", 0x45 + len(options) // 4, tc, 20 + len(options) + l4len, ident,
                         0x4000, ttl, proto, 0, bytes([198, 18, 0, 1]), bytes([198, 18, 0, 2])) + options
        l3 = b"\x08\x00" + with_checksum(ip)
    else:
        l4len = size - len(eth) - 2 - 40
        l3 = b"\x86\xdd" + struct.pack("!IHBB", 6 << 28 | tc << 20 | 0xABCDE, l4len, proto, ttl) + \
            bytes.fromhex("fd00" + "00" * 13 + "01" + "fd00" + "00" * 13 + "02")
    l4 = struct.pack("!HHHH", 40000, 9, l4len, 0) + bytes(range(256)) * 8
    return eth + l3 + l4[:l4len]


def as_ce(frame: bytes) -> bytes:
    """What a CE mark makes of ``frame``: the ECN field 3 and (IPv4) the checksum computed afresh."""
    off = 18 if frame[12:14] == b"\x81\x00" else 14
    f = bytearray(frame)
    if f[off - 2:off] == b"\x08\x00":
        ihl = (f[off] & 0xF) * 4
        f[off + 1] |= CE
        f[off:off + ihl] = with_checksum(bytes(f[off:off + ihl]))
    else:
        f[off + 1] |= CE << 4
    return bytes(f)


def ecn_of(frame: bytes) -> int:
    off = 18 if frame[12:14] == b"\x81\x00" else 14
    return frame[off + 1] & 3 if frame[off - 2:off] == b"\x08\x00" else (frame[off + 1] >> 4) & 3


@pytest.mark.parametrize("family", [4, 6])
@pytest.mark.parametrize("ecn", [ECT0, ECT1], ids=["ect0", "ect1"])
def test_queue_marks_ect_frames_admitted_past_the_mark(fab, family, ecn):
    """1000-byte frames into a queue that only fills (1 byte/s), mark 3500, buffer 10500: the
    first three are admitted as they came (backlog + len <= 3500), the next seven with CE (IPv4:
    a valid checksum, every other byte as it was), the rest are tail-dropped, never marked."""
    fab.queue(8, buffer=10_500, mark=3_500, thresholds=[0] * 8, port="a")
    frame = ecn_frame(ecn, family)
    got = [bpf.test_run(fab.prog_fd, frame) for _ in range(12)]
    assert [v for v, _ in got] == [FORWARD] * 10 + [XDP_DROP] * 2
    assert [out for _, out in got[:10]] == [frame] * 3 + [as_ce(frame)] * 7
    if family == 4:
        assert all(ip_sum(out[14:34]) == 0xFFFF for _, out in got[:10])
    c = counts(fab)
    assert (c["mark"], c["pass"], c["tail"]) == (7, 10, 2)  # a marked frame is forwarded: in pass too
    assert fab.stats()["a"]["mark"]["bytes"] == 7000
    assert fab.dropped("a") == 2, "a mark is no drop"


def test_queue_marks_only_ect_and_leaves_not_ect_and_ce_alone(fab):
    """Not-ECT frames past the mark are forwarded as they came (they only meet the tail drop at the
    buffer), frames already CE too and not counted; any IP protocol is marked (TCP here), and a
    VLAN-tagged frame's IP header is found behind its tag."""
    fab.queue(8, buffer=40_500, mark=2_500, thresholds=[0] * 8, port="a")
    frames = [ecn_frame(e, fam, proto=p, vlan=v) for e in (NOT_ECT, ECT0, CE, ECT1)
              for fam, p, v in ((4, 17, False), (4, 6, False), (6, 6, False), (4, 17, True))]
    assert len(frames) == 16
    early = [bpf.test_run(fab.prog_fd, ecn_frame(ECT0)) for _ in range(2)]  # 2000 bytes: below the mark
    assert early == [(FORWARD, ecn_frame(ECT0))] * 2
    want, marked = [], 0
    for f in frames:  # 3000 bytes and up: past the mark, within the buffer
        if ecn_of(f) in (ECT0, ECT1):
            want.append((FORWARD, as_ce(f)))
            marked += 1
        else:
            want.append((FORWARD, f))
    assert [bpf.test_run(fab.prog_fd, f) for f in frames] == want
    assert counts(fab)["mark"] == marked == 8
    # a frame that is not IP at all is forwarded untouched past the mark
    arp = MAC_A + SRC_MAC + b"\x08\x06" + bytes(28)
    assert bpf.test_run(fab.prog_fd, arp) == (FORWARD, arp)
    assert counts(fab)["mark"] == 8


def test_queue_without_a_mark_never_marks(fab):
    for mark in (None, 0, "0"):
        fab.queue(8, buffer=10_500, mark=mark, thresholds=[0] * 8, port="a")
        assert fab.config(PORT_A).mark == 0
        frame = ecn_frame(ECT0)
        assert [bpf.test_run(fab.prog_fd, frame) for _ in range(10)] == [(FORWARD, frame)] * 10
        assert "mark" not in counts(fab)


def test_mark_checksum_is_a_full_recompute(fab):
    """The incremental checksum update (RFC 1624) agrees with a full recompute over headers of
    every kind: DSCPs, options, VLAN tags, and checksums at the edges of one's complement
    (0x0000, 0x0001, 0xfffe, 0xffff before or after the mark)."""
    import random

    rng = random.Random(47)
    fab.queue(8, buffer=4_000_000, mark=64, thresholds=[0] * 8, port="a")  # every frame is past the mark
    frames = [ecn_frame(rng.choice((ECT0, ECT1)), size=100, proto=rng.choice((6, 17, 132)),
                        dscp_=rng.randrange(64), ident=rng.randrange(65536), ttl=rng.randrange(1, 256),
                        options=rng.choice((b"", b"\x01" * 4, b"\x01" * 40)), vlan=rng.random() < 0.2)
              for _ in range(300)]
    edges = {0x0000, 0x0001, 0xFFFE, 0xFFFF}
    for ecn in (ECT0, ECT1):
        found = 0
        for ident in range(65536):
            f = ecn_frame(ecn, size=100, ident=ident)
            if struct.unpack_from("!H", f, 24)[0] in edges or struct.unpack_from("!H", as_ce(f), 24)[0] in edges:
                frames.append(f)
                found += 1
        assert found >= 4
    for f in frames:
        verdict, out = bpf.test_run(fab.prog_fd, f)
        assert (verdict, out) == (FORWARD, as_ce(f)), f.hex()
        off = 18 if f[12:14] == b"\x81\x00" else 14
        assert ip_sum(out[off:off + (out[off] & 0xF) * 4]) == 0xFFFF
    assert counts(fab)["mark"] == len(frames)


def test_queue_mark_is_checked_and_described(fab):
    fab.queue("1mbit", buffer="64k", mark="16k", port="a")
    assert fab.config(PORT_A).mark == 16384
    assert fab.config(PORT_A).describe()["queue"]["mark"] == 16384
    fab.queue("1mbit", buffer=65536, mark=65536, port="b")  # the buffer itself is allowed
    before = {idx: fab.config(idx) for idx in (PORT_A, PORT_B)}
    for mark, match in (("65537", "above the buffer"), ("1m", "above the buffer"), ("big", "bad size"),
                        ("-5", "negative"), ("inf", "out of range")):
        with pytest.raises(fb.FabricError, match=match) as e:
            fab.queue("1mbit", buffer="64k", mark=mark)
        assert "\n" not in str(e.value) and "mark" in str(e.value)
    assert {idx: fab.config(idx) for idx in (PORT_A, PORT_B)} == before, "nothing written"
    fab.queue(0, mark="16k", port="a")  # removing the queue removes its mark
    assert fab.config(PORT_A).mark == 0 and "queue" not in fab.config(PORT_A).describe()
