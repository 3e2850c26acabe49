"""The host program on a real veth in native mode, driven through the CLI."""

from __future__ import annotations

import random
import socket
import struct

import pytest

from pydblp import bpf, cli, host, net, wire
from tests.helpers import poll_until

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns]

A, B = "198.18.7.1", "198.18.7.2"
PORT = wire.DEFAULT_PORT


@pytest.fixture
def pair(netns, bpf_xdp):
    """Namespaces a and b joined by veth va <-> vb, 198.18.7.0/24, no route out."""
    a, b = netns("a"), netns("b")
    with net.ipr(a) as ip:
        ip.link("add", ifname="va", kind="veth", peer={"ifname": "vb", "net_ns_fd": b})
    for ns, ifname, addr in ((a, "va", A), (b, "vb", B)):
        with net.ipr(ns) as ip:
            idx = ip.link_lookup(ifname=ifname)[0]
            ip.addr("add", index=idx, address=addr, prefixlen=24)
            ip.link("set", index=idx, state="up")
            ip.link("set", index=ip.link_lookup(ifname="lo")[0], state="up")
    # static ARP entries: a burst must not wait on (and overflow) ARP resolution
    macs = {}
    for ns, ifname in ((a, "va"), (b, "vb")):
        with net.ipr(ns) as ip:
            macs[ns] = ip.get_links(ip.link_lookup(ifname=ifname)[0])[0].get_attr("IFLA_ADDRESS")
    for ns, ifname, peer_ns, peer_addr in ((a, "va", b, B), (b, "vb", a, A)):
        with net.ipr(ns) as ip:
            ip.neigh("add", dst=peer_addr, lladdr=macs[peer_ns], ifindex=ip.link_lookup(ifname=ifname)[0],
                     state=0x80)  # NUD_PERMANENT
    yield a, b
    for ns, ifname in ((a, "va"), (b, "vb")):
        if host.attached_program(ifname, ns):
            host.unload(ifname, ns)


def udp_socket(ns: str, bind: tuple | None = None) -> socket.socket:
    with net.in_netns(ns):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if bind:
        # Room for a step of 50 datagrams: under native XDP a veth receives each into a page of
        # its own (Linux 6.1: ~4.3 KB of truesize each), so 50 overflow the default 208 KB.
        s.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), 1 << 20)
        s.bind(bind)
    return s


def no_pydblp_anywhere() -> list:
    left = [e for e in host.loaded()]
    if (bpf.PIN_ROOT / "host").exists():
        left += list((bpf.PIN_ROOT / "host").rglob("*"))
    return left


@pytest.mark.vm
def test_cli_load_traffic_counters_unload_all(pair, capsys):
    """Ends with `dblp unload --all`, which (by design) clears every pydblp attachment on the host."""
    a, b = pair
    assert cli.main(["load", "vb", "--netns", b]) == 0
    assert net.xdp_query("vb", b)["mode"] == net.Mode.NATIVE
    assert cli.main(["job", "add", "vb", "--netns", b, "--job", "7", "--world", "2", "--rank", "1",
                     "--transport", "udp"]) == 0
    rx = udp_socket(b, (B, PORT))
    rx.settimeout(2)
    tx = udp_socket(a)
    n = 500
    got = set()
    for i in range(n):  # in steps of 50, so the socket buffer (1 MB) never overflows
        tx.sendto(wire.encode(wire.Header(job=7, src=0, dst=1, chunk=i, nchunks=n), struct.pack("!I", i)),
                  (B, PORT))
        if i % 50 == 49:
            while len(got) <= i:
                hdr, payload = wire.decode(rx.recv(2048), world_size=2, rank=1)
                got.add(struct.unpack("!I", payload)[0])
    assert got == set(range(n))
    tx.sendto(b"\xde\xad" * 20, (B, PORT))          # bad magic
    tx.sendto(wire.encode(wire.Header(job=8, dst=1)), (B, PORT))  # unregistered job
    tx.sendto(b"not dblp", (B, PORT + 1))            # other port: passes
    with host.open_pinned("vb", b) as m:
        c = m.counters()
    assert c["dblp_pass"] == n
    assert c["drop"]["magic"] == 1 and c["drop"]["job"] == 1
    assert c["pass"] >= 1  # the other-port datagram (and any ARP)
    # pins of another pydblp version (a map this one needs is not there): one line saying what to do
    pin = host.pin_dir("vb", b) / "ctrl_seen"
    with bpf.Map.pinned(pin) as kept:  # (the attached program keeps the map; the pin goes for a while)
        pin.unlink()
        try:
            with pytest.raises(host.HostError, match=r"lacks map\(s\) ctrl_seen .*`dblp unload vb --netns"):
                host.open_pinned("vb", b)
        finally:
            bpf.obj_pin(kept.fd, pin)
    capsys.readouterr()
    assert cli.main(["status"]) == 0
    out = capsys.readouterr().out
    row = next(line.split() for line in out.splitlines() if line.startswith(b))
    assert row[:3] == [b, "vb", "native"] and row[4] == "7:1/2u" and int(row[7]) == 2
    assert cli.main(["stats", "vb", "--netns", b, "0.05", "2"]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 3
    assert cli.main(["unload", "--all"]) == 0
    assert net.xdp_query("vb", b) is None and net.xdp_query("va", a) is None
    assert no_pydblp_anywhere() == []
    assert not any(l["xdp_prog_id"] for ns in (a, b) for l in net.links(ns))
    rx.close(), tx.close()


def test_load_refuses_twice_and_foreign_program_unless_forced(pair, capsys):
    from bcc import BPF

    a, b = pair
    assert cli.main(["load", "vb", "--netns", b]) == 0
    assert cli.main(["load", "vb", "--netns", b]) == 2
    assert "already loaded" in capsys.readouterr().err
    assert cli.main(["unload", "vb", "--netns", b]) == 0
    foreign = BPF(text=b"int other(struct xdp_md *ctx) { return 2; }")
    fn = foreign.load_func(b"other", BPF.XDP)
    net.xdp_attach("vb", fn.fd, net.Mode.SKB, b)
    assert cli.main(["load", "vb", "--netns", b]) == 2
    err = capsys.readouterr().err
    assert "'other'" in err and "--force" in err and len(err.strip().splitlines()) == 1
    assert cli.main(["unload", "vb", "--netns", b]) == 2  # not ours: left alone
    assert net.xdp_query("vb", b)["mode"] == net.Mode.SKB
    assert cli.main(["load", "vb", "--netns", b, "--force"]) == 0
    assert host.attached_program("vb", b)["name"] == host.PROG_NAME
    assert net.xdp_query("vb", b)["mode"] == net.Mode.NATIVE  # the skb program went with --force
    foreign.cleanup()


def test_cli_mistakes_are_one_line(pair, capsys):
    a, b = pair
    for argv in (["load", "nosuch0", "--netns", b], ["stats", "vb", "--netns", b],
                 ["job", "list", "vb", "--netns", b], ["unload"], ["load", "vb", "--netns", "nosuchns"]):
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("dblp ") and len(err.splitlines()) == 1, err


def test_malformed_flood_is_counted_and_harmless(pair):
    """Random bytes, truncated headers and huge lengths: all dropped, all counted, then valid traffic flows."""
    a, b = pair
    with host.HostProgram("vb", netns=b) as p:
        p.register_job(7, 2, 1, "udp")
        rx = udp_socket(b, (B, PORT))
        rx.settimeout(2)
        tx = udp_socket(a)
        rng = random.Random(1)
        sent = 0
        good = wire.encode(wire.Header(job=7, src=0, dst=1, nchunks=2))
        for i in range(6000):
            kind = i % 3
            if kind == 0:
                buf = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 200)))
                if len(buf) >= 2 and buf[:2] == b"\xdb\x1b":
                    continue
            elif kind == 1:
                buf = good[: rng.randrange(0, wire.HEADER_LEN)]
            else:
                buf = good[:28] + struct.pack("!H", rng.randrange(1, 65536)) + good[30:]
            tx.sendto(buf, (B, PORT))
            sent += 1
            if sent % 100 == 0:
                # the program has taken in what was sent before more follows: a longer burst can
                # overflow the veth's 256-slot ring when its softirq is starved (drops it cannot count)
                assert poll_until(lambda: sum(p.counters()["drop"].values()) >= sent, timeout=5.0), sent
        for i in range(10):
            tx.sendto(good, (B, PORT))
        for i in range(10):
            assert wire.decode(rx.recv(2048), world_size=2, rank=1)[0].job == 7
        rx.settimeout(0.2)
        with pytest.raises(socket.timeout):
            rx.recv(2048)  # nothing malformed reached the socket
        c = p.counters()
        assert sum(c["drop"].values()) == sent
        assert c["drop"]["short"] >= 2000 and c["drop"]["length"] >= 2000 - 10
        assert c["dblp_pass"] == 10
        rx.close(), tx.close()
    assert net.xdp_query("vb", b) is None


def test_cli_peer_binding_drops_a_spoofed_source_on_a_real_veth(pair, capsys):
    """`dblp job add --peer 0=A,MAC`: rank 0's packets from A pass to the socket; the same
    packets from another address of the same host are dropped and counted as spoof_ip, shown by
    `dblp stats`; `dblp job peers` lists the binding; a bad --peer is one line."""
    a, b = pair
    with net.ipr(a) as ip:
        idx = ip.link_lookup(ifname="va")[0]
        ip.addr("add", index=idx, address="198.18.7.3", prefixlen=24)
        mac = ip.get_links(idx)[0].get_attr("IFLA_ADDRESS")
    assert cli.main(["load", "vb", "--netns", b]) == 0
    for bad, says in ((["--peer", "0:198.18.7.1"], "use RANK=IP[,MAC]"), (["--peer", "5=198.18.7.1"], "use 0..1"),
                      (["--peer", "0=198.18.7.1,zz"], "is not a MAC address")):
        assert cli.main(["job", "add", "vb", "--netns", b, "--job", "7", "--world", "2", "--rank", "1",
                         "--transport", "udp", *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err
    with host.open_pinned("vb", b) as m:
        assert m.jobs() == {} and m.peers() == {}  # all or nothing
    assert cli.main(["job", "add", "vb", "--netns", b, "--job", "7", "--world", "2", "--rank", "1",
                     "--transport", "udp", "--peer", f"0={A},{mac}"]) == 0
    capsys.readouterr()
    assert cli.main(["job", "peers", "vb", "--netns", b]) == 0
    assert ["7", "0", A, mac] in [line.split() for line in capsys.readouterr().out.splitlines()]
    # a mistake in re-adding the job leaves it as it was (it used to remove the job)
    assert cli.main(["job", "add", "vb", "--netns", b, "--job", "7", "--world", "2", "--rank", "1",
                     "--transport", "udp", "--peer", "0=bogus"]) == 2
    assert "is not an IP address" in capsys.readouterr().err
    with host.open_pinned("vb", b) as m:
        assert m.jobs()[7]["world_size"] == 2 and m.peers()[(7, 0)]["mac"] == mac
        m.set_job(8, 4, 1, "udp", [(3, "198.18.7.9", None), (2, "198.18.7.8", None)])
        m.set_job(8, 3, 1, "udp")  # a smaller world: rank 3's binding goes, rank 2's stays
        assert sorted(r for j, r in m.peers() if j == 8) == [2]
        assert m.unregister_job(8)
    rx = udp_socket(b, (B, PORT))
    rx.settimeout(2)
    good, spoof = udp_socket(a, (A, 0)), udp_socket(a, ("198.18.7.3", 0))
    pkt = wire.encode(wire.Header(job=7, src=0, dst=1, nchunks=1))
    for _ in range(5):
        spoof.sendto(pkt, (B, PORT))
    good.sendto(pkt, (B, PORT))
    assert rx.recvfrom(2048)[1][0] == A  # only the bound address's packet arrives
    rx.settimeout(0.2)
    with pytest.raises(socket.timeout):
        rx.recv(2048)
    with host.open_pinned("vb", b) as m:
        c = m.counters()
    assert c["drop"]["spoof_ip"] == 5 and c["dblp_pass"] == 1
    for s in (rx, good, spoof):
        s.close()


def test_a_process_inside_a_namespace_finds_that_namespaces_pins_only(pair):
    """Pins live on the host's one bpffs: a process that entered namespace a (``ip netns exec``,
    ``nsenter``) and names no namespace must find the program pinned for a's ``va``, never
    take another namespace's for its own (``-`` stays the root namespace's)."""
    a, b = pair
    assert host.pin_dir("eth0", None).parent.name == "-"
    with net.in_netns(a):
        assert net.current_netns() == a
        assert host.pin_dir("va", None) == host.pin_dir("va", a)
    with host.HostProgram("va", netns=a, pin=True) as h:
        h.register_job(5, 2, 0, "xsk")
        with net.in_netns(a):
            maps = host.open_pinned("va")  # as a process started there would
        with maps:
            assert maps.jobs()[5]["rank"] == 0
        with net.in_netns(b), pytest.raises(host.HostError, match="not loaded on va"):
            host.open_pinned("va")
    assert not host.pin_dir("va", a).exists()


def test_a_process_s_own_program_is_its_own(pair, capsys):
    """A data plane's program (not kept) is attached through a BPF link: another program cannot
    replace it, `dblp unload` refuses it in one line naming the owner, `unload --all` leaves it,
    and it goes when its owner closes it (or dies: tests/linux/test_crash_hygiene.py)."""
    a, b = pair
    with host.HostProgram("vb", netns=b) as p:
        assert p.link is not None and host.attached_program("vb", b)["prog_id"] == p.prog_id
        with pytest.raises(net.NetError, match="belongs to a running process"):  # (even forced)
            host.HostProgram("vb", netns=b, force=True).close()
        capsys.readouterr()
        assert cli.main(["unload", "vb", "--netns", b]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "belongs to a running process" in err, err
        assert cli.main(["unload", "--all"]) == 0
        assert "kept vb" in capsys.readouterr().err
        assert host.attached_program("vb", b)["prog_id"] == p.prog_id
    assert host.attached_program("vb", b) is None
    assert no_pydblp_anywhere() == []
