"""The AF_XDP ring bookkeeping (:mod:`pydblp.transport.xsk_ring`) over plain memory: no socket, no root."""

from __future__ import annotations

import numpy as np
import pytest

from pydblp.transport.xsk_ring import ADDR_DTYPE, DESC_DTYPE, Ring, frame_size_for, pow2

OFFS = (0, 64, 256, 128)  # producer, consumer, descriptors, flags: the kernel's cache-line layout


def ring(n: int, dtype=ADDR_DTYPE, start: int = 0) -> Ring:
    r = Ring(bytearray(256 + n * dtype.itemsize), OFFS, n, dtype)
    r.prod[0] = r.cons[0] = start
    return r


def test_produce_fills_what_fits_and_wraps_around_the_ring_end():
    r = ring(8)
    assert r.produce(np.arange(5, dtype=np.uint64)) == 5
    assert (r.used(), r.free()) == (5, 3)
    r.consume(int(r.cons[0]), 4)  # the kernel took four
    assert r.produce(np.arange(100, 110, dtype=np.uint64)) == 7  # 3 + 4 free: the last three are refused
    assert r.used() == 8 and r.free() == 0
    # slots 5, 6, 7 then 0..3: written across the end of the descriptor array
    assert list(r.desc) == [103, 104, 105, 106, 4, 100, 101, 102]
    assert list(r.at(4, 8)) == [4, 100, 101, 102, 103, 104, 105, 106]


def test_indices_wrap_at_two_to_the_32():
    r = ring(8, start=0xFFFFFFFE)
    assert r.produce(np.array([7, 8, 9], np.uint64)) == 3
    assert int(r.prod[0]) == 1 and r.used() == 3  # 0xFFFFFFFE + 3 modulo 2^32
    assert list(r.at(0xFFFFFFFE, 3)) == [7, 8, 9]
    r.consume(0xFFFFFFFE, 3)
    assert int(r.cons[0]) == 1 and r.used() == 0 and r.free() == 8


def test_at_is_a_view_unless_the_entries_wrap():
    r = ring(4, DESC_DTYPE)
    r.desc["addr"] = [10, 11, 12, 13]
    view = r.at(1, 3)
    assert np.shares_memory(view, r.desc) and list(view["addr"]) == [11, 12, 13]
    wrapped = r.at(3, 3)
    assert not np.shares_memory(wrapped, r.desc) and list(wrapped["addr"]) == [13, 10, 11]


def test_sizes_must_be_powers_of_two():
    assert pow2(4096, "rx_ring") == 4096
    for bad in (0, -8, 3000):
        with pytest.raises(ValueError, match=f"rx_ring must be a power of two, got {bad}"):
            pow2(bad, "rx_ring")
    with pytest.raises(ValueError, match="ring size"):
        Ring(bytearray(512), OFFS, 6, ADDR_DTYPE)


def test_close_over_plain_memory_drops_the_views():
    r = ring(8)
    assert r.close() and r.desc is None and r.prod is None


def test_frame_size_for_the_collectives_chunks():
    assert frame_size_for(1408) == 2048  # the default chunk
    assert frame_size_for(8000) == 4096  # a jumbo chunk spans frames
