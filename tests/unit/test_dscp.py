"""The priority -> DSCP map (pydblp.dscp), and both transports writing it into IP headers."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from pydblp import dscp, wire
from pydblp.collective import Config
from pydblp.transport import frames
from pydblp.transport.base import Batch
from pydblp.transport.udp import UdpTransport


def test_default_map_one_af_class_drop_precedence_by_band():
    d = dscp.resolve("default")
    assert [dscp.name(int(x)) for x in d] == ["AF41", "AF41", "AF41", "AF42", "AF42", "AF42", "AF43", "AF43"]
    assert (np.diff(d[1:].astype(int)) >= 0).all()  # less important: never a lower drop precedence
    assert not dscp.resolve("off").any() and dscp.tos_table("off") is None


def test_maps_by_name_number_and_string_keep_the_rest_default():
    d = dscp.resolve({0: "EF", 7: "cs1", 6: 10})
    assert d[0] == 46 and d[7] == 8 and d[6] == 10 and d[1] == 34
    assert (dscp.resolve("0=EF, 7=CS1,6=10") == d).all()
    t = dscp.tos_table({0: "EF"})
    assert t[0] == 46 << 2 and t[1] == 34 << 2 and t[200] == 46 << 2  # not a priority: control's


@pytest.mark.parametrize("spec, msg", [("loud", "use default, off or PRIO=DSCP"), ({8: 1}, "priority 8"),
                                       ({1: 64}, "DSCP 64"), ({1: "AF51"}, "no DSCP"), (3, "use default")])
def test_bad_maps_say_what_to_give(spec, msg):
    with pytest.raises(ValueError, match=msg):
        dscp.resolve(spec)
    with pytest.raises(ValueError, match=msg):
        Config(dscp=spec).check()


def test_prio_table_inverts_to_the_most_important_priority():
    p = dscp.prio_table("default")
    assert p[34] == 1 and p[36] == 3 and p[38] == 6 and p[0] == 0 and p[46] == 0
    assert dscp.prio_table({0: "EF"})[46] == 0  # control only: never shed


def _frames(v6: bool, n: int):
    """Templates for one peer and ``n`` DATA headers of priorities 0..7 in turn; a builder of
    their frames with a given TOS byte each (None: none)."""
    tp = frames.Templates()
    src, dst = ("2001:db8::1", "2001:db8::2") if v6 else ("198.18.0.1", "198.18.0.2")
    tp.add(*frames.template("02:00:00:00:00:01", "02:00:00:00:00:02", src, dst, 47800, 47800))
    h = np.zeros(n, wire.HEADER_DTYPE)
    h["magic"], h["version"], h["kind"], h["len"], h["nchunks"] = wire.MAGIC, 1, 1, 40, 1
    h["prio"] = np.arange(n) % 8
    return h, lambda tos: frames.build_one(tp, frames.HDR6 if v6 else frames.HDR4, np.zeros(n, np.int64), h,
                                           np.zeros((n, 40), np.uint8), np.full(n, 40), tos=tos)


@pytest.mark.parametrize("v6", [False, True])
def test_frames_carry_the_tos_with_a_valid_ipv4_checksum(v6):
    n = 16
    h, build = _frames(v6, n)
    tos = dscp.tos_table("default")[h["prio"]]
    st, flen = build(tos)
    fam = 6 if v6 else 4
    assert (frames.dscp_of(st, fam) == tos >> 2).all()
    ok, off, _, _ = frames.parse(st, flen)
    assert ok.all()
    if not v6:  # the header checksum still sums to 0xffff
        words = st[:, 14:34].copy().view(">u2").astype(np.uint64).sum(axis=1)
        assert (frames.fold(words) == 0xFFFF).all()
    else:  # the UDP checksum does not cover the traffic class: still valid
        plain, _ = build(None)
        assert (plain[:, 16:] == st[:, 16:]).all() and (plain[:, 15] & 0x0F == st[:, 15] & 0x0F).all()


@pytest.mark.parametrize("v6", [False, True])
def test_the_ecn_field_survives_the_tos_write_and_reads_back(v6):
    """ECT(0) from ``tos_table(ect=True)`` and every ECN codepoint beside a DSCP: written into the
    IPv4 TOS byte (header checksum still right) or the IPv6 traffic class, read back by ``ecn_of``."""
    n = 32
    h, build = _frames(v6, n)
    fam = 6 if v6 else 4
    table = dscp.tos_table("default", ect=True)
    assert (table & 3 == dscp.ECT0).all() and (dscp.tos_table("off", ect=True) == dscp.ECT0).all()
    for tos in (table[h["prio"]], (dscp.tos_table("default")[h["prio"]] | np.arange(n) % 4).astype(np.uint8)):
        st, flen = build(tos)
        assert (frames.ecn_of(st, fam) == tos & 3).all() and (frames.dscp_of(st, fam) == tos >> 2).all()
        assert (frames.ecn_of(st, np.full(n, fam)) == tos & 3).all() and frames.ecn_of(st, fam).dtype == np.uint8
        if not v6:
            words = st[:, 14:34].copy().view(">u2").astype(np.uint64).sum(axis=1)
            assert (frames.fold(words) == 0xFFFF).all()


def _receiver(fam):
    r = socket.socket(fam, socket.SOCK_DGRAM)
    r.bind(("127.0.0.1" if fam == socket.AF_INET else "::1", 0))
    if fam == socket.AF_INET:
        r.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
    else:
        r.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVTCLASS, 1)
    r.settimeout(2)
    return r


@pytest.mark.parametrize("fam", [socket.AF_INET, socket.AF_INET6])
@pytest.mark.parametrize("n", [3, 200])  # one sendmsg each; sendmmsg with GSO runs
@pytest.mark.parametrize("spec", ["default", "off", {0: "EF", 7: "CS1"}])
def test_udp_sets_each_datagrams_dscp_from_its_priority(fam, n, spec):
    r = _receiver(fam)
    want = dscp.resolve(spec)
    with r, UdpTransport(port=0, dscp=spec) as t:
        t.add_peer(r.getsockname()[0], r.getsockname()[1])
        h = np.zeros(n, wire.HEADER_DTYPE)
        h["magic"], h["version"], h["kind"], h["len"], h["nchunks"] = wire.MAGIC, 1, 1, 64, n
        h["chunk"] = np.arange(n)
        h["prio"] = np.random.default_rng(n).integers(0, 8, n)
        assert t.send(Batch.fill(h, np.zeros((n, 64), np.uint8), np.full(n, 64), 0)) == n
        seen = {}
        for _ in range(n):
            data, anc, _, _ = r.recvmsg(2048, 64)
            tos = int.from_bytes(anc[0][2], "little") if anc else 0
            hd = wire.Header.unpack(data)
            seen[hd.chunk] = (hd.prio, tos >> 2)
    assert sorted(seen) == list(range(n))
    assert all(d == want[p] for p, d in seen.values())
