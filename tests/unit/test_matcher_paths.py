"""The compiled receive and the Python one on the same batches: the same round, counters,
control answers and stash (the round, batch and packet strategies are
``test_matcher_properties``'s).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pydblp import wire
from pydblp.collective import matcher
from pydblp.collective.config import AG, DATA, F32, FEW, RETX, STASH_AHEAD
from tests.helpers import require_native
from tests.unit.test_matcher_properties import (CB, MINE, SETTINGS, _b, _result, batches, build, matching_spec,
                                                peer, rounds, setup, widths)


@pytest.fixture(autouse=True, scope="module")
def _native():
    if matcher.native_lib() is None:
        require_native("matcher")


# DATA of the rounds next to the running one, from peers and not, to this rank and not, of this job and
# not, among packets the compiled absorb takes: what it tells the Python sort to stash, and what not
later_spec = st.fixed_dictionaries({
    "kind": st.just(DATA), "job": st.one_of(MINE, MINE, st.just(0x1E)),
    "round": st.sampled_from([1, 2, STASH_AHEAD, STASH_AHEAD + 1, -1, 1 << 31]), "tensor": MINE,
    "src": st.one_of(peer, peer, st.integers(0, 4)), "dst": st.one_of(MINE, MINE, st.just(wire.DST_ALL), st.integers(0, 3)),
    "prio": st.integers(0, 7), "dtype": st.just(F32), "nchunks": MINE, "chunk": st.integers(0, 12), "len": st.just(CB),
    "tol": st.integers(0, 0xFF), "flags": st.one_of(MINE, st.just(AG), st.just(0), st.just(AG | RETX)),
    "pick": st.integers(0, 3), "body": st.binary(max_size=CB),
})
stash_batches = st.lists(st.one_of(matching_spec, later_spec), min_size=FEW + 1, max_size=20)


@SETTINGS
@given(r=rounds, specs=batches, extra=widths)
def test_both_paths_sort_a_batch_alike(r, specs, extra):
    """The same batch into the same round on the compiled path and the Python one: the same rows
    and masks written, the same arrivals, STOPs and control answers queued, the same counters
    and the same packets stashed for the rounds to come."""
    _both_paths_alike(r, specs, extra)


@settings(SETTINGS, max_examples=300)
@given(r=rounds, specs=stash_batches, extra=widths)
def test_both_paths_stash_the_same_packets_of_rounds_to_come(r, specs, extra):
    """As above, on batches the compiled absorb takes with packets of the rounds next to the
    running one mixed in: the compiled absorb tells the Python sort which of the rows it leaves
    to stash, and those are exactly the ones the Python path stashes."""
    _both_paths_alike(r, specs, extra)


def _both_paths_alike(r: dict, specs: list, extra: int) -> None:
    seen = []
    for native in (True, False):
        lib = matcher.native_lib
        if not native:
            matcher.native_lib = lambda: None
        try:
            rk, s = setup(r)
        finally:
            matcher.native_lib = lib
        try:
            p = rk.p
            assert p.matcher.native is native
            h, pay, lens = build(p, s, specs, extra)
            p.process(s, h, pay, lens, 1e6)
            got = {k: _b(getattr(s, k, None)) for k in ("rmask", "have", "hi")}
            if getattr(s, "rbuf", None) is not None:  # (the inbox, y and the result are scratch: compared
                got["rbuf"] = _b(s.rbuf[s.rmask])     # where rows are in)
            have = getattr(s, "have", None)
            if have is not None:  # (rows all-gathered to it: in the result where the round writes one, else in y)
                have = have.copy()
                if s.my_shard is not None:
                    have[slice(*s.bounds[s.my_shard])] = False
                res = _result(s)
                got["y"] = _b(s.y[have] if res is None else res[s.perm[have]])
            got["ins"] = {k: (i.count, i.hi, i.tol8, i.done, i.stop_sent) for k, i in s.ins.items()}
            got["stash"] = [tuple(_b(a) for a in x) for x in p.matcher.stash]
            got["counters"] = dict(p.counters)
            got["ctrl"] = [tuple(c) for c in p.ctrl]
            seen.append(got)
        finally:
            rk.close()
    assert seen[0] == seen[1]
