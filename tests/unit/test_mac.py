"""Batched tag MACs (pydblp.mac): the C path and the hashlib path give wire.tag's MAC byte for
byte, for any key, epoch, header and payload length; a flipped bit anywhere in a tagged
packet fails verification on either path; without a compiler the hashlib path is used."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pydblp import mac, wire
from pydblp.transport import auth
from pydblp.transport.udp import UdpTransport
from tests.helpers import needs_native

ROOT = Path(__file__).resolve().parents[2]

# tools/setup installs the compiler: where the suite must run whole (CI), a missing C path fails
needs_cc = needs_native("mac", mac.native_available())
PATHS = [pytest.param(True, marks=needs_cc, id="c"), pytest.param(False, id="hashlib")]


def packets(rng, n, width):
    """n random header records and (n, width) payload rows; lengths cover 0, block edges, width."""
    h = wire.empty_batch(n)
    h.view(np.uint8).reshape(n, wire.HEADER_LEN)[:] = rng.integers(0, 256, (n, wire.HEADER_LEN), dtype=np.uint8)
    pay = rng.integers(0, 256, (n, width), dtype=np.uint8)
    edges = [e for e in (0, 1, 95, 96, 97, 223, 224, 225, width) if e <= width]
    body = np.concatenate([edges, rng.integers(0, width + 1, max(0, n - len(edges)))])[:n].astype(np.int64)
    return h, pay, body


def reference(key, epoch, h, pay, body):
    """wire.tag's MAC of each packet, the definition."""
    return [wire.tag(key, h[i].tobytes() + pay[i, : body[i]].tobytes(), epoch)[wire.EPOCH_LEN:]
            for i in range(len(h))]


@pytest.mark.parametrize("native", PATHS)
def test_macs_equal_wire_tag_for_random_keys_epochs_and_lengths(native):
    rng = np.random.default_rng(32)
    for trial in range(40):
        key = rng.bytes(int(rng.integers(wire.KEY_MIN, wire.KEY_MAX + 1)))
        epoch = int(rng.integers(0, 1 << 32))
        n = int(rng.integers(1, 40))
        h, pay, body = packets(rng, n, int(rng.choice([0, 1, 100, 1408, 1500, 9000])))
        got = mac.Macs(key, epoch, native)(h, pay, body)
        assert got.shape == (n, wire.MAC_LEN)
        assert [r.tobytes() for r in got] == reference(key, epoch, h, pay, body), trial


@needs_cc
def test_the_c_and_hashlib_paths_agree_on_row_subsets_and_strided_rows():
    """Rows picked by index, payload rows inside a wider array (row stride > width), one size."""
    rng = np.random.default_rng(33)
    key, epoch = rng.bytes(32), 0xDEADBEEF
    h, wide, body = packets(rng, 300, 2000)
    pay = wide[:, 7:1415]  # stride 2000, width 1408
    body = np.minimum(body, 1408)
    rows = rng.permutation(300)[:123]
    c, py = mac.Macs(key, epoch, True), mac.Macs(key, epoch, False)
    assert c.native and not py.native
    assert np.array_equal(c(h, pay, body, rows), py(h, pay, body, rows))
    assert np.array_equal(c(h, pay, body), py(h, pay, body))
    same = np.full(300, 1408, np.int64)
    assert np.array_equal(c(h, pay, same), py(h, pay, same))
    assert c(h[:0], pay[:0], body[:0]).shape == (0, wire.MAC_LEN)


@pytest.mark.parametrize("native", PATHS)
def test_a_length_past_the_row_is_refused(native):
    rng = np.random.default_rng(34)
    h, pay, _ = packets(rng, 4, 100)
    m = mac.Macs(b"k" * 16, 1, native)
    with pytest.raises(ValueError, match="outside 0..100"):
        m(h, pay, np.array([0, 1, 101, 2]))
    with pytest.raises(ValueError, match="rows"):
        m(h, pay, np.zeros(4, np.int64), np.array([4]))
    assert m(h, pay, np.array([0, 1, 101, 2]), np.array([0, 3])).shape == (2, wire.MAC_LEN)


@pytest.mark.parametrize("native", PATHS)
def test_a_flipped_bit_anywhere_fails_verification(native, monkeypatch):
    """Each bit of a tagged datagram (header, payload, epoch, MAC) flipped in turn and sent over
    loopback: none is handed on, every one is counted (malformed by the inner transport, the
    rest by reason; each payload and MAC bit as a bad tag at least); the unaltered one verifies."""
    monkeypatch.setattr(auth, "Macs", functools.partial(mac.Macs, native=native))
    key, epoch = bytes(range(40)), 0x5EED0002
    h = wire.Header(job=3, round=7, src=1, dst=0, nchunks=4, chunk=1)
    good = wire.encode(h, bytes(range(100, 200)), key=key, epoch=epoch)
    flipped = [bytes(good[:i // 8]) + bytes([good[i // 8] ^ (1 << i % 8)]) + good[i // 8 + 1:]
               for i in range(8 * len(good))]
    with auth.authenticate(UdpTransport(port=0), key, epoch) as t:
        assert t._macs.native is native
        rx = auth.Batch.empty(256, 1500)
        verified = dropped = 0
        for at in range(0, len(flipped), 64):  # in bursts the socket buffer holds
            group = flipped[at: at + 64]
            _send_raw(t.port, group)
            end = time.monotonic() + 3
            target = dropped + verified + len(group)
            while time.monotonic() < end:
                verified += t.recv(rx, timeout=0.05).n
                s = t.stats()  # malformed: the inner transport's rx_invalid; the rest: auth_*
                dropped = s["rx_invalid"] + sum(s[f"auth_{r}"] for r in auth.REASONS)
                if dropped + verified >= target:
                    break
        assert verified == 0
        assert dropped == len(flipped)
        assert t.stats()["auth_bad_tag"] >= 8 * (len(good) - wire.HEADER_LEN - wire.EPOCH_LEN)
        _send_raw(t.port, [good])
        end = time.monotonic() + 3
        while not verified and time.monotonic() < end:
            verified += t.recv(rx, timeout=0.05).n
        assert verified == 1 and t.stats()["auth_verified"] == 1


def _send_raw(port, pkts):
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for p in pkts:
            s.sendto(p, ("127.0.0.1", port))


def _child(code: str, **env) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k != "DBLP_NATIVE"}  # (these children test the loading itself)
    e.update(PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=300)


_PROBE = """
import logging, numpy as np
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from pydblp import mac, native, wire
native._installed = lambda name: None  # (what these tests check is the first-use build)
h = wire.empty_batch(3); h["round"] = [1, 2, 3]
pay = np.arange(3 * 300, dtype=np.uint8).reshape(3, 300)
got = mac.Macs(b"k" * 32, 9)(h, pay, np.array([0, 150, 300]))
ref = [wire.tag(b"k" * 32, h[i].tobytes() + pay[i, :b].tobytes(), 9)[4:] for i, b in enumerate((0, 150, 300))]
assert [r.tobytes() for r in got] == ref
print("native", mac.native_available())
"""


def test_without_a_compiler_the_hashlib_path_gives_the_same_tags_and_one_warning(tmp_path):
    r = _child(_PROBE, CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "native False" in r.stdout
    assert r.stderr.count("WARNING") == 1 and "no C compiler" in r.stderr and "pure-Python" in r.stderr


@needs_cc
def test_the_build_is_cached_per_user_and_reused(tmp_path):
    r = _child(_PROBE, XDG_CACHE_HOME=str(tmp_path))
    assert r.returncode == 0 and "native True" in r.stdout and "WARNING" not in r.stderr, r.stderr
    built = list((tmp_path / "pydblp").glob("mac-*.so"))
    assert len(built) == 1 and built[0].stat().st_mode & 0o022 == 0
    assert (tmp_path / "pydblp").stat().st_mode & 0o077 == 0
    first = built[0].stat().st_mtime_ns
    r = _child(_PROBE, XDG_CACHE_HOME=str(tmp_path))  # loads the cached file, compiles nothing
    assert r.returncode == 0 and "native True" in r.stdout, r.stderr
    assert [p.stat().st_mtime_ns for p in (tmp_path / "pydblp").iterdir()] == [first]


@needs_cc
def test_the_mac_loads_the_build_for_this_cpu_before_the_installed_copy(monkeypatch):
    """pip install builds the C for the baseline CPU: the MAC's SIMD lanes ran about 4x slower from that
    copy (2.3 against 0.6 us a packet on an AVX-512 machine), so where a compiler is the MAC is
    built with -march=native first; the installed copy is the fallback."""
    import shutil

    from pydblp import native

    if not shutil.which(os.environ.get("CC") or "cc"):
        pytest.skip("no C compiler: the installed copy is what there is")
    asked = []
    monkeypatch.setattr(native, "_libs", {})
    monkeypatch.setattr(native, "_installed", lambda name: asked.append(name))
    lib = native.load("mac", mac._declare, mac._selftest, tuned=True)
    assert lib is not None and asked == [] and Path(lib._name).parent == native._cache_dir()
