"""ECN through a live testbed: the fabric's virtual queue sets CE on ECN-capable datagrams
admitted past its ``mark``.

UDP datagrams go from w0 to w1; w1 reads each one's TOS byte with ``IP_RECVTOS``.  IPv4 only:
the testbed runs with IPv6 off, so the IPv6 traffic class is checked frame by frame in
tests/linux/test_fabric.py (BPF_PROG_TEST_RUN), not here.

The queue drains at 1 byte/s, so over a test its backlog only grows, datagram by datagram in
send order: which datagrams are marked (and which tail-dropped) follows from their byte position
alone, not from timing.  With 1000-byte frames, mark 8500 and buffer 20500, datagrams 0..7 arrive
as sent, 8..19 CE-marked if they were ECN-capable, 20.. are dropped.

Checksums: a marked frame's IPv4 header checksum is checked twice.  The kernel vouches for it
(``ip_rcv`` drops a frame whose header checksum is wrong before UDP sees it, so every marked
datagram a socket receives had a valid one), and every frame is also captured on w1's eth0 with
a raw AF_PACKET socket, ahead of that check, and its checksum summed here.
"""

from __future__ import annotations

import socket
import struct

import pytest

from pydblp import net, wire
from pydblp.testbed import Testbed
from tests.helpers import unique_name

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns]

FRAME = 1000                       # bytes on the wire: Ethernet 14 + IPv4 20 + UDP 8 + 958
PAYLOAD = FRAME - 14 - 20 - 8
MARK, BUFFER, N = 8_500, 20_500, 30
UNMARKED = range(0, 8)             # backlog + 1000 <= 8500: admitted as sent
MARKED = range(8, 20)              # past the mark, within the buffer
DROPPED = range(20, N)             # backlog + 1000 > 20500: tail drop
NOT_ECT, ECT1, ECT0, CE = 0, 1, 2, 3
ETH_P_IP = 0x0800


@pytest.fixture(scope="module")
def tb(fabric_prog):
    with Testbed(workers=2, name=unique_name("ecn"), prog=fabric_prog) as t:
        yield t


def udp(tb, worker: str, tos: int | None = None) -> socket.socket:
    with net.in_netns(tb.ns(worker)):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if tos is not None:
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
    return s


def receiver(tb, port: int = 0) -> socket.socket:
    """A socket on w1 that reports each datagram's TOS byte (IP_RECVTOS)."""
    rx = udp(tb, "w1")
    rx.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
    rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    rx.bind(("" if port else tb.addr("w1"), port))
    return rx


def capture(tb) -> socket.socket:
    """A raw AF_PACKET socket on w1's eth0: the IPv4 frames as they arrive, before ip_rcv."""
    with net.in_netns(tb.ns("w1")):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_IP))
    s.bind(("eth0", ETH_P_IP))
    return s


def tos_of(rx: socket.socket, seq_at: int = 0, quiet: float = 0.3) -> dict[int, int]:
    """{sequence number (u32 at ``seq_at`` in the payload): TOS byte} of what arrives on ``rx``
    until it is quiet for ``quiet`` seconds."""
    rx.settimeout(quiet)
    got = {}
    while True:
        try:
            data, anc, _, _ = rx.recvmsg(2048, socket.CMSG_SPACE(4))
        except TimeoutError:
            return got
        tos = [d[0] for level, kind, d in anc if level == socket.IPPROTO_IP and kind == socket.IP_TOS]
        assert len(tos) == 1, anc
        got[struct.unpack_from("!I", data, seq_at)[0]] = tos[0]


def ip_sum(hdr: bytes) -> int:
    s = sum(struct.unpack(f"!{len(hdr) // 2}H", hdr))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return s


def captured(cap: socket.socket, dport: int) -> list[bytes]:
    """The IPv4 headers of the UDP frames to ``dport`` the capture holds."""
    cap.setblocking(False)
    out = []
    while True:
        try:
            frame, addr = cap.recvfrom(4096)
        except BlockingIOError:
            return out
        ip = frame[14:]  # (SOCK_RAW: the Ethernet header first)
        ihl = (ip[0] & 0xF) * 4
        if addr[2] != socket.PACKET_OUTGOING and ip[9] == 17 and struct.unpack_from("!H", ip, ihl + 2)[0] == dport:
            out.append(ip[:ihl])


def send(tb, to: tuple[str, int], tos_of_seq, payload=lambda i: struct.pack("!I", i) + bytes(PAYLOAD - 4),
         broadcast: bool = False) -> None:
    """N datagrams from w0, back to back; datagram i with TOS ``tos_of_seq(i)``."""
    socks = {}
    try:
        for i in range(N):
            tos = tos_of_seq(i)
            if tos not in socks:
                socks[tos] = udp(tb, "w0", tos)
                if broadcast:
                    socks[tos].setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
            data = payload(i)
            assert len(data) == PAYLOAD
            socks[tos].sendto(data, to)
    finally:
        for s in socks.values():
            s.close()


def received(tb, tos: int = ECT0) -> dict[int, int]:
    """Send the N datagrams from w0 to a fresh socket on w1, all with TOS ``tos``: what arrived."""
    rx = receiver(tb)
    try:
        send(tb, rx.getsockname(), lambda i: tos)
        return tos_of(rx)
    finally:
        rx.close()


def queue(tb) -> None:
    """A drop-tail queue to w1 that drains at 1 byte/s: over a test, the backlog only grows."""
    tb.queue(8, buffer=BUFFER, thresholds=[0] * 8, port="w1", mark=MARK)
    assert tb.stats()["w1"]["config"]["queue"]["mark"] == MARK


def test_ect_datagrams_past_the_mark_arrive_ce(clean):
    tb = clean
    queue(tb)
    rx, cap = receiver(tb), capture(tb)
    try:
        send(tb, rx.getsockname(), lambda i: ECT0)
        got = tos_of(rx)
        heads = captured(cap, rx.getsockname()[1])
    finally:
        rx.close(), cap.close()
    assert got == {**{i: ECT0 for i in UNMARKED}, **{i: CE for i in MARKED}}, got
    # the raw capture: the same frames, a valid header checksum on each (0xffff: it sums to -0)
    assert sorted(h[1] for h in heads) == sorted(got.values())
    assert all(ip_sum(h) == 0xFFFF for h in heads), [h.hex() for h in heads if ip_sum(h) != 0xFFFF]
    s = tb.stats()["w1"]
    assert s["mark"]["packets"] == len(MARKED) and s["mark"]["bytes"] == len(MARKED) * FRAME
    assert s["pass"]["packets"] == len(UNMARKED) + len(MARKED)  # a marked frame is forwarded
    assert s["tail"]["packets"] == len(DROPPED)


def test_only_ecn_capable_datagrams_are_marked(clean):
    """Not-ECT, ECT(1), ECT(0) and CE in turn, each with DSCP AF41: past the mark ECT(0) and ECT(1)
    arrive CE; Not-ECT arrive as sent (they meet only the tail drop at the buffer); CE arrive as
    sent and are not counted; the DSCP is kept."""
    tb = clean
    queue(tb)
    af41 = 34 << 2
    sent = {i: af41 | (i % 4) for i in range(N)}
    rx, cap = receiver(tb), capture(tb)
    try:
        send(tb, rx.getsockname(), sent.get)
        got = tos_of(rx)
        heads = captured(cap, rx.getsockname()[1])
    finally:
        rx.close(), cap.close()
    want = {i: sent[i] | CE if i in MARKED and sent[i] & 3 in (ECT0, ECT1) else sent[i]
            for i in (*UNMARKED, *MARKED)}
    assert got == want, got  # (Not-ECT past the mark included: never marked)
    assert all(ip_sum(h) == 0xFFFF for h in heads) and len(heads) == len(want)
    s = tb.stats()["w1"]
    marked = sum(1 for i in MARKED if sent[i] & 3 in (ECT0, ECT1))
    assert marked == 6 and s["mark"]["packets"] == marked
    assert s["tail"]["packets"] == len(DROPPED)


def test_broadcast_copies_are_marked_on_their_port(clean):
    """DBLP DATA to every rank (the broadcast all-gather): the fabric's egress program applies w1's
    queue to w1's copy, so ECN-capable copies past the mark arrive CE there too."""
    tb = clean
    queue(tb)
    rx = receiver(tb, port=wire.DEFAULT_PORT)
    addr, port, _ = tb.group(wire.DEFAULT_PORT)

    def dblp(i: int) -> bytes:
        hdr = wire.Header(kind=wire.Kind.DATA, job=7, round=1, src=0, dst=wire.DST_ALL, chunk=i, nchunks=N,
                          flags=wire.Flag.ALLGATHER)
        return wire.encode(hdr, bytes(PAYLOAD - wire.HEADER_LEN))

    try:
        send(tb, (addr, port), lambda i: ECT0, payload=dblp, broadcast=True)
        got = tos_of(rx, seq_at=20)  # the DBLP header's chunk
    finally:
        rx.close()
    assert got == {**{i: ECT0 for i in UNMARKED}, **{i: CE for i in MARKED}}, got
    s = tb.stats()["w1"]
    assert s["mark"]["packets"] == len(MARKED) and s["tail"]["packets"] == len(DROPPED)
    assert "mark" not in tb.stats()["w0"]


def test_mark_drop_drops_what_cannot_be_marked(clean):
    """With ``mark_drop`` the queue is an ECN AQM: past the mark ECT(0) and ECT(1) datagrams
    arrive CE and Not-ECT ones are dropped, counted ``mark_drop``, taking no room in the queue;
    CE ones arrive as sent.  Which is which follows from byte positions, as the model below
    of the queue (tail drop first, then the mark) works out frame by frame."""
    from pydblp.testbed.fabric import FabricError

    tb = clean
    with pytest.raises(FabricError) as e:
        tb.queue(8, buffer=BUFFER, thresholds=[0] * 8, port="w1", mark_drop=True)
    assert "needs a mark" in str(e.value) and "\n" not in str(e.value)
    tb.queue(8, buffer=BUFFER, thresholds=[0] * 8, port="w1", mark=MARK, mark_drop=True)
    assert tb.stats()["w1"]["config"]["queue"]["mark_drop"] is True
    sent = {i: i % 4 for i in range(N)}  # Not-ECT, ECT(1), ECT(0), CE in turn
    backlog, want, why = 0, {}, {"tail": 0, "mark_drop": 0, "mark": 0}
    for i in range(N):
        past = backlog + FRAME > MARK
        if backlog + FRAME > BUFFER:
            why["tail"] += 1
        elif past and sent[i] == NOT_ECT:
            why["mark_drop"] += 1
        else:
            marked = past and sent[i] in (ECT0, ECT1)
            want[i], why["mark"], backlog = CE if marked else sent[i], why["mark"] + marked, backlog + FRAME
    assert why["mark_drop"] >= 3 and why["tail"] >= 3 and why["mark"] >= 6  # the run meets each verdict
    rx = receiver(tb)
    try:
        send(tb, rx.getsockname(), sent.get)
        got = tos_of(rx)
    finally:
        rx.close()
    assert got == want, got
    s = tb.stats()["w1"]
    assert {c: s.get(c, {}).get("packets", 0) for c in why} == why
    assert tb.fabric.dropped("w1") == why["tail"] + why["mark_drop"]


def test_no_mark_no_ce(clean):
    """The same overload without a mark: ECN-capable datagrams only meet the drops."""
    tb = clean
    tb.queue(8, buffer=BUFFER, thresholds=[0] * 8, port="w1")
    assert received(tb) == {i: ECT0 for i in (*UNMARKED, *MARKED)}
    assert "mark" not in tb.stats()["w1"]


def test_cli_sets_the_mark(clean):
    """``dblp fault queue --mark`` on a running testbed: the line printed names the mark, the
    port's config holds it, and a mark above the buffer is one line on stderr, nothing changed."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tb = clean
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    def dblp(*args):
        return subprocess.run([sys.executable, "-m", "pydblp.cli", "fault", "queue", "--testbed", tb.name,
                               "--port", "w1", *args], env=env, capture_output=True, text=True, timeout=60)

    r = dblp("--rate", "100mbit", "--buffer", "64k", "--mark", "16k")
    assert r.returncode == 0 and "ECN mark 16k" in r.stdout, r.stderr
    assert tb.stats()["w1"]["config"]["queue"]["mark"] == 16384
    assert "queue" not in tb.stats()["w0"]["config"]
    r = dblp("--rate", "100mbit", "--buffer", "64k", "--mark", "65k")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "above the buffer" in r.stderr
    assert tb.stats()["w1"]["config"]["queue"]["mark"] == 16384
    assert tb.stats()["w1"]["config"]["queue"]["mark_drop"] is False
    r = dblp("--rate", "100mbit", "--buffer", "64k", "--mark", "16k", "--mark-drop")
    assert r.returncode == 0 and "ECN mark 16k (Not-ECT dropped)" in r.stdout, r.stderr
    assert tb.stats()["w1"]["config"]["queue"]["mark_drop"] is True
