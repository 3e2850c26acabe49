"""`dblp dump` on pcap files the test writes, and its usage errors."""

from __future__ import annotations

import datetime as dt
import shutil
from pathlib import Path

import pytest
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.packet import Raw
from scapy.utils import rdpcap, wrpcap

from pydblp import cli, wire
from pydblp.wire import Header, Kind

KEY = b"k3y"
MACS = dict(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
T0 = 1_700_000_000.0


def when(i: int) -> str:
    return dt.datetime.fromtimestamp(T0 + i / 10).strftime("%H:%M:%S.%f")


def v4(payload: bytes, sport=40000, dport=wire.DEFAULT_PORT):
    return Ether(**MACS) / IP(src="198.18.0.1", dst="198.18.0.2") / UDP(sport=sport, dport=dport) / Raw(payload)


def v6(payload: bytes, sport=wire.DEFAULT_PORT, dport=40001):
    return Ether(**MACS) / IPv6(src="2001:db8::2", dst="2001:db8::1") / UDP(sport=sport, dport=dport) / Raw(payload)


# (frame, expected line without the time)
CASES = [
    (v4(wire.encode(Header(kind=Kind.DATA, job=77, round=5, tensor=3, src=1, dst=2, prio=4, chunk=0,
                           nchunks=2, dtype=wire.Dtype.BF16), b"a" * 64)),
     "198.18.0.1:40000 > 198.18.0.2:47800 DATA job 77 round 5 tensor 3 rank 1->2 chunk 0/2 prio 4 len 64 flags -"),
    (v4(wire.encode(Header(kind=Kind.DATA, job=77, round=5, tensor=3, src=1, dst=2, prio=4, chunk=1,
                           nchunks=2, flags=wire.Flag.RETX), b"b" * 10, key=KEY)),
     "198.18.0.1:40000 > 198.18.0.2:47800 DATA job 77 round 5 tensor 3 rank 1->2 chunk 1/2 prio 4 len 10 "
     "flags RETX|TAG"),
    (v6(wire.encode(Header(kind=Kind.BITMAP, job=77, round=5, tensor=3, src=2, dst=1, chunk=0, nchunks=2),
                    b"\x03")),
     "[2001:db8::2]:47800 > [2001:db8::1]:40001 BITMAP job 77 round 5 tensor 3 rank 2->1 chunk 0/2 prio 0 len 1 "
     "flags -"),
    (v4(b"\xdb\x1b\x07" + bytes(29)),
     "198.18.0.1:40000 > 198.18.0.2:47800 malformed (version) 32 bytes"),
    (v4(b"not dblp", dport=53), None),  # hidden without an expression
    (v4(wire.encode(Header(kind=Kind.STOP, job=8)), dport=47801),
     "198.18.0.1:40000 > 198.18.0.2:47801 STOP job 8 round 0 tensor 0 rank 0->0 chunk 0/1 prio 0 len 0 flags -"),
]


@pytest.fixture
def pcap(tmp_path):
    frames = []
    for i, (f, _) in enumerate(CASES):
        f.time = T0 + i / 10
        frames.append(f)
    path = tmp_path / "trace.pcap"
    wrpcap(str(path), frames)
    return path


def expected(*idx: int) -> list[str]:
    return [f"{when(i)} {CASES[i][1]}" for i in idx]


def dump(capsys, *argv) -> tuple[int, list[str], list[str]]:
    rc = cli.main(["dump", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err.splitlines()


def test_read_pcap_default_port(pcap, capsys):
    rc, out, err = dump(capsys, "-r", pcap)
    assert (rc, err) == (0, [])
    assert out == expected(0, 1, 2, 3)


def test_count(pcap, capsys):
    rc, out, _ = dump(capsys, "-r", pcap, "-c", 2)
    assert rc == 0 and out == expected(0, 1)


def test_other_port(pcap, capsys):
    rc, out, _ = dump(capsys, "-r", pcap, "--port", 47801)
    assert rc == 0 and out == expected(5)
    rc, out, _ = dump(capsys, "-r", pcap, "--port", 47800, "--port", 47801)
    assert rc == 0 and out == expected(0, 1, 2, 3, 5)


def test_verbose_shows_fields(pcap, capsys):
    rc, out, _ = dump(capsys, "-r", pcap, "-v", "-c", 2)
    assert rc == 0
    assert out[0] == expected(0)[0]
    assert "    magic    0xdb1b" in out
    assert "    dtype    BF16 (2)" in out
    assert "    job      77" in out
    assert "    payload  64 bytes: " + (b"a" * 16).hex() + "..." in out
    assert expected(1)[0] in out
    assert "    flags    RETX|TAG (0x05)" in out
    assert [line for line in out if line.startswith("    tag ")] == ["    tag      " + CASES[1][0][Raw].load[-16:].hex()]


needs_tcpdump = pytest.mark.skipif(shutil.which("tcpdump") is None, reason="tcpdump not installed (BPF filters on pcap files)")


@needs_tcpdump
def test_filter_expression(pcap, capsys):
    rc, out, _ = dump(capsys, "-r", pcap, "ip6")
    assert rc == 0 and out == expected(2)
    # an expression replaces the default: non-DBLP packets show with scapy's summary
    rc, out, _ = dump(capsys, "-r", pcap, "udp", "port", "53")
    assert rc == 0 and len(out) == 1 and out[0].startswith(when(4)) and "malformed" not in out[0]


@needs_tcpdump
def test_write_pcap(pcap, tmp_path, capsys):
    out_path = tmp_path / "out.pcap"
    rc, out, _ = dump(capsys, "-r", pcap, "-w", out_path, "udp dst port 47800")
    assert rc == 0 and out == expected(0, 1, 3)
    written = rdpcap(str(out_path))
    assert [bytes(p) for p in written] == [bytes(CASES[i][0]) for i in (0, 1, 3)]


def test_a_failed_dump_leaves_its_w_file_as_it_was(pcap, tmp_path, capsys):
    """-w replaces its file only when the dump ends well: a missing or unreadable input, or -w
    naming the -r file, leaves an existing capture untouched, each with one line; a dump that
    matches nothing writes an empty capture, with no warning."""
    keep = tmp_path / "keep.pcap"
    keep.write_bytes(Path(pcap).read_bytes())
    before = keep.read_bytes()
    notpcap = tmp_path / "notpcap.txt"
    notpcap.write_text("hello\n" * 10)
    for argv, says in ((["-r", str(tmp_path / "missing.pcap")], "no such file"),
                       (["-r", str(notpcap)], "not a capture file"),
                       (["-r", str(keep)], "is the file -r reads")):
        rc, out, err = dump(capsys, *argv, "-w", keep)
        assert rc == 2 and len(err) == 1 and says in err[0], err
        assert keep.read_bytes() == before
    assert not list(tmp_path.glob("*.part"))  # (nothing left beside it)
    empty = tmp_path / "empty.pcap"
    rc, out, err = dump(capsys, "-r", pcap, "-w", empty, "--port", "9")
    assert rc == 0 and out == [] and err == [] and len(rdpcap(str(empty))) == 0


def test_top_level_help_has_examples(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "dblp dump -r" in out


def test_every_help_renders_percent_signs_once(capsys):
    """argparse %-formats argument help but not descriptions: no '%%' may reach the user."""
    import argparse

    def walk(parser, path):
        yield path
        for act in parser._actions:
            if isinstance(act, argparse._SubParsersAction):
                for name, sub in act.choices.items():
                    yield from walk(sub, path + [name])

    paths = list(walk(cli.build_parser(), []))
    assert ["experiment"] in paths
    for path in paths:
        with pytest.raises(SystemExit):
            cli.main(path + ["--help"])
        out = capsys.readouterr().out
        assert "%%" not in out, path


def test_dump_help_has_examples(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["dump", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out
    for usage in ("dblp dump -r trace.pcap", "--netns", "-w ", "-c ", "--port", "EXPRESSION"):
        assert usage in out


@pytest.mark.parametrize("argv,msg", [
    ([], "give -r FILE or -i IFACE"),
    (["-r", "/nonexistent/x.pcap"], "no such file"),
    (["-r", "{notpcap}"], "not a capture file"),
    (["-r", "{pcap}", "--netns", "w0"], "--netns needs -i"),
    (["-r", "{pcap}", "--timeout", "1"], "--timeout applies to live capture"),
    (["-r", "{pcap}", "-c", "-1"], "-c COUNT must be >= 0"),
    (["-r", "{pcap}", "--port", "0"], "out of range"),
    (["-r", "{pcap}", "-w", "/nonexistent/dir/out.pcap"], "cannot write"),
    (["-r", "{pcap}", "udp prt 5"], "bad filter"),
    (["-i", "dblp-no-such0", "-c", "1"], "dblp-no-such0"),
    (["-i", "lo", "--netns", "dblp-no-such-ns", "-c", "1"], "dblp-no-such-ns"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_usage_errors_are_one_line(argv, msg, pcap, tmp_path, capsys):
    notpcap = tmp_path / "notpcap.txt"
    notpcap.write_text("hello\n" * 10)
    argv = [a.format(pcap=pcap, notpcap=notpcap) for a in argv]
    rc, out, err = dump(capsys, *argv)
    assert rc == 2
    assert out == []
    assert len(err) == 1 and err[0].startswith("dblp dump: ") and msg in err[0], err


def test_conflicting_sources_is_a_usage_error(pcap, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["dump", "-r", str(pcap), "-i", "lo"])
    assert e.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


def test_key_file_marks_each_tag(tmp_path, capsys):
    """With the job key each packet's line ends with its tag's verdict: valid (and the run epoch
    it names), INVALID (another key, an altered byte, an epoch rewritten), or untagged."""
    key = bytes(range(32))
    good = wire.encode(Header(job=5, src=1, dst=0, nchunks=3), b"g" * 40, key=key, epoch=0xABCD)
    altered = good[:40] + b"G" + good[41:]
    other_run = good[:-16] + (0xABCE).to_bytes(4, "big") + good[-12:]
    frames = [v4(good), v4(wire.encode(Header(job=5), b"o" * 8, key=b"x" * 32)), v4(altered), v4(other_run),
              v4(wire.encode(Header(job=5), b"u"))]
    path, kf = tmp_path / "t.pcap", tmp_path / "job.key"
    wrpcap(str(path), frames)
    kf.write_bytes(key)
    rc, out, err = dump(capsys, "-r", path, "--key-file", kf)
    assert (rc, err) == (0, [])
    assert [line.split(" flags ")[1] for line in out] == [
        "TAG tag valid (epoch 0x0000abcd)", "TAG tag INVALID", "TAG tag INVALID", "TAG tag INVALID", "- untagged"]
    rc, out, _ = dump(capsys, "-r", path, "-v", "-c", 1, "--key-file", kf)
    assert rc == 0 and out[0].endswith("tag valid (epoch 0x0000abcd)")
    rc, out, err = dump(capsys, "-r", path)  # without a key: no verdicts
    assert rc == 0 and not any("valid" in line or "untagged" in line for line in out)
    kf.write_bytes(b"short")
    rc, out, err = dump(capsys, "-r", path, "--key-file", kf)
    assert rc == 2 and len(err) == 1 and "holds 5 bytes" in err[0] and "head -c 32 /dev/urandom" in err[0]


def test_verbose_shows_ecn_and_a_stops_echo(tmp_path, capsys):
    """A CE-marked DATA frame and a STOP echoing what arrived (rx, ce), as ``dblp dump -v`` shows them."""
    data = Ether(**MACS) / IP(src="198.18.0.1", dst="198.18.0.2", tos=(34 << 2) | 3) / \
        UDP(sport=40000, dport=wire.DEFAULT_PORT) / Raw(wire.encode(Header(job=7, nchunks=2), b"d" * 8))
    stop = v4(wire.encode(Header(kind=Kind.STOP, job=7, src=1, dst=0, nchunks=2),
                          bytes.fromhex("0032") + (1000).to_bytes(4, "big") + (25).to_bytes(4, "big")))
    path = tmp_path / "ecn.pcap"
    wrpcap(str(path), [data, stop])
    rc, out, err = dump(capsys, "-r", path)
    assert (rc, err) == (0, [])
    assert out[0].endswith("flags - dscp AF41 ecn CE") and out[1].endswith("flags -")
    rc, out, err = dump(capsys, "-r", path, "-v")
    assert (rc, err) == (0, [])
    assert "    ecn      CE (3)" in out and "    ecn      Not-ECT (0)" in out
    assert "    estimate 50 (5 ms)" in out and "    echo     rx 1000 ce 25" in out
