"""Authenticated transport: every DBLP packet of a job carries a tag made with the job key.

:func:`authenticate` wraps any :class:`~pydblp.transport.base.Transport` in an
:class:`AuthTransport` given the job key and the run epoch (:mod:`pydblp.jobkey`
loads the one and draws the other); without a key it returns the transport
itself, so a keyless job sends and receives byte for byte what it did before.

Send: every packet (DATA, PROBE, BITMAP, STOP, HELLO, a broadcast all-gather:
whatever goes through :meth:`AuthTransport.send`) gets flag ``TAG`` and the
16-byte tag after its payload (:func:`pydblp.wire.tag`: the run epoch, then a
keyed BLAKE2b-96 MAC over the whole header, flags and ``len`` included, and
the payload, salted with the epoch).  A forger without the key can change no
field (job, round, tensor, kind, src, dst, chunk, ...) nor a payload byte.

Receive: every packet the inner transport returns is checked before the
caller sees it.  One that fails is dropped and counted in :meth:`stats`:

``auth_untagged``   no tag (flag ``TAG`` clear): a forgery, or a rank without the key
``auth_epoch``      the tag names another run epoch: a packet of an earlier run
                    replayed, or a rank of another run
``auth_bad_tag``    the MAC does not verify: forged or altered, or made with another key
``auth_truncated``  cut by the receive buffer, so its tag cannot be checked (the inner
                    transport counted the cut in ``rx_truncated``; here it stops)

A packet that verifies is handed over as an untagged one would be (flag ``TAG``
cleared, the tag left out of ``lengths``), so the layer above needs no change:
:class:`~pydblp.collective.Collective` takes it as it takes a keyless packet
(and still rejects tagged DATA: a tag reaches it only from a sender with a key
while it has none).  Counted too: ``auth_tagged`` (sent), ``auth_verified``.

Replays within a run carry a genuine tag and pass here; the header binds the
round and tensor, and the collective ignores packets of the rounds it has
finished (DATA counted ``late``; a probe for one gets a STOP, as a lost STOP
does), so a replayed packet changes no result and ends no message it did
not end the first time.

Different keys: while no packet has verified here yet, a rank whose packets
all fail, from a registered peer address (``peer`` >= 0), at least ``FAIL_MIN``
of them in a streak (no gap of ``fail_after``) begun ``fail_after`` seconds ago,
makes :meth:`AuthTransport.recv` raise :class:`~pydblp.transport.base.TransportError`
naming the rank and the likely cause (another key, no key, another run), then
on every later call: the job fails with one clear error instead of waiting out
``peer_timeout``.  Once any packet has verified, this rank shares the key and
the run with a peer, and a header's ``src`` is not proof of who sent a packet
that fails: a streak is then logged (a warning naming the rank and the likely
cause, once a streak) and never raised, so forged packets cannot stop the job;
a rank that truly holds another key goes silent to the collective, which fails
the round at ``peer_timeout`` naming it.

Cost: hashing, one BLAKE2b pass over each packet sent and each received, a
whole batch per call (:class:`pydblp.mac.Macs`: C over SIMD lanes, or hashlib
where no C compiler is; ``bench/auth_cost.py``); the rest (trailers, checks,
compaction) is numpy on the whole batch.  Thread model as the inner transport's: one thread in
``send``, one in ``recv``.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from pydblp import wire
from pydblp.mac import Macs
from pydblp.transport.base import DEFAULT_MAXLEN, Batch, Transport, TransportError
from pydblp.wire import EPOCH_LEN, FLAG_TAG, TAG_LEN

log = logging.getLogger(__name__)

FAIL_AFTER = 1.0  # s of nothing but failing packets from a rank before recv raises
FAIL_MIN = 8      # failing packets at least, too (a live rank sends more in its first round's burst or probes)
REASONS = ("untagged", "epoch", "bad_tag", "truncated")


def authenticate(transport: Transport, key: bytes | None, epoch: int | None,
                 fail_after: float = FAIL_AFTER) -> Transport:
    """``transport`` with every packet tagged and checked under ``key`` (``transport`` itself
    when ``key`` is None: a keyless job is unchanged).

    Args:
        transport: an open transport; the result owns it (closing it closes ``transport``).
        key: the job key (:func:`pydblp.jobkey.load_key`), or None.
        epoch: this run's epoch, the same on every rank (:func:`pydblp.jobkey.new_epoch`):
            required with a key (a fixed one would let packets of one run pass in the next).
        fail_after: seconds of failing packets from a rank, before any packet verified,
            until ``recv`` raises; keep it below the collective's ``peer_timeout``.

    Raises:
        ValueError: a key without an epoch, a key of the wrong length, an epoch out of range.
    """
    if key is None:
        return transport
    return AuthTransport(transport, key, epoch, fail_after)


class AuthTransport(Transport):
    """Tag every packet sent, verify and untag every packet received (see the module docstring).

    Args:
        inner: the transport that moves the packets (owned: :meth:`close` closes it).
        key: the job key, ``wire.KEY_MIN``..``wire.KEY_MAX`` bytes.
        epoch: the run epoch, 0..2**32-1, the same on every rank of the run.
        fail_after: as :func:`authenticate`'s.

    Raises:
        ValueError: a key of the wrong length or an epoch out of range.
    """

    kind = "auth"

    def __init__(self, inner: Transport, key: bytes, epoch: int, fail_after: float = FAIL_AFTER):
        if epoch is None:
            raise ValueError("a job key needs the run's epoch: one rank draws it (pydblp.jobkey.new_epoch) "
                             "and gives it to all")
        key = bytes(key)
        if not wire.KEY_MIN <= len(key) <= wire.KEY_MAX:
            raise ValueError(f"job key of {len(key)} bytes: use {wire.KEY_MIN}..{wire.KEY_MAX} "
                             f"(head -c 32 /dev/urandom > job.key)")
        if not 0 <= epoch < 1 << 32:
            raise ValueError(f"epoch {epoch}: use 0..2**32-1")
        self.inner, self.epoch, self.fail_after = inner, epoch, fail_after
        self._macs = Macs(key, epoch)
        self._epb = np.frombuffer(epoch.to_bytes(EPOCH_LEN, "big"), np.uint8)
        self._c = {f"auth_{r}": 0 for r in ("tagged", "verified", *REASONS)}
        self._c["rx_errors"] = 0  # batches this layer dropped on an error (Transport.recv)
        self._c["rx_truncated"] = 0  # verified packets cut to the caller's rows
        self._rx: Batch | None = None
        self._txh = wire.empty_batch(0)
        self._txp = np.empty((0, 0), np.uint8)
        self._good = np.zeros(1 << 16, bool)   # per claimed src rank: a packet of it has verified
        self._failing: dict[int, list] = {}    # src -> [streak's first failure, count, reason, epoch, last,
        #                                               logged]
        self._failed: str | None = None        # the error recv raises from now on

    # ---- the inner transport's ------------------------------------------
    netns = property(lambda self: self.inner.netns)
    ifname = property(lambda self: self.inner.ifname)
    queue = property(lambda self: self.inner.queue)
    port = property(lambda self: self.inner.port)
    timeout_unit = property(lambda self: self.inner.timeout_unit)

    def add_peer(self, addr, port: int = wire.DEFAULT_PORT, mac=None) -> int:
        return self.inner.add_peer(addr, port, mac)

    def tx_backlog(self) -> float:
        return self.inner.tx_backlog()

    def set_ect(self, on: bool) -> None:
        self.inner.set_ect(on)

    ect = property(lambda self: self.inner.ect)

    def tx_queued(self) -> int:
        return self.inner.tx_queued()

    reports_tx_queue = property(lambda self: self.inner.reports_tx_queue)

    def fileno(self) -> int:
        return self.inner.fileno()

    def close(self) -> None:
        self.inner.close()

    def stats(self) -> dict:
        """The inner transport's counters and ``auth_*`` (see the module docstring)."""
        inner = self.inner.stats()
        return {**inner, **self._c, "rx_errors": inner.get("rx_errors", 0) + self._c["rx_errors"],
                "rx_truncated": inner.get("rx_truncated", 0) + self._c["rx_truncated"]}

    # ---- tags -----------------------------------------------------------
    def send(self, batch: Batch, timeout: float | None = 1.0) -> int:
        """Tag and send every packet of ``batch`` (untagged: its ``lengths`` exclude any tag);
        as :meth:`Transport.send`."""
        self._check_open()
        n = len(batch)
        if n == 0:
            return 0
        lens = batch.lengths[:n]
        w = int(lens.max())
        if len(self._txh) < n or self._txp.shape[1] < w + TAG_LEN:  # kept across calls
            self._txh = wire.empty_batch(max(n, len(self._txh)))
            self._txp = np.empty((len(self._txh), max(w + TAG_LEN, self._txp.shape[1])), np.uint8)
        h, p = self._txh[:n], self._txp[:n]
        wire.put(h, batch.headers[:n])
        h["flags"] |= FLAG_TAG
        h["len"] = lens
        p[:, :w] = batch.payload[:n, :w]
        trailer = np.empty((n, TAG_LEN), np.uint8)
        trailer[:, :EPOCH_LEN] = self._epb
        trailer[:, EPOCH_LEN:] = self._macs(h, p, lens, None)
        if int(lens.min()) == w:
            p[:, w: w + TAG_LEN] = trailer
        else:
            p[np.arange(n)[:, None], lens[:, None] + np.arange(TAG_LEN)] = trailer
        self._c["auth_tagged"] += n
        return self.inner.send(Batch(h, p, (lens + TAG_LEN).astype(np.int32), batch.peer[:n], n), timeout)

    def recv(self, into: Batch | None = None, timeout: float | None = 0.0, max: int | None = None,
             *, want: int = 1, linger: float = 0.0, copy: bool = True) -> Batch:
        """As :meth:`Transport.recv`, returning only packets whose tag verifies, untagged.

        Raises:
            TransportError: a rank's packets have failed for ``fail_after`` seconds without one
                that verified (another key, no key, another run); raised on every call from then on.
        """
        return super().recv(into, timeout, max, want=want, linger=linger, copy=copy)

    def _recv(self, into: Batch, timeout: float | None, max: int | None, want: int, linger: float,
              copy: bool) -> Batch:
        if self._failing:
            self._check_failing(time.monotonic())
        width = (into.maxlen if into.maxlen > DEFAULT_MAXLEN else DEFAULT_MAXLEN) + TAG_LEN  # a tag; misfits verify
        if self._rx is None or self._rx.cap < into.cap or self._rx.maxlen != width:
            self._rx = Batch.empty(into.cap, width)
        end = None if timeout is None else time.monotonic() + timeout
        wait = timeout
        while True:
            got = self.inner.recv(self._rx, wait, min(max or into.cap, into.cap), want=want, linger=linger,
                                  copy=False)
            out = self._deliver(got, into, copy) if got.n else into.view(0, 0)
            if out.n or not got.n or timeout == 0:
                return out
            if end is not None:  # everything that came was dropped: wait on for what is left
                wait = end - time.monotonic()
                if wait <= 0:
                    return into.view(0, 0)

    def _deliver(self, got: Batch, into: Batch, copy: bool) -> Batch:
        """Verify ``got``'s packets; those that pass, untagged, in ``into``'s rows (payloads lent
        from ``got`` when ``copy`` is False and all passed)."""
        n = got.n
        h, pay, lens = got.headers[:n], got.payload[:n], got.lengths[:n].astype(np.int64)
        body = h["len"].astype(np.int64)
        good = ((h["flags"] & FLAG_TAG) != 0) & (lens == body + TAG_LEN)
        allgood = bool(good.all())
        lo = int(lens.min())
        if allgood and lo == int(lens.max()):  # one size: the trailers are a column block
            trail = pay[:, lo - TAG_LEN: lo]
        else:  # only a tagged packet of the right length has a trailer (lent rows may be 0 wide)
            trail = np.zeros((n, TAG_LEN), np.uint8)
            rows = np.flatnonzero(good & (lens <= pay.shape[1]))
            if len(rows):
                trail[rows] = pay[rows[:, None], (lens[rows] - TAG_LEN)[:, None] + np.arange(TAG_LEN)]
        epoch_ok = (trail[:, :EPOCH_LEN] == self._epb).all(axis=1)
        if allgood and epoch_ok.all():
            ok = (self._macs(h, pay, body, None) == trail[:, EPOCH_LEN:]).all(axis=1)
        else:
            ok = good & epoch_ok
            rows = np.flatnonzero(ok)
            if len(rows):
                ok[rows] = (self._macs(h, pay, body, rows) == trail[rows, EPOCH_LEN:]).all(axis=1)
        k = int(np.count_nonzero(ok))
        self._c["auth_verified"] += k
        if k < n:
            self._count_bad(h, ok, good, epoch_ok, lens, body, trail, got.peer[:n])
        if k:
            self._good[h["src"][ok]] = True
        sel = None if k == n else np.flatnonzero(ok)
        hk = into.headers[:k]
        wire.put(hk, h if sel is None else wire.take(h, sel))
        hk["flags"] &= ~FLAG_TAG & 0xFF
        b = body if sel is None else body[sel]
        into.peer[:k] = got.peer[:n] if sel is None else got.peer[:n][sel]
        ecn = None
        if got.ecn is not None and into.ecn is not None:  # (a mark counts only on a packet that verified)
            ecn = into.ecn[:k]
            ecn[:] = got.ecn[:n] if sel is None else got.ecn[:n][sel]
        if copy or sel is not None:
            m = min(into.maxlen, pay.shape[1])
            into.payload[:k, :m] = pay[:, :m] if sel is None else pay[sel, :m]
            cut = b > m
            if cut.any():  # verified, then wider than the caller's rows: cut, as the inner transport cuts
                self._c["rx_truncated"] += int(np.count_nonzero(cut))
                b = np.minimum(b, m)
            out = into.payload
        else:
            out = pay  # lent: the inner transport's rows, valid until the next recv
        into.lengths[:k] = b
        into.n = k
        if out is into.payload:
            b = into.view(0, k)
            b.ecn = ecn
            return b
        return Batch(hk, out, into.lengths[:k], into.peer[:k], k, None, ecn)

    def _count_bad(self, h, ok, good, epoch_ok, lens, body, trail, peer) -> None:
        """Count the packets that failed, by reason; track ranks whose packets only fail."""
        tagged = (h["flags"] & FLAG_TAG) != 0
        untagged = ~tagged
        truncated = tagged & (lens != body + TAG_LEN)
        epoch = good & ~epoch_ok
        bad = good & epoch_ok & ~ok
        c = self._c
        c["auth_untagged"] += int(np.count_nonzero(untagged))
        c["auth_truncated"] += int(np.count_nonzero(truncated))
        c["auth_epoch"] += int(np.count_nonzero(epoch))
        c["auth_bad_tag"] += int(np.count_nonzero(bad))
        now = time.monotonic()
        src = h["src"].astype(np.intp)
        suspect = (untagged | epoch | bad) & (peer >= 0) & ~self._good[src]
        for i in np.flatnonzero(suspect).tolist():
            s = int(src[i])
            why = "untagged" if untagged[i] else "epoch" if epoch[i] else "bad_tag"
            seen = int.from_bytes(trail[i, :EPOCH_LEN].tobytes(), "big") if why == "epoch" else None
            f = self._failing.get(s)
            if f is None or now - f[4] > self.fail_after:  # a new streak (a live peer never pauses that long)
                f = self._failing[s] = [now, 0, why, seen, now, False]
            f[1] += 1
            f[2], f[3], f[4] = why, seen, now
        self._check_failing(now)

    def _check_failing(self, now: float) -> None:
        """Once a rank that never verified has failed ``FAIL_MIN`` times over ``fail_after``
        seconds, the last failure within ``fail_after``: raise (now and on every later call)
        while nothing has verified here; after that, log it once a streak (a forger can name
        any rank)."""
        if self._failed is None:
            anything = bool(self._good.any())
            for s, f in self._failing.items():
                if (f[1] >= FAIL_MIN and now - f[0] >= self.fail_after and now - f[4] <= self.fail_after
                        and not self._good[s]):
                    if not anything:
                        self._failed = self._fail_message(s, f, now)
                        break
                    if not f[5]:
                        f[5] = True
                        log.warning("%s (packets under a rank's name fail while others verify: forged, "
                                    "or that rank's key differs; it is not raised)", self._fail_message(s, f, now))
        if self._failed is not None:
            raise TransportError(self._failed)

    def _fail_message(self, src: int, f: list, now: float) -> str:
        first, count, why, seen = f[:4]
        head = f"rank {src}'s packets failed authentication for {now - first:.1f} s ({count} dropped, none verified): "
        if why == "untagged":
            return head + "they carry no tag: give every rank the job key (--key-file or DBLP_KEY_FILE)"
        if why == "epoch":
            return head + (f"they are of another run (epoch {seen:#010x}, this run's {self.epoch:#010x}): "
                           f"start every rank of a run together")
        return head + "ranks hold different job keys? give every rank a copy of the same key file"

