"""The scapy DBLP layer and the packet decoders agree with wire.py."""

from __future__ import annotations

import datetime as dt

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from pydblp import dscp, inspect, wire
from pydblp.wire import Header

KEY = b"secret-key"
MACS = dict(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")  # explicit: no ARP lookups
NAMES = [n for n, _ in wire.FIELDS]

HEADERS = [
    Header(),
    Header(kind=wire.Kind.BITMAP, job=0xFFFFFFFF, round=0xFFFFFFFF, tensor=65535, src=65535, dst=1,
           prio=7, dtype=wire.Dtype.RAW, chunk=2**24 - 1, nchunks=2**24, tol=255, flags=0xFB),
    Header(kind=wire.Kind.STOP, job=42, round=7, tensor=3, src=2, dst=0, prio=0, dtype=wire.Dtype.F16,
           chunk=5, nchunks=6, tol=10, flags=wire.Flag.ALLGATHER),
]


def frame(udp_payload: bytes, sport=40000, dport=wire.DEFAULT_PORT, v6=False) -> Ether:
    """Wire bytes of an Ethernet/IP/UDP frame, dissected again by scapy."""
    ip = IPv6(src="2001:db8::1", dst="2001:db8::2") if v6 else IP(src="198.18.0.1", dst="198.18.0.2")
    return Ether(bytes(Ether(**MACS) / ip / UDP(sport=sport, dport=dport) / Raw(udp_payload)))


def fields_of(layer) -> dict[str, int]:
    return {n: int(getattr(layer, n)) for n in NAMES}


def test_layer_fields_are_wire_fields():
    assert [f.name for f in inspect.DBLP.fields_desc] == NAMES
    assert len(inspect.DBLP()) == wire.HEADER_LEN


@pytest.mark.parametrize("h", HEADERS)
@pytest.mark.parametrize("keyed", [False, True])
def test_scapy_dissects_wire_bytes(h, keyed):
    payload = bytes(range(20))
    buf = wire.encode(h, payload, key=KEY if keyed else None)
    pkt = frame(buf)
    assert inspect.DBLP in pkt
    assert fields_of(pkt[inspect.DBLP]) == {n: getattr(Header.unpack(buf), n) for n in NAMES}
    assert pkt[inspect.DBLP].payload.load == buf[wire.HEADER_LEN:]


@pytest.mark.parametrize("h", HEADERS)
def test_wire_decodes_scapy_packets(h):
    kw = {n: getattr(h, n) for n in NAMES if n != "len"}
    layer = inspect.DBLP(**kw) / Raw(b"gradient")
    pkt = Ether(bytes(Ether(**MACS) / IP() / UDP(sport=1, dport=wire.DEFAULT_PORT) / layer))
    got, payload = wire.decode(bytes(pkt[UDP].payload))
    assert got == h.replace(len=8)   # len computed by the layer from the payload
    assert payload == b"gradient"


def test_wire_decodes_tagged_scapy_packet():
    hdr = bytes(inspect.DBLP(job=9, flags="TAG", len=4))
    signed = hdr + b"abcd" + wire.tag(KEY, hdr + b"abcd")
    auto = bytes(inspect.DBLP(job=9, flags="TAG") / Raw(b"abcd" + wire.tag(KEY, hdr + b"abcd")))
    assert auto == signed  # len counts the payload, not the tag that follows it
    got, payload = wire.decode(auto, key=KEY)
    assert got.flags == wire.Flag.TAG and payload == b"abcd"


def test_layer_symbolic_values():
    pkt = inspect.DBLP(bytes(wire.encode(HEADERS[2])))
    assert pkt.sprintf("%kind% %dtype% %flags%") == "STOP F16 ALLGATHER"


def test_bound_both_directions_and_extra_port():
    buf = wire.encode(Header(job=5))
    assert inspect.DBLP in frame(buf, sport=wire.DEFAULT_PORT, dport=9999)
    assert inspect.DBLP in frame(buf, sport=9999, dport=wire.DEFAULT_PORT)
    assert inspect.DBLP not in frame(buf, sport=9998, dport=9999)
    inspect.bind_port(47911)
    assert inspect.DBLP in frame(buf, sport=1000, dport=47911)
    with pytest.raises(ValueError):
        inspect.bind_port(0)
    with pytest.raises(ValueError):
        inspect.bind_port(70000)


def test_udp_layer_picks_dblp_port_when_building():
    inspect.bind_port(47912)  # extra ports only widen dissection
    assert (UDP() / inspect.DBLP()).dport == wire.DEFAULT_PORT


# ---- summaries ---------------------------------------------------------------------

def test_summary_line():
    h = Header(kind=wire.Kind.DATA, job=77, round=5, tensor=3, src=1, dst=2, prio=4, chunk=9,
               nchunks=1000, flags=wire.Flag.RETX | wire.Flag.ALLGATHER)
    pkt = frame(wire.encode(h, b"x" * 100))
    pkt.time = 1_700_000_000.25
    when = dt.datetime.fromtimestamp(1_700_000_000.25).strftime("%H:%M:%S.%f")
    assert inspect.summary(pkt) == (
        f"{when} 198.18.0.1:40000 > 198.18.0.2:47800 DATA job 77 round 5 tensor 3 rank 1->2 "
        "chunk 9/1000 prio 4 len 100 flags RETX|ALLGATHER")


def test_summary_names_a_broadcast_allgathers_destination_all():
    h = Header(kind=wire.Kind.DATA, job=77, src=1, dst=wire.DST_ALL, nchunks=8, flags=wire.Flag.ALLGATHER)
    assert " rank 1->all chunk 0/8 " in inspect.summary(frame(wire.encode(h, b"x" * 8)))


def test_summary_ipv6_and_tag():
    pkt = frame(wire.encode(Header(kind=wire.Kind.PROBE, job=3), b"", key=KEY), sport=47800, dport=5555, v6=True)
    line = inspect.summary(pkt)
    assert "[2001:db8::1]:47800 > [2001:db8::2]:5555 PROBE job 3 " in line
    assert line.endswith("len 0 flags TAG")


def test_summary_unknown_flag_bits():
    line = inspect.summary(frame(wire.encode(Header(flags=0x81))))
    assert line.endswith("flags RETX|0x80")


@pytest.mark.parametrize("reason,buf", [
    ("short", b"\xdb\x1b"),
    ("magic", b"\x00" * 40),
    ("version", bytes(wire.encode(Header())[:2]) + b"\x02" + wire.encode(Header())[3:]),
    ("length", wire.encode(Header()) + b"extra"),
    ("chunk", wire.encode(Header(chunk=4, nchunks=4))),
    ("job", wire.encode(Header(job=0))),
], ids=lambda v: v if isinstance(v, str) else "")
def test_summary_malformed(reason, buf):
    pkt = frame(buf)
    line = inspect.summary(pkt)
    assert line.endswith(f"198.18.0.2:47800 malformed ({reason}) {len(buf)} bytes")
    assert inspect.describe(pkt).startswith(line)


def test_link_padding_is_not_payload():
    # a 2-byte payload makes a 44-byte frame: Ethernet pads it to 60
    raw = bytes(Ether(**MACS) / IP() / UDP(dport=wire.DEFAULT_PORT) / Raw(b"\xdb\x1b"))
    padded = Ether(raw + b"\x00" * (60 - len(raw)))
    assert inspect.dblp_payload(padded) == b"\xdb\x1b"
    assert "malformed (short) 2 bytes" in inspect.summary(padded)


def test_not_dblp():
    pkt = Ether(bytes(Ether(**MACS) / IP() / UDP(sport=53, dport=53) / Raw(b"q")))
    assert inspect.dblp_payload(pkt) is None
    assert "malformed" not in inspect.summary(pkt) and "UDP" in inspect.summary(pkt)
    assert inspect.describe(pkt) == inspect.summary(pkt)


def test_describe_lists_every_field():
    h = HEADERS[2]
    pkt = frame(wire.encode(h, b"\x01\x02", key=KEY))
    lines = inspect.describe(pkt).splitlines()
    assert lines[0] == inspect.summary(pkt)
    body = {ln.split()[0]: ln.split(None, 1)[1] for ln in lines[1:]}
    assert list(body)[: len(NAMES)] == NAMES
    assert body["magic"] == "0xdb1b"
    assert body["kind"] == "STOP (4)"
    assert body["dtype"] == "F16 (1)"
    assert body["flags"] == "ALLGATHER|TAG (0x06)"
    assert body["chunk"] == "5" and body["nchunks"] == "6" and body["job"] == "42"
    assert body["payload"] == "2 bytes: 0102"
    assert body["tag"] == wire.tag(KEY, wire.encode(h, b"\x01\x02", key=KEY)[:-16]).hex()


def test_describe_malformed_shows_fields_it_can():
    buf = bytes(wire.encode(Header(job=12345))[:3]) + b"\x09" + wire.encode(Header(job=12345))[4:]
    text = inspect.describe(frame(buf))
    assert "malformed (kind)" in text.splitlines()[0]
    assert "    kind     kind9 (9)" in text
    assert "    job      12345" in text


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=96), v6=st.booleans())
def test_decoders_never_raise(data, v6):
    pkt = frame(data, v6=v6)
    line = inspect.summary(pkt)
    reason = wire.validate(data)
    if reason:
        assert f"malformed ({reason.name.lower()})" in line
    else:
        assert "malformed" not in line and f"len {len(data) - 32 - (16 if data[31] & 4 else 0)}" in line
    assert inspect.describe(pkt).startswith(line)


@pytest.mark.parametrize("v6", [False, True])
def test_summary_and_describe_show_the_dscp(v6):
    """The IP header's DSCP, as pydblp.dscp's default map writes it for each class, in both views."""
    table = dscp.tos_table("default")
    for prio, want in ((0, "AF41 (34)"), (1, "AF41 (34)"), (4, "AF42 (36)"), (7, "AF43 (38)")):
        udp = wire.encode(Header(prio=prio, nchunks=8), b"x" * 8)
        ip = IPv6(src="2001:db8::1", dst="2001:db8::2", tc=int(table[prio])) if v6 else \
            IP(src="198.18.0.1", dst="198.18.0.2", tos=int(table[prio]))
        pkt = Ether(bytes(Ether(**MACS) / ip / UDP(sport=40000, dport=wire.DEFAULT_PORT) / Raw(udp)))
        line = inspect.summary(pkt)
        assert line.endswith(f"prio {prio} len 8 flags - dscp {want.split()[0]}")
        body = {ln.split()[0]: ln.split(None, 1)[1] for ln in inspect.describe(pkt).splitlines()[1:]}
        assert body["dscp"] == want


def test_summary_leaves_out_best_effort_but_describe_shows_it():
    pkt = frame(wire.encode(Header(nchunks=8), b"x" * 8))
    assert "dscp" not in inspect.summary(pkt)
    assert "    dscp     BE (0)" in inspect.describe(pkt).splitlines()


@pytest.mark.parametrize("v6", [False, True])
def test_summary_and_describe_show_the_ecn(v6):
    """The IP header's ECN field: in the line when not Not-ECT (after the DSCP), in -v always."""
    for ecn, name in ((0, "Not-ECT"), (1, "ECT1"), (2, "ECT0"), (3, "CE")):
        for ds in (0, 34):  # best effort, AF41
            tc = ds << 2 | ecn
            udp = wire.encode(Header(prio=1, nchunks=8), b"x" * 8)
            ip = IPv6(src="2001:db8::1", dst="2001:db8::2", tc=tc) if v6 else \
                IP(src="198.18.0.1", dst="198.18.0.2", tos=tc)
            pkt = Ether(bytes(Ether(**MACS) / ip / UDP(sport=40000, dport=wire.DEFAULT_PORT) / Raw(udp)))
            line = inspect.summary(pkt)
            tail = "flags -" + (" dscp AF41" if ds else "") + (f" ecn {name}" if ecn else "")
            assert line.endswith(tail), line
            assert inspect.ecn_of(pkt) == ecn
            body = {ln.split()[0]: ln.split(None, 1)[1] for ln in inspect.describe(pkt).splitlines()[1:]}
            assert body["ecn"] == f"{name} ({ecn})"
            assert body["dscp"] == ("AF41 (34)" if ds else "BE (0)")  # the ECN bits are not the DSCP's


def test_summary_puts_the_ecn_before_the_tag_verdict():
    udp = wire.encode(Header(nchunks=8), b"x" * 8, key=KEY)
    pkt = Ether(bytes(Ether(**MACS) / IP(src="198.18.0.1", dst="198.18.0.2", tos=3) /
                      UDP(sport=40000, dport=wire.DEFAULT_PORT) / Raw(udp)))
    assert inspect.summary(pkt, key=KEY).endswith("flags TAG ecn CE tag valid (epoch 0x00000000)")


def stop_body(pkt) -> dict[str, str]:
    return {ln.split()[0]: ln.split(None, 1)[1] for ln in inspect.describe(pkt).splitlines()[1:]}


@pytest.mark.parametrize("keyed", [False, True])
def test_describe_decodes_a_stop(keyed):
    """A STOP's payload: the probe-timeout estimate (100 us units); from 10 bytes on, the echo of
    DATA received from the STOP's destination and how many arrived CE (!HII).  A 2-byte STOP
    (older senders) has no echo; a tag is not payload."""
    key = KEY if keyed else None
    stop = Header(kind=wire.Kind.STOP, job=42, src=2, dst=0, nchunks=6)
    old = stop_body(frame(wire.encode(stop, (258).to_bytes(2, "big"), key=key)))
    assert old["estimate"] == "258 (25.8 ms)" and "echo" not in old
    new = stop_body(frame(wire.encode(stop, bytes.fromhex("000c") + (2**32 - 1).to_bytes(4, "big")
                                      + (37).to_bytes(4, "big"), key=key)))
    assert new["estimate"] == "12 (1.2 ms)" and new["echo"] == "rx 4294967295 ce 37"
    assert new["payload"].startswith("10 bytes: ")
    lines = inspect.describe(frame(wire.encode(stop, bytes(10), key=key))).splitlines()
    assert [ln.split()[0] for ln in lines[-4 if keyed else -3:]] == ["payload", "estimate", "echo"] + \
        (["tag"] if keyed else [])


@pytest.mark.parametrize("keyed", [False, True])
def test_describe_decodes_a_hello(keyed):
    """A HELLO's payload (!QI): its number and the ms its sender has been out of rounds (0: an
    answer on behalf of a busy rank, from a rank in the round; with flag ASK: an ask); one too
    short for them shows only its bytes."""
    key = KEY if keyed else None
    hello = Header(kind=wire.Kind.HELLO, job=42, round=7, src=1, dst=0, nchunks=1)
    body = stop_body(frame(wire.encode(hello, wire.HELLO_PAYLOAD.pack(2**40 + 3, 5250), key=key)))
    assert body["kind"] == "HELLO (5)" and body["hello"] == f"number {2**40 + 3}, out of rounds 5250 ms"
    assert "estimate" not in body
    assert "hello" not in stop_body(frame(wire.encode(hello, bytes(11), key=key)))
    behalf = stop_body(frame(wire.encode(hello, wire.HELLO_PAYLOAD.pack(9, 0), key=key)))
    assert behalf["hello"] == "number 9, in the round, on behalf of a busy one"
    ask = Header(kind=wire.Kind.HELLO, job=42, round=7, src=1, dst=0, nchunks=1, flags=wire.Flag.ASK)
    assert stop_body(frame(wire.encode(ask, wire.HELLO_PAYLOAD.pack(10, 0), key=key)))["hello"] == "number 10, asks"


def test_describe_decodes_only_stop_payloads():
    for kind, payload in ((wire.Kind.DATA, bytes(10)), (wire.Kind.BITMAP, b"\xff" * 10)):
        body = stop_body(frame(wire.encode(Header(kind=kind, nchunks=80), payload)))
        assert "estimate" not in body and "echo" not in body
    body = stop_body(frame(wire.encode(Header(kind=wire.Kind.STOP), b"\x01")))  # too short for an estimate
    assert "estimate" not in body and "echo" not in body
