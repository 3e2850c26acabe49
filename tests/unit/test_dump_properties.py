"""Property tests of `dblp dump -r FILE.pcap` on arbitrary captures.

The captures are written here byte by byte (scapy's writer cannot record a frame cut shorter
than it was on the wire): any link type scapy reads (Ethernet, raw IP, Linux cooked) or one it
does not know, micro- or nanosecond timestamps of any value, either byte order, and frames of
random bytes (0..1600), or IPv4/IPv6 UDP datagrams to, from or past the DBLP port(s) carrying
arbitrary bytes, cut DBLP headers, headers of any field values (a lying ``len`` too), packets
tagged with the job key, another key or altered, UDP lengths that lie, link padding, each
captured whole or cut short (snaplen); the file itself whole or cut anywhere past its global
header (a capture still being written).

Properties, plain, with ``-v`` and with ``--key-file``: the command exits 0 and never raises;
it prints exactly one line per frame to or from a DBLP port (``-v``: that line, then indented
field lines), in order, each starting with the frame's time; a DBLP datagram's line says
``malformed (<reason>) <n> bytes`` exactly when :func:`pydblp.wire.validate` rejects what was
captured of it, and with the key ends with the tag's verdict.  Frames on other ports are
hidden (there is no summary line).

A file that is not a capture, or whose global header is cut: exit status 2, one line on stderr
naming the file and what is wrong, nothing on stdout, no traceback (run as a process, so
everything scapy itself logs to stderr counts too).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import gzip
import io
import os
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import CookedLinux, Ether

from pydblp import cli, wire
from tests.unit.test_cli_dump import MACS

SETTINGS = settings(max_examples=100, deadline=None, derandomize=True)
KEY, OTHER = bytes(range(32)), b"o" * 32
PORT, PORT2 = wire.DEFAULT_PORT, wire.DEFAULT_PORT + 1
MAX32 = 0xFFFFFFFF
ETHER, RAW_IP, SLL, UNKNOWN = 1, 101, 113, 0xFFFF
LINK_HEADER = {ETHER: 14, RAW_IP: 0, SLL: 16}

# ---- frames ------------------------------------------------------------------------


def stretch(seed: bytes, n: int) -> bytes:
    """``n`` bytes repeating ``seed`` (hypothesis draws a few, a frame needs up to 1600)."""
    seed = seed or b"\x00"
    return (seed * (n // len(seed) + 1))[:n]


any_headers = st.builds(
    wire.Header,
    kind=st.integers(0, 7), job=st.one_of(st.integers(0, 3), st.integers(0, MAX32)),
    round=st.integers(0, MAX32), tensor=st.integers(0, 0xFFFF), src=st.integers(0, 0xFFFF),
    dst=st.one_of(st.integers(0, 3), st.just(wire.DST_ALL), st.integers(0, 0xFFFF)), prio=st.integers(0, 0xFF),
    dtype=st.integers(0, 0xFF), chunk=st.one_of(st.integers(0, 3), st.integers(0, MAX32)),
    nchunks=st.one_of(st.integers(0, 4), st.sampled_from([wire.MAX_NCHUNKS, wire.MAX_NCHUNKS + 1]),
                      st.integers(0, MAX32)),
    tol=st.integers(0, 0xFF), flags=st.integers(0, 0xFF),
)
# headers that pass every check but the length (set by encode, or made to lie)
valid_headers = st.builds(
    lambda h, chunk: h.replace(chunk=chunk % h.nchunks),
    st.builds(wire.Header, kind=st.sampled_from(list(wire.Kind)), job=st.integers(1, MAX32),
              round=st.integers(0, MAX32), tensor=st.integers(0, 0xFFFF), src=st.integers(0, 0xFFFF),
              dst=st.integers(0, 0xFFFF), prio=st.integers(0, 0xFF), dtype=st.integers(0, 0xFF),
              nchunks=st.integers(1, wire.MAX_NCHUNKS), tol=st.integers(0, 0xFF), flags=st.integers(0, 0xFF)),
    st.integers(0, MAX32))
headers = st.one_of(valid_headers, any_headers)


@st.composite
def dblp_payloads(draw) -> bytes:
    """A UDP payload for the DBLP port: arbitrary bytes, a cut header, a packet (any field
    values) untagged, tagged with the key, another key or another run's, altered, or whose
    ``len`` lies."""
    how = draw(st.sampled_from(["bytes", "cut", "packet", "tagged", "other_key", "altered", "lying_len"]))
    body = stretch(draw(st.binary(max_size=16)), draw(st.one_of(st.integers(0, 80), st.integers(0, 1400))))
    if how == "bytes":
        return body
    h = draw(headers)
    if how == "cut":
        return h.pack()[: draw(st.integers(0, wire.HEADER_LEN - 1))]
    if how == "packet":
        return wire.encode(h, body)
    key = OTHER if how == "other_key" else KEY
    pkt = bytearray(wire.encode(h, body, key=key, epoch=draw(st.integers(0, MAX32))))
    if how == "altered":
        pkt[draw(st.integers(0, len(pkt) - 1))] ^= 1 << draw(st.integers(0, 7))
    if how == "lying_len":
        struct.pack_into("!H", pkt, 28, draw(st.integers(0, 0xFFFF)))
    return bytes(pkt)


@st.composite
def udp_frames(draw, link: int) -> dict:
    """A UDP datagram over IPv4 or IPv6 on ``link``, to or from a DBLP port (or not)."""
    v6 = draw(st.booleans())
    ports = st.one_of(st.just(PORT), st.just(PORT2), st.integers(1, 0xFFFF))
    sport, dport = draw(st.one_of(st.tuples(st.integers(1, 0xFFFF), ports), st.tuples(ports, st.integers(1, 0xFFFF))))
    payload = draw(dblp_payloads())
    udp_len = draw(st.one_of(st.none(), st.none(), st.integers(0, 0xFFFF)))  # (a lie)
    ip = IPv6(src="2001:db8::2", dst="2001:db8::1") if v6 else IP(src="198.18.0.1", dst="198.18.0.2")
    pkt = ip / UDP(sport=sport, dport=dport, len=udp_len) / payload
    if link == ETHER:
        pkt = Ether(**MACS) / pkt
    elif link == SLL:
        pkt = CookedLinux(pkttype=0, lladdrtype=1, lladdrlen=6, proto=0x86DD if v6 else 0x0800) / pkt
    data = bytes(pkt)
    head = LINK_HEADER[link] + (40 if v6 else 20) + 8
    pad = stretch(draw(st.binary(max_size=4)), draw(st.sampled_from([0, 0, 0, 6, 30])))  # link padding
    return dict(data=data + pad, head=head, sport=sport, dport=dport, payload=payload, udp_len=udp_len)


@st.composite
def captures(draw) -> dict:
    """A capture file: link type, byte order, time resolution, snaplen, where it is cut (None:
    whole), whether dump is given a second DBLP port, and its frames (each: its bytes, how many
    of them were captured, its time in seconds and fraction, and for a datagram built here its
    headers' length, ports, UDP payload and lying UDP length)."""
    link = draw(st.sampled_from([ETHER, ETHER, RAW_IP, SLL, UNKNOWN]))
    frames = []
    for _ in range(draw(st.integers(0, 8))):
        if link in LINK_HEADER and draw(st.integers(0, 3)):
            f = draw(udp_frames(link))
        else:  # random bytes
            f = dict(data=stretch(draw(st.binary(max_size=64)), draw(st.integers(0, 1600))), head=None)
        n = len(f["data"])
        f["caplen"] = draw(st.one_of(st.just(n), st.just(n), st.integers(0, n)))  # snaplen: cut short
        f["sec"] = draw(st.one_of(st.integers(1_600_000_000, 1_800_000_000), st.integers(0, MAX32)))
        f["frac"] = draw(st.one_of(st.integers(0, 999_999), st.integers(0, MAX32)))
        frames.append(f)
    return dict(link=link, frames=frames, nano=draw(st.booleans()), big=draw(st.booleans()),
                snaplen=draw(st.one_of(st.just(65535), st.integers(0, MAX32))),
                cut=draw(st.one_of(st.none(), st.none(), st.integers(0, 1 << 20))),  # (the file, mod its size)
                two_ports=draw(st.booleans()))


def write_pcap(path: str, cap: dict) -> list[dict]:
    """Write ``cap``; the frames a reader finds in the file (all, or with ``cap["cut"]`` the file
    is cut short as a capture still being written is: those whose record header is in, the last
    one's bytes as far as they go)."""
    e = ">" if cap["big"] else "<"
    out = [struct.pack(e + "IHHiIII", 0xA1B23C4D if cap["nano"] else 0xA1B2C3D4, 2, 4, 0, 0, cap["snaplen"],
                       cap["link"])]
    at, found = 24, []
    for f in cap["frames"]:
        out.append(struct.pack(e + "IIII", f["sec"], f["frac"], f["caplen"], len(f["data"])))
        out.append(f["data"][: f["caplen"]])
        found.append((at + 16, f))
        at += 16 + f["caplen"]
    data = b"".join(out)
    if cap["cut"] is not None:
        data = data[: 24 + cap["cut"] % (len(data) - 24 + 1)]
        found = [(start, dict(f, caplen=min(f["caplen"], len(data) - start))) for start, f in found
                 if start <= len(data)]
    with open(path, "wb") as fh:
        fh.write(data)
    return [f for _, f in found]


# ---- what the dump must print ------------------------------------------------------

def when(f: dict, nano: bool) -> str:
    """The frame's time as dump prints it (scapy's PcapReader sums seconds and fraction as decimals)."""
    t = Decimal(f["sec"]) + Decimal(10) ** Decimal(-9 if nano else -6) * Decimal(f["frac"])
    return dt.datetime.fromtimestamp(float(t)).strftime("%H:%M:%S.%f")


def on_dblp_port(cap: dict, f: dict, ports: set) -> bool:
    """Whether dump shows the frame: scapy dissects a UDP header to or from one of ``ports``."""
    if f["head"] is not None and f["caplen"] >= f["head"]:  # a datagram built here, its headers captured
        return f["sport"] in ports or f["dport"] in ports
    from scapy.config import conf

    cls = conf.l2types.num2layer.get(cap["link"])
    if cls is None:
        return False
    try:
        pkt = cls(f["data"][: f["caplen"]])
    except Exception:  # (scapy's reader then gives the frame as raw bytes)
        return False
    return UDP in pkt and (pkt[UDP].sport in ports or pkt[UDP].dport in ports)


def captured_payload(f: dict) -> bytes | None:
    """What dump judges of a datagram built here, whose UDP length does not lie: the payload
    bytes captured (None: it cannot be told without dissecting)."""
    if f["head"] is None or f["udp_len"] is not None or f["caplen"] < f["head"]:
        return None
    return f["payload"][: f["caplen"] - f["head"]]


def dump(*argv) -> tuple[int, list[str]]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["dump", *map(str, argv)])
    assert "Traceback" not in err.getvalue()
    return rc, out.getvalue().splitlines()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("dump_properties")
    (d / "job.key").write_bytes(KEY)
    (d / "job.key").chmod(0o600)
    return d


# ---- properties --------------------------------------------------------------------

def _frame(payload: bytes, caplen: int | None = None, **kw) -> dict:
    """A datagram to the DBLP port on Ethernet (an explicit example's frame)."""
    data = bytes(Ether(**MACS) / IP(src="198.18.0.1", dst="198.18.0.2") / UDP(sport=40000, dport=PORT) / payload)
    f = dict(data=data, head=42, sport=40000, dport=PORT, payload=payload, udp_len=None,
             caplen=len(data) if caplen is None else caplen, sec=1_700_000_000, frac=0)
    f.update(kw)
    return f


_GOOD = wire.encode(wire.Header(kind=wire.Kind.DATA, job=5, src=1, nchunks=2), b"x" * 40, key=KEY, epoch=7)
_CAP = dict(link=ETHER, nano=False, big=False, snaplen=65535, two_ports=False, cut=None)


@SETTINGS
@given(cap=captures(), keyed=st.booleans())
# a tagged packet whole, cut inside its tag, cut inside its header; a frame cut inside its UDP header
@example(cap=dict(_CAP, frames=[_frame(_GOOD), _frame(_GOOD, caplen=42 + len(_GOOD) - 5), _frame(_GOOD, caplen=50),
                                _frame(_GOOD, caplen=38)]), keyed=True)
def test_dump_prints_one_line_per_dblp_frame_and_never_fails(cap, keyed, workdir):
    path = workdir / "trace.pcap"
    frames = write_pcap(str(path), cap)
    ports = {PORT, PORT2} if cap["two_ports"] else {PORT}
    argv = ["-r", path] + (["--port", PORT, "--port", PORT2] if cap["two_ports"] else [])
    argv += ["--key-file", workdir / "job.key"] if keyed else []
    shown = [f for f in frames if on_dblp_port(cap, f, ports)]
    times = [when(f, cap["nano"]) for f in shown]
    for verbose in (False, True):
        rc, out = dump(*argv, *(["-v"] if verbose else []))
        assert rc == 0
        lines = [line for line in out if not line.startswith("    ")]  # -v: the fields are indented
        assert len(lines) == len(shown), (lines, len(shown))
        assert [line.split(" ", 1)[0] for line in lines] == times
        assert verbose or len(out) == len(shown)
        for f, line in zip(shown, lines):
            data = captured_payload(f)
            if data is None:
                continue
            reason = wire.validate(data)
            if reason:
                assert line.endswith(f" malformed ({reason.name.lower()}) {len(data)} bytes"), line
                continue
            h = wire.Header.unpack(data)
            assert "malformed" not in line and f" len {h.len} flags " in line, line
            if keyed:
                verdict = ("untagged" if not h.flags & wire.Flag.TAG
                           else f"tag valid (epoch {wire.tag_epoch(data[-wire.TAG_LEN:]):#010x})"
                           if wire.validate(data, key=KEY) is wire.Reason.OK else "tag INVALID")
                assert line.endswith(" " + verdict), line
            else:
                assert not line.endswith(("untagged", "INVALID", ")")), line  # no verdict without the key


# ---- files that are no capture -----------------------------------------------------

_GH = struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, ETHER)  # a pcap global header (24 bytes)
_GH_BE_NS = struct.pack(">IHHiIII", 0xA1B23C4D, 2, 4, 0, 0, 65535, ETHER)
_SHB = struct.pack("<IIIHHqI", 0x0A0D0D0A, 28, 0x1A2B3C4D, 1, 0, -1, 28)  # a pcapng section header block

NOT_CAPTURES = {
    "empty": b"",
    "text": b"hello\n" * 10,
    "pcap_magic_only": _GH[:4],
    "pcap_header_cut_at_10": _GH[:10],
    "pcap_header_cut_at_23": _GH[:23],
    "pcap_big_endian_nanosecond_header_cut": _GH_BE_NS[:20],
    "gzip_cut": gzip.compress(_GH + bytes(100))[:12],
    "gzip_of_a_cut_pcap_header": gzip.compress(_GH[:10]),
    "gzip_corrupt": gzip.compress(_GH + bytes(100))[:10] + b"\xff" * 40,
    "pcapng_header_cut": _SHB[:12],
    "pcapng_bad_block_length": _SHB[:4] + struct.pack("<I", 5) + _SHB[8:],
}


@pytest.fixture(scope="module")
def not_capture_runs(tmp_path_factory):
    """``dblp dump -r FILE`` as a process on each of NOT_CAPTURES (in parallel: each loads scapy)."""
    d = tmp_path_factory.mktemp("not_captures")
    for name, data in NOT_CAPTURES.items():
        (d / f"{name}.pcap").write_bytes(data)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # what a user sees (Python's defaults)

    def run(name):
        return subprocess.run([sys.executable, "-m", "pydblp.cli", "dump", "-r", str(d / f"{name}.pcap")],
                              capture_output=True, text=True, timeout=60, env=env)

    with ThreadPoolExecutor(4) as pool:
        return dict(zip(NOT_CAPTURES, pool.map(run, NOT_CAPTURES)))


@pytest.mark.parametrize("name", list(NOT_CAPTURES))
def test_a_file_that_is_no_capture_is_one_line_on_stderr(name, not_capture_runs):
    r = not_capture_runs[name]
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 2 and r.stdout == ""
    err = r.stderr.splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("dblp dump: ") and f"{name}.pcap: not a capture file" in err[0], err
