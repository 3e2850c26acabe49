"""`dblp dump -i --netns` captures live DBLP traffic between two namespaces."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import pytest

from pydblp import net, wire
from pydblp.wire import Header

pytestmark = pytest.mark.netns

A_ADDR, B_ADDR = "198.18.0.1", "198.18.0.2"
VALID = re.compile(rf"^\d\d:\d\d:\d\d\.\d{{6}} {A_ADDR}:\d+ > {B_ADDR}:47800 DATA job 77 round 5 tensor 3 "
                   r"rank 1->2 chunk (\d+)/1000 prio 4 len 8 flags RETX$")
MALFORMED = re.compile(rf"^\d\d:\d\d:\d\d\.\d{{6}} {A_ADDR}:\d+ > {B_ADDR}:47800 malformed \(magic\) 40 bytes$")


@pytest.fixture(params=["dvb", "eth0"])
def veth_pair(netns, request):
    """Two namespaces joined by a veth pair: (ns_a, ns_b, ifname in b).  Also named eth0 in b,
    as a testbed worker's NIC is: a name the host may use for another interface (another
    index), which the capture must not confuse with it."""
    a, b = netns("a"), netns("b")
    name = request.param
    with net.ipr(a) as ip:
        ip.link("add", ifname="dva", kind="veth", peer={"ifname": name, "net_ns_fd": b})
        idx = ip.link_lookup(ifname="dva")[0]
        ip.addr("add", index=idx, address=A_ADDR, prefixlen=30)
        ip.link("set", index=idx, state="up")
    with net.ipr(b) as ip:
        idx = ip.link_lookup(ifname=name)[0]
        ip.addr("add", index=idx, address=B_ADDR, prefixlen=30)
        ip.link("set", index=idx, state="up")
    return a, b, name


@pytest.mark.vm
def test_dump_live_in_netns(veth_pair):
    a, b, ifname = veth_pair
    count = 4
    proc = subprocess.Popen([sys.executable, "-m", "pydblp.cli", "dump", "-i", ifname, "--netns", b,
                             "-c", str(count), "--timeout", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # send until the capture has seen enough: it may start after the first packets
        with net.in_netns(a):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                deadline = time.monotonic() + 20
                i = 0
                while proc.poll() is None and time.monotonic() < deadline:
                    if i % 2:
                        s.sendto(b"\x00" * 40, (B_ADDR, wire.DEFAULT_PORT))
                    else:
                        h = Header(job=77, round=5, tensor=3, src=1, dst=2, prio=4, chunk=i, nchunks=1000,
                                   flags=wire.Flag.RETX)
                        s.sendto(wire.encode(h, b"12345678"), (B_ADDR, wire.DEFAULT_PORT))
                    i += 1
                    time.sleep(0.05)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) == count, out
    assert all(VALID.match(ln) or MALFORMED.match(ln) for ln in lines), out
    chunks = [int(m.group(1)) for m in map(VALID.match, lines) if m]
    assert chunks and chunks == sorted(chunks)
    assert any(MALFORMED.match(ln) for ln in lines)
